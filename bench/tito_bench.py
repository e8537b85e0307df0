"""Student top-64 scoring through vLLM's `/inference/v1/generate`: proctor beside its gRPC, and
beside stock vLLM answering the identical request.

Each phase scores fresh sequences (a new seed per phase: no sequence is scored twice, so prompt
reuse answers nothing from memory) of `--length` tokens whose last `--length - --prompt` rows carry
the student's top-64 ids (`prompt_logprob_token_ids` from row `prompt - 1`, i.e. proctor's
`score_ids` from row `prompt`). Phases run alternated over `--rounds`:
  tito   proctor's `/inference/v1/generate` (HTTP JSON, the answer a base64 .npy matrix)
  grpc   proctor's gRPC `Score` with the same ids as `score_ids` (the reference surface)
  stock  stock vLLM's `/inference/v1/generate` (`--stock URL`; it scores the ids only on its V2
         model runner, `VLLM_USE_V2_MODEL_RUNNER=1`, a GPU: where it refuses, the phase says so)
and the summary prints scored tokens/s per phase, proctor's front CPU seconds per scored token
(`psutil`, the `proctor serve` process alone) and proctor tito ÷ stock.

    .venv/bin/python bench/tito_bench.py                          # starts proctor (torch, tiny model)
    .venv/bin/python bench/tito_bench.py --engine vllm --model DIR --stock http://127.0.0.1:8000
    .venv/bin/python bench/tito_bench.py --proctor URL,GRPC_TARGET --front-pid PID --stock URL
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.servers import SubprocessServer

PATH = "/inference/v1/generate"


def load(seed: int, args, vocab: int) -> list[tuple[list[int], np.ndarray]]:
    """Fresh sequences and each one's student top-K ids over its response rows."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(args.seqs):
        ids = rng.integers(3, vocab, size=args.length).tolist()
        cands = np.argsort(rng.random((args.length - args.prompt, vocab)), axis=1)[:, : args.k].astype(np.int32)
        out.append((ids, cands))
    return out


def tito_body(ids: list[int], cands: np.ndarray, start: int, model: str | None) -> bytes:
    import json

    params = {"max_tokens": 1, "temperature": 0, "prompt_logprob_token_ids": cands.tolist(), "prompt_logprob_start": start}
    return json.dumps({"token_ids": ids, "sampling_params": params, **({"model": model} if model else {})}).encode()


async def drive_tito(url: str, work, args, model: str | None) -> int:
    """Score `work` over HTTP; the answered rows (an error stops the phase with its text)."""
    rows = 0
    queue = list(work)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        async def one() -> None:
            nonlocal rows
            while queue:
                ids, cands = queue.pop()
                response = await client.post(url + PATH, content=tito_body(ids, cands, args.prompt - 1, model),
                                             headers={"content-type": "application/json"})
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
                rows += cands.shape[0] if response.json()["prompt_token_id_logprobs"] else 0

        await asyncio.gather(*(one() for _ in range(args.concurrency)))
    return rows


async def drive_grpc(target: str, work, args) -> int:
    import grpc

    from proctor.proto import scoring_pb2, scoring_pb2_grpc

    rows = 0
    queue = list(work)
    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = scoring_pb2_grpc.TeacherScoringStub(channel)

        async def one() -> None:
            nonlocal rows
            while queue:
                ids, cands = queue.pop()
                request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=args.prompt, score_ids=scoring_pb2.Tensor(
                    dtype=scoring_pb2.INT32, shape=list(cands.shape), data=cands.tobytes()))
                answer = await stub.Score(request)
                rows += answer.score_logprobs.shape[0]

        await asyncio.gather(*(one() for _ in range(args.concurrency)))
    return rows


def phase(name: str, run, front: psutil.Process | None) -> tuple[int, float, float | None]:
    cpu0 = sum(front.cpu_times()[:2]) if front else None
    started = time.perf_counter()
    rows = asyncio.run(run())
    wall = time.perf_counter() - started
    cpu = sum(front.cpu_times()[:2]) - cpu0 if front else None
    return rows, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--device", default="cpu", help="proctor's device (cuda on a GPU)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="model dir (default: the tiny teacher, made here)")
    parser.add_argument("--proctor", default=None, help="HTTP_URL,GRPC_TARGET of a running proctor (else started)")
    parser.add_argument("--front-pid", type=int, default=None, help="with --proctor: its pid, for front CPU")
    parser.add_argument("--stock", default=None, help="stock vLLM's URL (started with --enable-scale-out)")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=500)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--inference", action="append", default=[], help="engine settings, as proctor serve takes them")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from proctor.server.cli.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="tito-bench-"))))
    import json

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    server = None
    if args.proctor:
        http_url, grpc_target = args.proctor.split(",")
        front = psutil.Process(args.front_pid) if args.front_pid else None
    else:
        flags = ["--engine", args.engine, "--model", model, "--max-model-len", str(args.max_model_len),
                 "--device", args.device, "--dtype", args.dtype,
                 "--max-topk", str(args.k), "--no-verbose"]
        for item in args.inference:
            flags += ["--inference", item]
        server = SubprocessServer(flags, startup_timeout=900)
        http_url, grpc_target, front = server.http_url, server.grpc_target, psutil.Process(server.proc.pid)
    phases = {"tito": lambda work: drive_tito(http_url, work, args, None),
              "grpc": lambda work: drive_grpc(grpc_target, work, args)}
    if args.stock:
        phases["stock"] = lambda work: drive_tito(args.stock, work, args, None)
    totals = {name: [0, 0.0, 0.0] for name in phases}
    refused: dict[str, str] = {}
    try:
        for name in phases:  # warm each surface up on its own sequences
            try:
                asyncio.run(phases[name](load(10_000 + len(name), argparse.Namespace(**{**vars(args), "seqs": 2}), vocab)))
            except RuntimeError as exc:
                refused[name] = str(exc)
        seed = 0
        for _ in range(args.rounds):
            for name, run in phases.items():
                if name in refused:
                    continue
                seed += 1
                work = load(seed, args, vocab)
                rows, wall, cpu = phase(name, lambda run=run, work=work: run(work), front if name != "stock" else None)
                totals[name][0] += rows
                totals[name][1] += wall
                totals[name][2] += cpu or 0.0
    finally:
        if server is not None:
            server.stop()
    print(f"\n{args.engine} teacher, {args.seqs} fresh sequences x {args.length} tokens a phase, top-{args.k} ids over "
          f"{args.length - args.prompt} rows each, {args.rounds} rounds alternated, {args.concurrency} concurrent calls")
    print(f"{'surface':<8} {'tokens/s':>10} {'front µs/token':>15}")
    rates = {}
    for name, (rows, wall, cpu) in totals.items():
        if name in refused:
            print(f"{name:<8} refused: {refused[name]}")
            continue
        rates[name] = rows / wall
        front_cost = f"{cpu / rows * 1e6:>15.2f}" if name != "stock" and front is not None else f"{'-':>15}"
        print(f"{name:<8} {rates[name]:>10.0f} {front_cost}")
    if "stock" in rates:
        print(f"proctor tito / stock vLLM: {rates['tito'] / rates['stock']:.2f}x (goal >= 2x)")
    print(f"proctor tito / proctor gRPC: {rates['tito'] / rates['grpc']:.2f}x")


if __name__ == "__main__":
    main()
