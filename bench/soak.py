"""A soak: steady mixed load on every surface for a set time, faults on a schedule, and one table
that says whether anything was lost, wrong or leaked.

`proctor serve --config` (two tiny teachers of other weights: `tiny-a` on two replicas, `tiny-b` on
one, each in a worker process, and a student tokenizer of another vocabulary for aligned requests;
`--engine vllm` for vLLM replicas at gpu_memory_utilization 0.12) runs in its own process. Client
threads send the request kinds of `KINDS` in turn to each teacher in turn (gRPC by `teacher_key`,
HTTP under the teacher's own `/teachers/{key}` base), each answer checked against that teacher's
reference (float64 log-softmax, `tests/support/reference.py`). On a schedule (fractions of `--minutes`): a replica worker
SIGKILLed, one SIGSTOPped for 20 s, hostile floods (oversized bodies, deep JSON, bad media,
unknown keys), slow stream readers and mid-request cancels, another SIGKILL (of a vLLM EngineCore
with `--engine vllm`), and at the end a SIGTERM drain under load and a restart.

Printed: sent / answered correctly / refused as expected / lost / wrong per kind; each process's
RSS, fds and threads at warm-up and at the end; p50/p99 per phase beside the quiet phase; the
server's Prometheus counts beside the clients' own.

    python bench/soak.py [--minutes 60] [--engine torch|vllm] [--clients 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor, encode_tensor

from support.reference import reference_rows
from support.scoring import sequences
from support.servers import SubprocessServer, engine_cores, replica_names

ATOL = 1e-4
TOPK = 4
KILL_WINDOW_S = 15.0  # latencies this long after a kill are the failover's, not the steady state's
EXPECTED_REFUSALS = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", 429, 503}


# -- the request kinds: each sends one call and returns the log-probs of rows 1..T-1 (numpy) ------

@dataclass
class AlignedCase:
    """An aligned request (a student of another tokenizer, `student_tokenizer=student`) made from a
    work sequence, and what its teacher must answer: the teacher's own tokenization of the text
    and the reference log-probs of its response rows."""

    student_ids: list[int]
    prompt_length: int
    teacher_prompt_ids: list[int]
    teacher_ids: list[int]
    expected: np.ndarray


class References:
    """One teacher's reference log-probs and full distributions per sequence, and its aligned
    cases, computed once."""

    def __init__(self, model_dir: Path, work: list[list[int]], student_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.rows = {tuple(ids): reference_rows(model_dir, ids) for ids in work}
        teacher, student = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(student_dir)
        self.aligned = {tuple(ids): _aligned_case(ids, model_dir, teacher, student) for ids in work}

    def check(self, kind: str, ids: list[int], got: np.ndarray) -> bool:
        if kind == "aligned":
            want = self.aligned[tuple(ids)].expected
            return got.shape == want.shape and np.allclose(got, want, atol=ATOL)
        ref = self.rows[tuple(ids)]
        if kind in ID_TABLE_KINDS:
            wanted = ref.distributions[:, [1, 2]].numpy()
            return got.shape == (len(ids) - 1, 3) and np.allclose(got[:, 0], ref.logprobs.numpy(), atol=ATOL) and (
                np.allclose(got[:, 1:], wanted, atol=ATOL))
        return got.shape == (len(ids) - 1,) and np.allclose(got, ref.logprobs.numpy(), atol=ATOL)


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "12", "times", "7", "is", "84",
         "and", "tea", "cools", "slowly")


def _aligned_case(ids: list[int], model_dir: Path, teacher, student) -> AlignedCase:
    words = [WORDS[token % len(WORDS)] for token in ids[: max(6, len(ids) // 3)]]
    prompt, response = "User: " + " ".join(words[:3]) + "? Assistant:", " " + " ".join(words[3:]) + "."
    s_prompt, t_prompt = student(prompt)["input_ids"], teacher(prompt)["input_ids"]
    t_ids = t_prompt + teacher(response)["input_ids"]
    expected = reference_rows(model_dir, t_ids, len(t_prompt)).logprobs.numpy()
    return AlignedCase(s_prompt + student(response)["input_ids"], len(s_prompt), t_prompt, t_ids, expected)


@dataclass
class Target:
    """One teacher as the clients see it: the server's gRPC target and the teacher's key, its own
    HTTP base (`/teachers/{key}`), and its reference."""

    grpc_target: str
    http_url: str
    teacher: str
    stub: scoring_pb2_grpc.TeacherScoringStub
    refs: References


class Refused(Exception):
    """An answer the caller is told to retry (UNAVAILABLE, 429, 503): expected while draining."""


def _grpc(call: Callable[[], object]):
    try:
        return call()
    except grpc.RpcError as error:
        if error.code().name in EXPECTED_REFUSALS:
            raise Refused(error.code().name) from None
        raise


def _http(reply: httpx.Response) -> httpx.Response:
    if reply.status_code in EXPECTED_REFUSALS:
        raise Refused(str(reply.status_code))
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
    return reply


def grpc_unary(t: Target, ids: list[int]) -> np.ndarray:
    request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=TOPK, teacher_key=t.teacher)
    answer = _grpc(lambda: t.stub.Score(request, timeout=60))
    return decode_tensor(answer.logprobs).double().numpy()


def grpc_stream_hidden(t: Target, ids: list[int]) -> np.ndarray:
    request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, hidden_states=True, teacher_key=t.teacher)
    chunks = _grpc(lambda: list(t.stub.ScoreStream(request, timeout=60)))
    first = chunks[0].response
    rows = sum(decode_tensor(c.response.hidden_states).shape[0] for c in chunks if c.response.HasField("hidden_states"))
    if rows != len(ids) - 1 or not chunks[-1].last:
        raise AssertionError(f"hidden states: {rows} rows for {len(ids) - 1}")
    return decode_tensor(first.logprobs).double().numpy()


def http_json(t: Target, ids: list[int]) -> np.ndarray:
    reply = _http(httpx.post(t.http_url + "/v1/score", json={"token_ids": ids, "logprobs": True, "topk": TOPK},
                             timeout=60))
    return np.array(reply.json()["logprobs"][1:], dtype=np.float64)


def http_protobuf(t: Target, ids: list[int]) -> np.ndarray:
    body = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, teacher_key=t.teacher).SerializeToString()
    reply = _http(httpx.post(t.http_url + "/v1/score", content=body, timeout=60,
                             headers={"content-type": "application/x-protobuf"}))
    return decode_tensor(scoring_pb2.ScoreResponse.FromString(reply.content).logprobs).double().numpy()


def completions(t: Target, ids: list[int]) -> np.ndarray:
    reply = _http(httpx.post(t.http_url + "/v1/completions", timeout=60,
                             json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}))
    rows = reply.json()["choices"][0]["prompt_logprobs"][1:]
    return np.array([row[str(token)]["logprob"] for row, token in zip(rows, ids[1:], strict=True)])


def score_ids(t: Target, ids: list[int]) -> np.ndarray:
    """score_ids: the actual token and two fixed ids per row; the actual token's column is checked
    as the log-prob, the fixed ones against the reference's distribution (in `check`)."""
    table = torch.tensor([[token, 1, 2] for token in ids[1:]], dtype=torch.int32)
    request = scoring_pb2.ScoreRequest(token_ids=ids, score_ids=encode_tensor(table, first_row=1), teacher_key=t.teacher)
    answer = _grpc(lambda: t.stub.Score(request, timeout=60))
    return decode_tensor(answer.score_logprobs).double().numpy()


