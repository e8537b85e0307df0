"""The scoring half of scripts/container_check.sh: talks to a proctor in a container and to a
reference proctor on the host, over the wire, and exits 1 with a message when they disagree.

Why a separate file: the shell script owns the container engine (build, run, signals); this owns
what a client sees. It runs in the host's .venv (proctor's own stubs, no client package), so the
reference answers come from the host's install of the same sources.

Subcommands (each prints one line per check and exits non-zero on the first failure):
  wait    TARGET_HTTP [--timeout S]               until GET /health/ready answers 200
  compare GRPC HTTP REF_GRPC [--token T]          both transports score as the host does; a
                                                  request without the token is refused
  drain   GRPC --container NAME [--engine podman] SIGTERM while requests are in flight: every
                                                  admitted request answers right, exit code 0
  prom    PROM_URL                                Prometheus scraped the teacher's /metrics
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc

TOPK = 5
# Scores agree to float32 rounding: the same torch CPU build, the same weights, the same kernels.
TOLERANCE = 1e-5


def sequences(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token-id sequences inside the tiny teacher's vocabulary (512), from a fixed seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=length).tolist() for _ in range(count)]


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def score_grpc(target: str, ids: list[int], token: str | None, timeout: float = 120) -> dict:
    request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=TOPK, prompt_length=len(ids) // 2)
    with grpc.insecure_channel(target) as channel:
        reply = scoring_pb2_grpc.TeacherScoringStub(channel).Score(request, metadata=_metadata(token), timeout=timeout)
    first = reply.first_row
    return {"first": first, "logprobs": decode_tensor(reply.logprobs).tolist(),
            "topk_ids": decode_tensor(reply.topk_ids).tolist()}


def score_http(target: str, ids: list[int], token: str | None) -> dict:
    body = json.dumps({"token_ids": ids, "logprobs": True, "topk": TOPK, "prompt_length": len(ids) // 2}).encode()
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(target.rstrip("/") + "/v1/score", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=120) as reply:
        data = json.load(reply)
    first = data["first_row"]
    return {"first": first, "logprobs": data["logprobs"][first:], "topk_ids": data["topk_ids"][first:]}


def _differ(got: dict, want: dict) -> float:
    """Largest |log-prob difference|; inf when the rows or the top-k ids differ."""
    if got["first"] != want["first"] or got["topk_ids"] != want["topk_ids"]:
        return float("inf")
    a, b = np.asarray(got["logprobs"], np.float64), np.asarray(want["logprobs"], np.float64)
    return float("inf") if a.shape != b.shape else float(np.abs(a - b).max())


def _fail(message: str) -> None:
    print(f"container check FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


def wait_ready(http: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(http.rstrip("/") + "/health/ready", timeout=5):
                print(f"ready: {http}")
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    _fail(f"{http}/health/ready not 200 within {timeout:.0f}s")


def compare(grpc_target: str, http_target: str, ref_grpc: str, token: str | None) -> None:
    worst = 0.0
    for ids in sequences(4, 96):
        want = score_grpc(ref_grpc, ids, None)
        for name, got in (("grpc", score_grpc(grpc_target, ids, token)), ("http", score_http(http_target, ids, token))):
            diff = _differ(got, want)
            if diff > TOLERANCE:
                _fail(f"{name} scores differ from the host's (max |delta| {diff})")
            worst = max(worst, diff)
    print(f"scores: gRPC and HTTP agree with the host's, 4 sequences x 96 tokens, max |delta logprob| {worst:.2e}")
    if token:
        _refused_without_token(grpc_target, http_target)


def _refused_without_token(grpc_target: str, http_target: str) -> None:
    ids = sequences(1, 16)[0]
    try:
        score_grpc(grpc_target, ids, None)
        _fail("gRPC answered a request without the bearer token")
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            _fail(f"gRPC without token: {exc.code().name}, expected UNAUTHENTICATED")
    try:
        score_http(http_target, ids, None)
        _fail("HTTP answered a request without the bearer token")
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            _fail(f"HTTP without token: {exc.code}, expected 401")
    print("auth: a request without the token is refused (gRPC UNAUTHENTICATED, HTTP 401)")


def drain(grpc_target: str, ref_grpc: str, token: str | None, container: str, engine: str) -> None:
    """Requests go out on 8 threads; once 16 have been answered, SIGTERM goes to the container.
    Each request either answers with the host's scores or is refused UNAVAILABLE (the server is
    draining) before admission: nothing is cut off half-way, and the process exits 0."""
    batch = sequences(48, 2000, seed=1)
    outcomes: list[tuple[int, str, float, float, dict | None]] = []  # index, outcome, start, end, answer

    def one(i: int) -> None:
        start = time.monotonic()
        try:
            got, outcome = score_grpc(grpc_target, batch[i], token, timeout=300), "OK"
        except grpc.RpcError as exc:
            got, outcome = None, exc.code().name
        outcomes.append((i, outcome, start, time.monotonic(), got))

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(len(batch))]
        while len(outcomes) < 16 and not all(f.done() for f in futures):
            time.sleep(0.005)
        signalled = time.monotonic()
        subprocess.run([engine, "kill", "--signal", "TERM", container], check=True, capture_output=True)
        for f in futures:
            f.result()
    code = subprocess.run([engine, "wait", container], capture_output=True, text=True, check=True).stdout.strip()
    _judge_drain(outcomes, signalled, batch, ref_grpc, code)


def _judge_drain(outcomes, signalled: float, batch, ref_grpc: str, code: str) -> None:
    bad = [(i, o) for i, o, *_ in outcomes if o not in ("OK", "UNAVAILABLE")]
    if bad:
        _fail(f"drain: requests failed otherwise than UNAVAILABLE: {bad[:5]}")
    answered = [(i, got) for i, o, _, _, got in outcomes if o == "OK"]
    for i, got in answered:
        if _differ(got, score_grpc(ref_grpc, batch[i], None)) > TOLERANCE:
            _fail(f"drain: request {i} answered with wrong scores")
    in_flight = [i for i, o, start, end, _ in outcomes if start < signalled < end]
    finished = [i for i, o, start, end, _ in outcomes if start < signalled < end and o == "OK"]
    if not finished:
        _fail("drain: no request was in flight when SIGTERM came (the check proved nothing)")
    if code != "0":
        _fail(f"drain: the container exited {code}, expected 0")
    refused = sum(1 for _, o, *_ in outcomes if o == "UNAVAILABLE")
    print(f"drain: SIGTERM with {len(in_flight)} requests in flight: {len(finished)} of them finished with the "
          f"host's scores; {len(answered)} answered in all, {refused} refused UNAVAILABLE, none lost; exit code 0")


def prometheus(prom: str, timeout: float) -> None:
    """Prometheus's own API: the proctor job's target is up and a proctor series has samples."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        up = _prom_query(prom, 'up{job="proctor"}')
        scored = _prom_query(prom, "proctor:scored_tokens_total")
        if up and all(float(r["value"][1]) == 1 for r in up) and scored:
            total = sum(float(r["value"][1]) for r in scored)
            print(f"prometheus: job proctor up, proctor:scored_tokens_total = {total:.0f} over {len(scored)} series")
            return
        time.sleep(2)
    _fail(f"prometheus at {prom} did not scrape the teacher within {timeout:.0f}s")


def _prom_query(prom: str, query: str) -> list[dict]:
    url = prom.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)["data"]["result"]
    except (urllib.error.URLError, OSError, KeyError):
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("http")
    w.add_argument("--timeout", type=float, default=300)
    c = sub.add_parser("compare")
    c.add_argument("grpc")
    c.add_argument("http")
    c.add_argument("ref_grpc")
    c.add_argument("--token")
    d = sub.add_parser("drain")
    d.add_argument("grpc")
    d.add_argument("ref_grpc")
    d.add_argument("--token")
    d.add_argument("--container", required=True)
    d.add_argument("--engine", default="podman")
    m = sub.add_parser("prom")
    m.add_argument("prom")
    m.add_argument("--timeout", type=float, default=120)
    a = p.parse_args()
    if a.cmd == "wait":
        wait_ready(a.http, a.timeout)
    elif a.cmd == "compare":
        compare(a.grpc, a.http, a.ref_grpc, a.token)
    elif a.cmd == "drain":
        drain(a.grpc, a.ref_grpc, a.token, a.container, a.engine)
    else:
        prometheus(a.prom, a.timeout)


if __name__ == "__main__":
    main()
