"""CPU per scored token of the server's front process and of its replica workers.

One run prints, for the vLLM and the torch engine, over gRPC and HTTP protobuf, for log-probs,
top-8, top-64 and hidden states: the CPU seconds per million scored tokens (= µs a token) of
  front   the `proctor serve` process itself (listeners, admission, routing, batching, answers)
  worker  each replica worker's own Python (its engine and the encoding of results; vLLM's
          EngineCore and its workers, the worker's children, are excluded)
and, for hidden states, the bytes the front moves per second of its own CPU. A scored token is
a row of the answer (sequences are sent without a prompt_length, so every row but row 0 is one).

Then the capacity figure: a front with N replica workers of an instant engine (the torch
engine's answer to one sequence, computed once and replayed: `support.engines.RememberingEngine`)
fed top-64 requests as fast as the clients go; the front's CPU per token and its sustained
tokens/s, i.e. how many replicas of what prefill rate one front feeds.

First, the guard figures on a fresh load (`--fresh-only` prints them alone): the vLLM engine,
`--fresh-seqs` x `--length` sequences never scored before (new ids every round, so no prefix is
answered from memory), rounds alternated, best of `--fresh-rounds`: the front's µs a top-64 and
a log-probs-only token over gRPC, and all server processes' (front, replica worker, EngineCore);
then score_ids K=64 per row over gRPC, `/v1/score` JSON and `/v1/score` protobuf: CPU-s per 1k
rows (front and all processes) and the answer's size.

CPU time, unlike wall time, does not depend much on what else the machine runs, which is why
this bench reads it (`psutil`'s user + system time of each process, before and after); a busy
host only adds to a round's CPU, so the best round is the estimate.

    .venv/bin/python bench/front_cpu.py [--engines vllm,torch] [--transports grpc,http] [--quick] [--fresh-only]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.servers import SubprocessServer

MODES = {
    "logprobs": {"logprobs": True, "topk": 0},
    "top-8": {"logprobs": True, "topk": 8},
    "top-64": {"logprobs": True, "topk": 64},
    "hidden": {"logprobs": False, "hidden_states": True},
}
WORKER_MODULE = "proctor.server.worker.main"


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def workers_of(front: psutil.Process) -> list[psutil.Process]:
    """The front's replica workers (replica worker processes); their own children are not counted."""
    return [p for p in front.children() if WORKER_MODULE in " ".join(p.cmdline())]


class CpuMeter:
    """CPU seconds of the front and of its workers between `start()` and `stop()`."""

    def __init__(self, front_pid: int) -> None:
        self.front = psutil.Process(front_pid)

    def start(self) -> None:
        self.workers = workers_of(self.front)
        self._front0 = cpu_seconds(self.front)
        self._workers0 = [cpu_seconds(w) for w in self.workers]

    def stop(self) -> tuple[float, float]:
        front = cpu_seconds(self.front) - self._front0
        workers = sum(cpu_seconds(w) - c for w, c in zip(self.workers, self._workers0, strict=True))
        return front, workers


async def drive(target: str, seqs: list[list[int]], mode: dict, concurrency: int) -> tuple[int, int]:
    """Score every sequence (no prompt_length: rows 1..T-1); (rows answered, hidden-state bytes)."""
    from proctor.client import TeacherClient

    rows = hidden_bytes = 0
    async with TeacherClient(target, max_concurrency=concurrency, timeout=600) as client:
        queue = list(seqs)

        async def one_client() -> None:
            nonlocal rows, hidden_bytes
            while queue:
                ids = queue.pop()
                if mode.get("hidden_states"):
                    answer = await client.stream_hidden_states(ids, logprobs=False)
                    hidden_bytes += answer.hidden_states.numel() * answer.hidden_states.element_size()
                else:
                    answer = await client.score(ids, **mode)
                rows += answer.num_rows

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return rows, hidden_bytes