def aligned(t: Target, ids: list[int]) -> np.ndarray:
    """An aligned request made from `ids` (AlignedCase): the teacher's answer over its own
    tokenization, NaN where the server's teacher ids are not the teacher tokenizer's."""
    case = t.refs.aligned[tuple(ids)]
    request = scoring_pb2.ScoreRequest(token_ids=case.student_ids, prompt_length=case.prompt_length, logprobs=True,
                                       student_tokenizer="student", teacher_prompt_ids=case.teacher_prompt_ids,
                                       teacher_key=t.teacher)
    answer = _grpc(lambda: t.stub.Score(request, timeout=60)).aligned
    got = decode_tensor(answer.teacher.logprobs).double().numpy()
    return got if decode_tensor(answer.teacher_ids).tolist() == case.teacher_ids else np.full_like(got, np.nan)


def openai_echo(t: Target, ids: list[int]) -> np.ndarray:
    """lm-eval's log-likelihood call: the prompt echoed with its log-probs, one greedy token after."""
    reply = _http(httpx.post(t.http_url + "/v1/completions", timeout=60, json={
        "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}))
    return np.array(reply.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)], dtype=np.float64)


def sglang_generate(t: Target, ids: list[int]) -> np.ndarray:
    """slime's teacher call: SGLang's /generate with max_new_tokens 0, rows from logprob_start_len 0."""
    reply = _http(httpx.post(t.http_url + "/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": 0}))
    return np.array([entry[0] for entry in reply.json()["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


def vllm_generate(t: Target, ids: list[int]) -> np.ndarray:
    """vLLM 0.32's teacher scoring: the actual token and two fixed ids per row, as a .npy matrix."""
    candidates = [[token, 1, 2] for token in ids[1:]]
    reply = _http(httpx.post(t.http_url + "/inference/v1/generate", timeout=60, json={
        "token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0,
                                              "prompt_logprob_token_ids": candidates, "prompt_logprob_start": 0}}))
    matrix = np.load(io.BytesIO(base64.b64decode(reply.json()["prompt_token_id_logprobs"])), allow_pickle=False)
    return matrix.astype(np.float64)


# name -> one call: a function (Target, ids) -> the log-probs of rows 1..T-1 (for ID_TABLE_KINDS the
# [T-1, 3] table of the actual token's and ids 1 and 2's; for "aligned" the teacher rows of its
# AlignedCase), raising Refused where the surface says "retry" (a 503 while draining).
KINDS: dict[str, Callable[[Target, list[int]], np.ndarray]] = {
    "grpc unary": grpc_unary,
    "grpc stream hidden": grpc_stream_hidden,
    "http json": http_json,
    "http protobuf": http_protobuf,
    "completions": completions,
    "score_ids": score_ids,
    "aligned": aligned,
    "openai echo": openai_echo,
    "sglang generate": sglang_generate,
    "vllm generate": vllm_generate,
}
ID_TABLE_KINDS = ("score_ids", "vllm generate")


# -- the hostile calls: each must be refused with a 4xx, never a 5xx, a hang or a crash -----------

def _hostile_post(url: str, body: bytes, kind: str = "application/json", path: str = "/v1/score") -> None:
    reply = httpx.post(url + path, content=body, headers={"content-type": kind}, timeout=60)
    if not 400 <= reply.status_code < 500:
        raise AssertionError(f"hostile {path}: {reply.status_code} {reply.text[:200]}")


HOSTILE: dict[str, Callable[[str], None]] = {
    "oversized body (2M ids)": lambda url: _hostile_post(url, b'{"token_ids": [' + b"12345," * 2_000_000 + b"1]}"),
    "oversized completions": lambda url: _hostile_post(
        url, b'{"max_tokens": 1, "prompt_logprobs": 0, "prompt": [' + b"12345," * 2_000_000 + b"1]}",
        path="/v1/completions"),
    "oversized /generate": lambda url: _hostile_post(
        url, b'{"return_logprob": true, "input_ids": [' + b"12345," * 2_000_000 + b"1]}", path="/generate"),
    "oversized /inference/v1/generate": lambda url: _hostile_post(
        url, b'{"sampling_params": {"max_tokens": 1}, "token_ids": [' + b"12345," * 2_000_000 + b"1]}",
        path="/inference/v1/generate"),
    "deep JSON": lambda url: _hostile_post(url, b"[" * 100_000 + b"]" * 100_000),
    "bad media": lambda url: _hostile_post(url, json.dumps({"token_ids": [1, 2, 3], "logprobs": True, "images": [
        {"data": "bm90IGFuIGltYWdl", "media_type": "image/png"}]}).encode()),
    "unknown key": lambda url: _hostile_post(url, b'{"token_ids": [1, 2, 3], "logprobs": true, "tokne_ids": [1]}'),
}


# -- bookkeeping ---------------------------------------------------------------------------------

@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    latencies: list = field(default_factory=list)  # (time, kind, seconds)
    failures: list = field(default_factory=list)  # lost and wrong calls, with what went wrong
    refusals: list = field(default_factory=list)  # the first refusals' notes (expected ones)

    def add(self, kind: str, outcome: str, *, latency: float | None = None, note: str = "") -> None:
        with self.lock:
            self.counts[kind]["sent"] += 1
            self.counts[kind][outcome] += 1
            if latency is not None:
                self.latencies.append((time.monotonic(), kind, latency))
            notes = self.failures if outcome in ("lost", "wrong") else self.refusals
            if note and len(notes) < 50:
                notes.append(f"{kind}: {note}"[:300])


def client_loop(targets: Callable[[], list[Target]], work: list[list[int]], tally: Tally,
                stop: threading.Event, offset: int, down: threading.Event) -> None:
    """The kinds in turn, each to every teacher in turn, until `stop`. While `down` is set (the
    server draining, gone, restarting), a refused connection is the answer expected; at any other
    time it is a lost request."""
    names = list(KINDS)
    index = offset
    while not stop.is_set():
        teachers = targets()
        kind, ids = names[index % len(names)], work[index % len(work)]
        target = teachers[(index // len(names)) % len(teachers)]
        index += 1
        started, was_down = time.perf_counter(), down.is_set()  # a call begun while down may reach the old server
        try:
            got = KINDS[kind](target, ids)
        except Refused as refused:
            tally.add(kind, "refused as expected", note=f"refused {refused}")
            time.sleep(0.2)
            continue
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            tally.add(kind, "refused as expected" if was_down or down.is_set() else "lost", note=repr(exc))
            time.sleep(0.2)
            continue
        except Exception as exc:  # every other failure is a lost request
            tally.add(kind, "lost", note=repr(exc))
            continue
        ok = target.refs.check(kind, ids, got)
        tally.add(kind, "answered correctly" if ok else "wrong", latency=time.perf_counter() - started,
                  note="" if ok else f"max diff on {len(ids)} ids")


def hostile_burst(url: str, tally: Tally, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, call in HOSTILE.items():
            try:
                call(url)
                tally.add("hostile: " + name, "refused as expected")
            except Exception as exc:
                tally.add("hostile: " + name, "wrong", note=repr(exc))


def slow_readers_and_cancels(t: Target, work: list[list[int]], tally: Tally, seconds: float) -> None:
    """Streams read a chunk at a time with pauses, and unary calls cancelled 20 ms in."""
    deadline, index = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        ids = work[index % len(work)]
        index += 1
        request = scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, hidden_states=True, teacher_key=t.teacher)
        try:
            chunks = []
            for chunk in t.stub.ScoreStream(request, timeout=60):
                chunks.append(chunk)
                time.sleep(1.0)
            ok = t.refs.check("slow stream reader", ids, decode_tensor(chunks[0].response.logprobs).double().numpy())
            tally.add("slow stream reader", "answered correctly" if ok else "wrong")
        except Exception as exc:
            tally.add("slow stream reader", "lost", note=repr(exc))
        future = t.stub.Score.future(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, teacher_key=t.teacher),
                                     timeout=60)
        time.sleep(0.02)
        future.cancel()
        tally.add("cancelled mid-request", "refused as expected" if future.cancelled() else "answered correctly")


# -- processes -----------------------------------------------------------------------------------

def replica_workers(server: SubprocessServer) -> list[psutil.Process]:
    out = []
    for proc in psutil.Process(server.proc.pid).children():
        try:
            if "proctor.server.worker.main" in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.Error:
            continue
    return out


def faulted_workers(server: SubprocessServer) -> list[psutil.Process]:
    """The live replica workers of the FAULTED teacher."""
    names = replica_names(server)
    return [proc for proc in replica_workers(server)
            if names.get(proc.pid, "").startswith(FAULTED) and proc.status() != psutil.STATUS_ZOMBIE]


def sample(server: SubprocessServer) -> dict[str, tuple[float, int, int]]:
    """role -> (RSS MB, open fds, threads): the front, and each replica's worker with its engine
    processes (a restarted replica's new worker is the same role: its figures start afresh)."""
    out = {}
    names = replica_names(server)
    procs = {"front": [psutil.Process(server.proc.pid)]}
    for worker in replica_workers(server):
        procs[f"replica {names.get(worker.pid, worker.pid)}"] = [worker, *worker.children(recursive=True)]
    for role, members in procs.items():
        rss = fds = threads = 0
        for proc in members:
            try:
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            except psutil.Error:
                continue
        out[role] = (rss / 1e6, fds, threads)
    return out


def server_counts(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The server's own counts: requests by outcome, and times each replica was taken out of
    rotation (a replica no fault was aimed at should have none)."""
    from prometheus_client.parser import text_string_to_metric_families

    outcomes: dict[str, float] = defaultdict(float)
    failures: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "proctor:requests_total":
                outcomes[s.labels["outcome"]] += s.value
            elif s.name == "proctor:replica_failures_total":
                failures[s.labels["replica"]] = s.value
    return dict(outcomes), failures


# key -> replicas; each key its own weights (make_tiny_model's seed). Faults hit the first key's
# replicas, so its requests fail over to its other replica (the second key's one replica is never
# taken down: its callers would only wait for a restart).
TEACHERS = {"tiny-a": 2, "tiny-b": 1}
FAULTED = "tiny-a"


def write_config(folder: Path, models: dict[str, Path], student_dir: Path, engine: str) -> Path:
    """The soak's `proctor serve --config` file: TEACHERS on CPU 'devices', the student tokenizer."""
    teachers = {key: {"key": key, "model_path": str(models[key]), "num_replicas": replicas,
                      "inference": _inference(teacher_engine(key, engine))} for key, replicas in TEACHERS.items()}
    document = {
        "distillation": {"enabled": True, "nnodes": 1, "n_gpus_per_node": sum(TEACHERS.values()),
                         "teacher_key": "data_source", "teacher_models": teachers,
                         "distillation_loss": {"loss_mode": "forward_kl_topk", "topk": 8}},
        "server": {"device": "cpu", "grpc_port": 0, "http_port": 0, "health_check_interval_s": 1,
                   "student_tokenizers": {"student": str(student_dir)}},
    }
    path = folder / "soak.yaml"
    path.write_text(json.dumps(document, indent=1))  # JSON is YAML
    return path


def teacher_engine(key: str, engine: str) -> str:
    """The engine `key` runs on. With `--engine vllm` the faulted teacher's replicas are vLLM's; the
    other teacher's are too where the host has a core for each vLLM replica (each binds its compute
    to a core of its own; on this 2-core host a third would share one with another, whose OpenMP
    threads are bound there too), else they run on the torch engine."""
    if engine != "vllm" or key == FAULTED or (os.cpu_count() or 1) >= sum(TEACHERS.values()):
        return engine
    return "torch"


def _inference(engine: str) -> dict:
    inference: dict = {"name": engine, "tensor_model_parallel_size": 1, "dtype": "float32", "max_model_len": 512,
                       "prompt_length": 255, "response_length": 256}
    if engine == "vllm":
        inference |= {"gpu_memory_utilization": 0.12, "enforce_eager": True, "startup_timeout_s": 600}
    return inference


def keep_log(server: SubprocessServer, path: Path) -> list[str]:
    """The server's output written to `path`; its WARNING and ERROR lines."""
    path.write_text("".join(server.log))
    return [line.rstrip() for line in server.log if " WARNING " in line or " ERROR " in line or "Traceback" in line]


def serve(config: Path) -> SubprocessServer:
    return SubprocessServer(["--config", str(config)], startup_timeout=900)


# -- the run -------------------------------------------------------------------------------------

def run(minutes: float, engine: str, clients: int, log: Callable[[str], None] = print) -> dict:
    from proctor.server.cli.tiny_model import STUDENT_SEED, STUDENT_VOCAB_SIZE, make_tiny_model

    total = minutes * 60
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    models = {key: make_tiny_model(folder / key, seed=index) for index, key in enumerate(TEACHERS)}
    student_dir = make_tiny_model(folder / "student", vocab_size=STUDENT_VOCAB_SIZE, seed=STUDENT_SEED,
                                  student_tokenizer=True)
    work = sequences(12, seed=43, length=(16, 96))
    refs = {key: References(model_dir, work, student_dir) for key, model_dir in models.items()}
    config = write_config(folder, models, student_dir, engine)
    server = serve(config)
    state: dict[str, list[Target]] = {"targets": []}

    def connect(s: SubprocessServer) -> None:
        stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(s.grpc_target))
        state["targets"] = [Target(s.grpc_target, f"{s.http_url}/teachers/{key}", key, stub, refs[key])
                            for key in TEACHERS]

    connect(server)
    tally, stop, down = Tally(), threading.Event(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(lambda: state["targets"], work, tally, stop, i * 2, down),
                                daemon=True) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    events: list[tuple[float, str]] = []
    kills: list[float] = []
    samples: list[tuple[float, dict]] = []

    def at(fraction: float) -> None:
        while time.monotonic() - started < fraction * total:
            time.sleep(0.5)
            if not samples or time.monotonic() - samples[-1][0] > 10:
                samples.append((time.monotonic(), sample(server)))

    def event(what: str) -> None:
        events.append((time.monotonic() - started, what))
        log(f"[{time.monotonic() - started:7.1f}s] {what}")

    quiet_end = 0.15
    at(quiet_end)
    warm = sample(server)
    event("quiet phase over; warm-up sample taken")
    at(0.2)
    victim = faulted_workers(server)[0]
    victim.kill()
    kills.append(time.monotonic())
    event(f"SIGKILL replica worker {victim.pid}")
    at(0.35)
    stopped = faulted_workers(server)[-1]
    stopped.send_signal(signal.SIGSTOP)
    event(f"SIGSTOP replica worker {stopped.pid} for 20 s")
    time.sleep(min(20.0, 0.1 * total))
    try:
        stopped.send_signal(signal.SIGCONT)
        event("SIGCONT")
    except psutil.NoSuchProcess:
        event("SIGCONT: the supervisor had already replaced the stopped worker")
    kills.append(time.monotonic())
    at(0.45)
    event("hostile floods")
    hostile = threading.Thread(target=hostile_burst, args=(server.http_url, tally, 0.1 * total), daemon=True)
    hostile.start()
    at(0.55)
    event("slow stream readers and mid-request cancels")
    slow = threading.Thread(target=slow_readers_and_cancels, args=(state["targets"][0], work, tally, 0.1 * total),
                            daemon=True)
    slow.start()
    at(0.7)
    hostile.join()
    slow.join()
    if engine == "vllm":
        victim_core = next(core for replica, core in engine_cores(server).items() if replica.startswith(FAULTED))
        victim_core.kill()
        event(f"SIGKILL EngineCore {victim_core.pid}")
    else:
        victim = faulted_workers(server)[0]
        victim.kill()
        event(f"SIGKILL replica worker {victim.pid}")
    kills.append(time.monotonic())
    at(0.97)
    end = sample(server)
    with tally.lock:  # before the server's count: every answer a client has, the server counted first
        clients_ok = sum(c["answered correctly"] for k, c in tally.counts.items() if not k.startswith("hostile"))
    counted, replica_failures = server_counts(server.http_url)
    event("SIGTERM: drain under load")
    down.set()
    drain_started = time.monotonic()
    code = server.stop(timeout=120)
    drain_s = time.monotonic() - drain_started
    warnings = keep_log(server, folder / "server-1.log")
    event(f"server exited {code} after {drain_s:.1f}s; restarting")
    server = serve(config)
    connect(server)
    down.clear()
    restarted = time.monotonic()
    time.sleep(10)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    with tally.lock:
        after_restart = sum(1 for t, _, _ in tally.latencies if t > restarted)
    event(f"restarted server answered {after_restart} checked requests in 10 s; stopping")
    server.stop()
    warnings += keep_log(server, folder / "server-2.log")
    result = report(tally, warm, end, started, total, quiet_end, kills, counted, clients_ok, events, drain_s, code)
    print(f"replicas taken out of rotation (the server's count): {replica_failures}; faults aimed at {FAULTED}: "
          f"{len(kills)}", flush=True)
    print(f"server WARNING/ERROR lines: {len(warnings)} (logs in {folder})", flush=True)
    for line in warnings[:20]:
        print("  " + line[:240], flush=True)
    result.update(after_restart=after_restart, replica_failures=replica_failures, server_warnings=warnings[:200],
                  logs=str(folder))
    return result


def _percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def report(tally: Tally, warm: dict, end: dict, started: float, total: float, quiet_end: float, kills: list[float],
           counted: dict, clients_ok: int, events: list, drain_s: float, code: int) -> dict:
    phases = [("quiet", 0.05, quiet_end), ("replica killed", 0.2, 0.35), ("replica stopped 20 s", 0.35, 0.45),
              ("hostile floods", 0.45, 0.55), ("slow readers + cancels", 0.55, 0.7), ("second kill", 0.7, 0.97)]
    rows = {}
    for name, lo, hi in phases:
        steady = [lat for t, _, lat in tally.latencies if lo * total <= t - started < hi * total
                  and not any(0 <= t - k < KILL_WINDOW_S for k in kills)]
        rows[name] = _percentiles(steady)
    totals = defaultdict(int)
    lines = ["", f"{'kind':32s} {'sent':>7s} {'correct':>8s} {'refused ok':>10s} {'lost':>5s} {'wrong':>5s}"]
    for kind in sorted(tally.counts):
        c = tally.counts[kind]
        for key in ("sent", "answered correctly", "refused as expected", "lost", "wrong"):
            totals[key] += c[key]
        lines.append(f"{kind:32s} {c['sent']:7d} {c['answered correctly']:8d} {c['refused as expected']:10d} "
                     f"{c['lost']:5d} {c['wrong']:5d}")
    lines.append(f"{'total':32s} {totals['sent']:7d} {totals['answered correctly']:8d} "
                 f"{totals['refused as expected']:10d} {totals['lost']:5d} {totals['wrong']:5d}")
    lines.append("")
    lines.append(f"{'process':20s} {'RSS MB warm':>11s} {'RSS MB end':>10s} {'growth':>7s} {'fds':>9s} {'threads':>9s}")
    growth = {}
    for role in warm:
        if role not in end:
            continue
        (r0, f0, t0), (r1, f1, t1) = warm[role], end[role]
        growth[role] = (r1 - r0) / r0 if r0 else 0.0
        lines.append(f"{role:20s} {r0:11.1f} {r1:10.1f} {growth[role]:+7.1%} {f0:4d}→{f1:<4d} {t0:4d}→{t1:<4d}")
    lines.append("")
    quiet_p99 = rows["quiet"][1]
    lines.append(f"{'phase (outside 15 s after a kill)':36s} {'p50 ms':>8s} {'p99 ms':>8s} {'p99/quiet':>9s}")
    for name, (p50, p99) in rows.items():
        lines.append(f"{name:36s} {p50 * 1000:8.1f} {p99 * 1000:8.1f} {p99 / quiet_p99:9.2f}")
    lines.append("")
    lines.append(f"Prometheus proctor:requests_total by outcome: {dict(sorted(counted.items()))}")
    lines.append(f"clients' answered correctly at that moment: {clients_ok} (server ok: {counted.get('ok', 0):.0f})")
    lines.append(f"drain: exit code {code} after {drain_s:.1f} s")
    if tally.failures:
        lines.append("first failures: " + "; ".join(tally.failures[:8]))
    text = "\n".join(lines)
    print(text, flush=True)
    return {"totals": dict(totals), "growth": growth, "warm": warm, "end": end, "phases": rows, "counted": counted,
            "clients_ok": clients_ok, "drain_exit": code, "failures": tally.failures, "refusals": tally.refusals,
            "table": text,
            "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.minutes, args.engine, args.clients, log=lambda line: print(line, flush=True))
    if args.json is not None:
        args.json.write_text(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
