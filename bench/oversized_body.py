"""How long an oversized body takes to be refused: 8.3 million token ids (a 50 MB JSON body, a
33 MB protobuf one) sent to a teacher that scores 512 tokens, on every surface that reads one.

`proctor serve` (torch engine, the tiny teacher at max_model_len 512) runs in its own process.
Each body is sent `--rounds` times; printed per surface: the status, and the median seconds from
the last byte sent to the answer (the upload itself, loopback, is timed apart and left out), with
the slowest `/health/live` a probe saw meanwhile. Wall clock: read it beside the same machine's
other figures.

    python bench/oversized_body.py [--ids 8300000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from proctor.proto import scoring_pb2

from support.servers import SubprocessServer

MAX_MODEL_LEN = 512


def bodies(count: int) -> dict[str, tuple[str, str, bytes]]:
    """surface -> (path, content type, body), each holding `count` ids."""
    ids = np.random.default_rng(0).integers(1, 100_000, count)
    text = ",".join(map(str, ids.tolist()))
    proto = scoring_pb2.ScoreRequest(teacher_key="tiny", logprobs=True)
    proto.token_ids.extend(ids.tolist())
    return {
        "/v1/score JSON": ("/v1/score", "application/json",
                           f'{{"teacher_key":"tiny","logprobs":true,"token_ids":[{text}]}}'.encode()),
        "/v1/score protobuf": ("/v1/score", "application/x-protobuf", proto.SerializeToString()),
        "/v1/completions": ("/v1/completions", "application/json",
                            f'{{"model":"tiny","max_tokens":1,"prompt_logprobs":0,"prompt":[{text}]}}'.encode()),
    }


def _post_raw(url: str, path: str, kind: str, body: bytes) -> tuple[int, float]:
    """POST over a bare socket: the status, and seconds from the last byte sent to the answer."""
    parts = urlparse(url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        sock.sendall(head + body)
        sent = time.perf_counter()
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        elapsed = time.perf_counter() - sent
    return int(answer.split(b" ", 2)[1]), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=8_300_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from proctor.server.cli.tiny_model import ensure_default_model

    server = SubprocessServer(["--model", str(ensure_default_model()), "--teacher-name", "tiny",
                               "--inference", f"max_model_len={MAX_MODEL_LEN}"])
    try:
        for name, (path, kind, body) in bodies(args.ids).items():
            stop, probes = threading.Event(), []

            def probe(stop: threading.Event = stop, probes: list[float] = probes) -> None:
                with httpx.Client(base_url=server.http_url, timeout=60) as client:
                    while not stop.is_set():
                        started = time.perf_counter()
                        client.get("/health/live")
                        probes.append(time.perf_counter() - started)
                        time.sleep(0.01)

            thread = threading.Thread(target=probe, daemon=True)
            thread.start()
            results = [_post_raw(server.http_url, path, kind, body) for _ in range(args.rounds)]
            stop.set()
            thread.join()
            statuses = sorted({status for status, _ in results})
            seconds = float(np.median([elapsed for _, elapsed in results]))
            print(f"{name:20s} {len(body) / 1e6:6.1f} MB  status {statuses}  refused after {seconds * 1000:8.1f} ms "
                  f"(median of {args.rounds})  slowest /health/live {max(probes) * 1000:7.1f} ms", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