def measure(server: SubprocessServer, seqs: list[list[int]], transports: list[str], concurrency: int):
    targets = {"grpc": f"grpc://{server.grpc_target}", "http": server.http_url}
    meter = CpuMeter(server.proc.pid)
    for transport in transports:
        for label, mode in MODES.items():
            asyncio.run(drive(targets[transport], seqs[:2], mode, 2))  # warm this mode up
            meter.start()
            started = time.perf_counter()
            rows, hidden_bytes = asyncio.run(drive(targets[transport], seqs, mode, concurrency))
            wall = time.perf_counter() - started
            front, workers = meter.stop()
            yield transport, label, rows, front, workers, hidden_bytes, wall, len(meter.workers)


def report_engines(args, model: Path, vocab: int) -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(3, vocab) for _ in range(args.length)] for _ in range(args.seqs)] * args.rounds
    print(f"\n{args.seqs} sequences x {args.length} tokens, {args.rounds} rounds, {args.concurrency} concurrent calls; "
          "CPU seconds per million scored tokens (= µs a token)")
    print(f"{'engine':<7} {'transport':<9} {'mode':<9} {'front':>8} {'worker':>8} {'workers':>7} "
          f"{'front GB/CPU-s':>15} {'tokens/s':>9}")
    for engine in args.engines.split(","):
        flags = ["--engine", engine, "--model", str(model), "--max-model-len", str(args.length + 8),
                 "--replicas", str(args.replicas), "--no-verbose"]
        if engine == "vllm":
            flags += ["--inference", "gpu_memory_utilization=0.12", "--inference",
                      f"max_num_batched_tokens={max(8192, args.length * 4)}"]
        server = SubprocessServer(flags, startup_timeout=600)
        try:
            for transport, label, rows, front, workers, hidden, wall, count in measure(
                server, seqs, args.transports.split(","), args.concurrency
            ):
                rate = f"{hidden / front / 1e9:>15.2f}" if hidden and front else f"{'':>15}"
                worker = f"{workers / rows * 1e6:>8.2f}" if count else f"{'-':>8}"
                print(f"{engine:<7} {transport:<9} {label:<9} {front / rows * 1e6:>8.2f} {worker} {count:>7} "
                      f"{rate} {rows / wall:>9.0f}", flush=True)
        finally:
            server.stop()


FRESH_K = 64


def _fresh_bodies(rng: random.Random, seqs: int, length: int, mode: str, vocab: int) -> list[bytes]:
    """`seqs` never-seen sequences as request bodies: protobuf ScoreRequests, or `/v1/score` JSON."""
    import json

    import numpy as np

    from proctor.proto import encode_tensor, scoring_pb2

    out = []
    for _ in range(seqs):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        if mode in ("top-64", "logprobs"):
            out.append(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True,
                                                topk=FRESH_K if mode == "top-64" else 0).SerializeToString())
            continue
        rows = [[rng.randrange(0, vocab) for _ in range(FRESH_K)] for _ in range(length - 1)]
        if mode == "score_ids json":
            out.append(json.dumps({"token_ids": ids, "logprobs": False, "score_ids": rows}).encode())
        else:
            wire = encode_tensor(np.asarray(rows, dtype=np.int32))
            out.append(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=False, score_ids=wire).SerializeToString())
    return out


async def _send_all(server: SubprocessServer, mode: str, bodies: list[bytes], concurrency: int) -> int:
    """Every body sent (gRPC unary, or POST /v1/score), `concurrency` at a time; answer bytes."""
    import grpc
    import httpx

    left, received = list(bodies), 0
    kind = {"score_ids json": "application/json", "score_ids protobuf": "application/x-protobuf"}.get(mode)
    async with (grpc.aio.insecure_channel(server.grpc_target, options=[("grpc.max_receive_message_length",
                                                                       256 << 20)]) as channel,
                httpx.AsyncClient(base_url=server.http_url, timeout=600) as http):
        unary = channel.unary_unary("/proctor.v1.TeacherScoring/Score")

        async def one() -> None:
            nonlocal received
            while left:
                body = left.pop()
                if kind is None:
                    answer = await unary(body)
                else:
                    reply = await http.post("/v1/score", content=body, headers={"content-type": kind})
                    reply.raise_for_status()
                    answer = reply.content
                received += len(answer)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return received


def report_fresh(args, model: Path, vocab: int) -> None:
    """The guard figures (module docstring): a fresh load, rounds alternated, best round kept."""
    from support.cpu import descendants_cpu, process_cpu

    modes = ["top-64", "logprobs", "score_ids grpc", "score_ids json", "score_ids protobuf"]
    flags = ["--engine", "vllm", "--model", str(model), "--max-model-len", str(args.length + 8), "--no-verbose",
             "--inference", "gpu_memory_utilization=0.12", "--inference",
             f"max_num_batched_tokens={max(8192, args.length * 4)}"]
    server = SubprocessServer(flags, startup_timeout=600)
    rng = random.Random(7)
    best: dict[str, tuple[float, float, int, int]] = {}
    try:
        front = psutil.Process(server.proc.pid)
        for mode in modes:  # warm every path up
            asyncio.run(_send_all(server, mode, _fresh_bodies(rng, 4, args.length, mode, vocab), 2))
        for _ in range(args.fresh_rounds):
            for mode in modes:
                seqs = args.fresh_seqs if mode in ("top-64", "logprobs") else max(4, args.fresh_seqs // 4)
                bodies = _fresh_bodies(rng, seqs, args.length, mode, vocab)
                before = process_cpu(front), descendants_cpu(front)
                received = asyncio.run(_send_all(server, mode, bodies, args.concurrency))
                spent = process_cpu(front) - before[0], descendants_cpu(front) - before[1]
                rows = seqs * (args.length - 1)
                kept = best.get(mode)
                if kept is None or spent[0] / rows < kept[0] / kept[2]:
                    best[mode] = (spent[0], spent[0] + spent[1], rows, received // seqs)
    finally:
        server.stop()
    print(f"\nfresh load, vLLM engine: {args.fresh_seqs} x {args.length} tokens (score_ids: a quarter of the "
          f"sequences), best of {args.fresh_rounds} alternated rounds")
    print(f"{'mode':<19} {'front µs/row':>12} {'all µs/row':>11} {'front CPU-s/1k rows':>20} "
          f"{'all CPU-s/1k rows':>18} {'answer KiB':>11}")
    for mode in modes:
        front_s, all_s, rows, answer = best[mode]
        print(f"{mode:<19} {front_s / rows * 1e6:>12.2f} {all_s / rows * 1e6:>11.2f} {front_s / rows * 1e3:>20.3f} "
              f"{all_s / rows * 1e3:>18.3f} {answer / 1024:>11.1f}", flush=True)


TESTS = Path(__file__).resolve().parents[1] / "tests"


async def serve_front(replicas: int, model: str) -> None:
    """The front with `replicas` workers of the remembering engine (run as its own process)."""
    from functools import partial

    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.fleet.routing import ReplicaSet, Router, engine_replica
    from proctor.server.front.runtime import ProctorServer
    from proctor.server.front.settings import ServerOptions
    from proctor.server.worker.client import WorkerClient

    from support.remembering import RememberingEngine

    spec = EngineSpec(name="torch", model_path=model, inference={"max_model_len": 1024})
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    build = [engine_replica(f"r{i}", partial(WorkerClient, spec, name=f"r{i}", build=RememberingEngine, env=env))
             for i in range(replicas)]
    options = ServerOptions(grpc_port=0, http_port=0)
    server = ProctorServer(Router([ReplicaSet("default", build)]), options)
    print(f"proctor: gRPC on {options.host}:{server.grpc_port}, HTTP on {options.host}:{server.http_port}", flush=True)
    await server.serve_until_terminated()


def _requests(seqs: list[list[int]], hidden: bool) -> list[bytes]:
    from proctor.proto import scoring_pb2

    asked = {"logprobs": False, "hidden_states": True} if hidden else {"topk": 64}
    return [scoring_pb2.ScoreRequest(token_ids=ids, **asked).SerializeToString() for ids in seqs]


async def flood(target: str, messages: list[bytes], requests: int, concurrency: int, *, hidden: bool = False,
                keep: dict | None = None) -> int:
    """`requests` calls over gRPC (top-64, or hidden states through ScoreStream), answers kept as
    bytes (the client parses nothing); the bytes answered. `keep` collects each message's answer
    (its chunks), for the bare gRPC server to replay."""
    import grpc

    received = 0
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        unary = channel.unary_unary("/proctor.v1.TeacherScoring/Score")
        stream = channel.unary_stream("/proctor.v1.TeacherScoring/ScoreStream")
        left = list(range(requests))

        async def one_client() -> None:
            nonlocal received
            while left:
                message = messages[left.pop() % len(messages)]
                chunks = [chunk async for chunk in stream(message)] if hidden else [await unary(message)]
                received += sum(len(c) for c in chunks)
                if keep is not None:
                    keep[message] = chunks

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return received


async def serve_bare(answers_file: str) -> None:
    """A bare grpc.aio server replaying proctor's own answers (run as its own process): the floor
    gRPC itself sets for moving those bytes, measured beside the front in the same run."""
    import pickle

    import grpc

    answers: dict[bytes, list[bytes]] = pickle.loads(Path(answers_file).read_bytes())

    async def unary(raw, context):
        return answers[raw][0]

    async def stream(raw, context):
        for chunk in answers[raw]:
            yield chunk

    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    handlers = {"Score": grpc.unary_unary_rpc_method_handler(unary),
                "ScoreStream": grpc.unary_stream_rpc_method_handler(stream)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("proctor.v1.TeacherScoring", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"bare gRPC on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def _measure(pid: int, target: str, messages: list[bytes], requests: int, hidden: bool) -> tuple[float, float, float, int]:
    """(CPU s of `pid`, of its workers, wall s, bytes answered) of `requests` calls to `target`."""
    meter = CpuMeter(pid)
    meter.start()
    started = time.perf_counter()
    received = asyncio.run(flood(target, messages, requests, 16 if hidden else 64, hidden=hidden))
    wall = time.perf_counter() - started
    front, workers = meter.stop()
    return front, workers, wall, received


def capacity_run(model: Path, replicas: int, seqs: list[list[int]], requests: int, *, hidden: bool = False,
                 bare: bool = False):
    """(front CPU s, workers' CPU s, wall s, bytes answered) of `requests` calls to a fresh front,
    and with `bare` the same of a bare gRPC server replaying the front's answers, measured
    alternately with the front (twice each, the run of lower CPU kept); else None."""
    import pickle
    import subprocess

    messages = _requests(seqs, hidden)
    command = [sys.executable, __file__, "--serve-front", str(replicas), "--model", str(model)]
    server = SubprocessServer([], command=command, startup_timeout=300)
    answers: dict[bytes, list[bytes]] = {}
    replayer = None
    try:  # the warm-up remembers every answer (and keeps them for the replayer)
        asyncio.run(flood(server.grpc_target, messages, 16 * len(seqs), 16, hidden=hidden, keep=answers))
        runs = [_measure(server.proc.pid, server.grpc_target, messages, requests, hidden)]
        if not bare:
            return runs[0], None
        with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as file:
            file.write(pickle.dumps(answers))
        replayer = subprocess.Popen([sys.executable, __file__, "--serve-bare", file.name], stdout=subprocess.PIPE,
                                    text=True)
        target = replayer.stdout.readline().split(" on ")[-1].strip()
        os.unlink(file.name)
        asyncio.run(flood(target, messages, 4 * len(seqs), 16, hidden=hidden))
        floors = [_measure(replayer.pid, target, messages, requests, hidden)]
        runs.append(_measure(server.proc.pid, server.grpc_target, messages, requests, hidden))
        floors.append(_measure(replayer.pid, target, messages, requests, hidden))
    finally:
        server.stop()
        if replayer is not None:
            replayer.kill()
    return min(runs), min(floors)


def report_capacity(args, model: Path, wide: Path) -> None:
    rng = random.Random(1)
    seqs = [[rng.randrange(3, 512) for _ in range(args.length)] for _ in range(8)]
    rows = args.length - 1
    print(f"\ncapacity: N replica workers of an instant engine (torch answers remembered), top-64, "
          f"{args.length}-token sequences over gRPC, {args.capacity_requests} requests, 64 in flight")
    print(f"{'replicas':>8} {'front µs/token':>15} {'worker µs/token':>16} {'tokens/s':>10} "
          f"{'front-bound tokens/s per core':>30}")
    tokens = args.capacity_requests * rows
    for replicas in map(int, args.capacity_replicas.split(",")):
        # One replica runs beside a bare gRPC server replaying the same answers.
        (front, workers, wall, _), floor = capacity_run(model, replicas, seqs, args.capacity_requests,
                                                        bare=replicas == 1)
        print(f"{replicas:>8} {front / tokens * 1e6:>15.2f} {workers / tokens * 1e6:>16.2f} {tokens / wall:>10.0f} "
              f"{tokens / max(front, 1e-9):>30.0f}", flush=True)
        if floor is not None:
            print(f"{'':>8} a bare grpc.aio server replaying these answers: {floor[0] / tokens * 1e6:.2f} µs/token; "
                  f"the front costs {front / floor[0]:.2f}x gRPC's own floor", flush=True)
    requests = max(16, args.capacity_requests // 4)
    (front, _, wall, received), floor = capacity_run(wide, 1, seqs, requests, hidden=True, bare=True)
    print(f"hidden states through the front (ScoreStream, a {WIDE_HIDDEN}-wide float32 teacher: "
          f"{WIDE_HIDDEN * 4} bytes a row, {requests} requests): {received / max(front, 1e-9) / 1e9:.2f} GB per front "
          f"CPU-second, {received / wall / 1e9:.2f} GB/s wall; a bare grpc.aio server replaying the same chunks: "
          f"{received / max(floor[0], 1e-9) / 1e9:.2f} GB per CPU-second (the front reaches "
          f"{floor[0] / front:.2f} of gRPC's own rate)", flush=True)


WIDE_HIDDEN = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="vllm,torch")
    parser.add_argument("--transports", default="grpc,http")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--length", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=4, help="times each sequence is sent per measurement "
                        "(CPU times tick in 10 ms: more tokens, finer figures)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--capacity-replicas", default="1,2,4", help="comma-separated N for the capacity figure")
    parser.add_argument("--capacity-requests", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="16 x 128 tokens, a smaller capacity run")
    parser.add_argument("--fresh-seqs", type=int, default=256, help="sequences a round of the fresh load")
    parser.add_argument("--fresh-rounds", type=int, default=3, help="rounds of the fresh load (0: none)")
    parser.add_argument("--fresh-only", action="store_true", help="the fresh-load figures alone")
    parser.add_argument("--serve-front", type=int, help=argparse.SUPPRESS)  # the capacity run's front process
    parser.add_argument("--serve-bare", help=argparse.SUPPRESS)  # the bare gRPC server replaying answers
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_front:
        asyncio.run(serve_front(args.serve_front, args.model))
        return
    if args.serve_bare:
        asyncio.run(serve_bare(args.serve_bare))
        return
    if args.quick:
        args.seqs, args.length, args.rounds, args.capacity_requests = 16, 128, 1, 128
    print(f"load average at start {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs")
    from proctor.server.cli.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "teacher", num_heads=2, num_kv_heads=1)
        wide = make_tiny_model(Path(tmp) / "wide", hidden_size=WIDE_HIDDEN, num_layers=1, num_heads=WIDE_HIDDEN // 64,
                               num_kv_heads=1, intermediate_size=WIDE_HIDDEN)
        if args.fresh_rounds:
            report_fresh(args, model, 512)
        if args.fresh_only:
            return
        if args.engines:
            report_engines(args, model, 512)
        if args.capacity_replicas:
            report_capacity(args, model, wide)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
