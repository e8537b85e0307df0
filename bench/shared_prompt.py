"""Shared-prefix reuse for clients that send no prompt length: TRL's `VLLMClient` and the `openai`
client, unmodified, against `proctor serve` with reuse on and off, on the torch and vLLM engines.

GRPO-shaped traffic: groups of n = 8 responses of 256 tokens sharing a 1024-token prompt, every
member its own `/v1/completions` call (TRL's `get_sequence_logprobs` with `chunk_size=1`; the
openai client's `completions.create` from a thread pool), `--concurrency` in flight, all groups'
members shuffled together, every row from 1 asked (`prompt_logprobs` K; TRL's prompt lengths 1):
nobody tells the server where a prompt ends. The same sequences go to a server with reuse on and
one with `--inference prompt_reuse=false`, then the same shapes with every prompt unique (nothing
to share: the cost of looking).

Printed per engine, client and traffic, on vs off: scored tokens/s (wall clock: the ratio of two
runs side by side), the tokens the engines computed, measured (`proctor:engine_computed_tokens_total`:
the torch engine's fed positions, the vLLM pooler's scheduled positions) beside the reuse counter
(`proctor:prompt_reuse_tokens_total`), CPU-seconds of the serving tree, and the largest difference
between the reuse-on and reuse-off answers over every row and every returned log-prob (the top-K
and the actual token's), with the top-K ids compared, beside the engine's own noise: the reuse-off
server's answers to the same sequences sent again in reverse order.

    python bench/shared_prompt.py [--engines torch,vllm] [--clients trl,openai] [--groups 6] [--n 8]
        [--prompt 1024] [--response 256] [--topk 4] [--concurrency 16] [--repeats 2]

Goals (issue 25): shared traffic >= 1.8x scored tokens/s with reuse on (torch), >= 1.5x (vLLM),
answers equal within 1e-5 (float32); unique traffic within 5% of reuse off.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.server.cli.tiny_model import make_tiny_model

from support.cpu import tree_cpu
from support.servers import SubprocessServer

ENGINE_FLAGS = {
    "torch": ["--engine", "torch"],
    "vllm": ["--engine", "vllm", "--inference", "gpu_memory_utilization=0.1", "--inference", "enforce_eager=true",
             "--inference", "hidden_states=false"],
}
COUNTERS = ("prompt_reuse_hits", "prompt_reuse_misses", "prompt_reuse_tokens", "engine_computed_tokens")


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


def counters(server: SubprocessServer) -> dict[str, float]:
    import httpx

    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    values = {}
    for name in COUNTERS:
        found = re.findall(rf"^proctor:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        values[name] = sum(float(x) for x in found)
    return values


def score_trl(server: SubprocessServer, sequences: list[list[int]], topk: int, concurrency: int) -> list:
    """TRL's own client, as its distillation trainer calls it, one sequence per call, rows from 1."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=server.http_url)
    out = client.get_sequence_logprobs(sequences, [1] * len(sequences), top_logprobs=topk, chunk_size=1,
                                       max_concurrent_requests=concurrency)
    return [(torch.tensor(out["logprob_token_ids"][i]), torch.tensor(out["logprobs"][i]),
             torch.tensor(out["actual_logprobs"][i])[:, 0]) for i in range(len(sequences))]


def score_openai(server: SubprocessServer, sequences: list[list[int]], topk: int, concurrency: int) -> list:
    """The openai package's completions call with vLLM's prompt_logprobs, one sequence per call."""
    from openai import OpenAI

    client = OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(ids: list[int]):
        choice = client.completions.create(model=model, prompt=[ids], max_tokens=1,
                                           extra_body={"prompt_logprobs": topk}).choices[0]
        rows = choice.prompt_logprobs[1:]
        top = [sorted(((int(t), e["logprob"]) for t, e in row.items() if e["rank"] <= topk), key=lambda x: -x[1])
               for row in rows]
        actual = [row[str(token)]["logprob"] for row, token in zip(rows, ids[1:], strict=True)]
        return (torch.tensor([[t for t, _ in r] for r in top]), torch.tensor([[v for _, v in r] for r in top]),
                torch.tensor(actual))

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, sequences))


CLIENTS = {"trl": score_trl, "openai": score_openai}


def run(server: SubprocessServer, client: str, sequences: list[list[int]], args) -> dict:
    before, cpu = counters(server), tree_cpu(server.proc.pid)
    wall = time.perf_counter()
    answers = CLIENTS[client](server, sequences, args.topk, args.concurrency)
    wall = time.perf_counter() - wall
    after = counters(server)
    tokens = sum(len(s) for s in sequences)
    return {"wall": wall, "tokens": tokens, "tokens_s": tokens / wall, "answers": answers,
            "cpu": tree_cpu(server.proc.pid) - cpu, **{k: after[k] - before[k] for k in COUNTERS}}


def gap(on: list, off: list) -> tuple[float, bool]:
    """Largest |difference| of returned log-probs (top-K and actual) and whether every top-K id agrees."""
    worst, same_ids = 0.0, True
    for (ids_a, top_a, act_a), (ids_b, top_b, act_b) in zip(on, off, strict=True):
        same_ids &= torch.equal(ids_a, ids_b)
        worst = max(worst, float((top_a - top_b).abs().max()), float((act_a - act_b).abs().max()))
    return worst, same_ids


def float64_error(model_dir: Path, sequences: list[list[int]], answers: list) -> float:
    """Largest |actual-token log-prob - a float64 forward of the teacher| over these sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float64).eval()
    worst = 0.0
    with torch.inference_mode():
        for ids, (_, _, actual) in zip(sequences, answers, strict=False):
            tokens = torch.tensor([ids])
            exact = torch.log_softmax(model(tokens).logits[0, :-1], -1).gather(1, tokens[0, 1:, None])[:, 0]
            worst = max(worst, float((actual.double() - exact).abs().max()))
    return worst


def serve(model_dir: Path, engine: str, reuse: bool, max_len: int, topk: int) -> SubprocessServer:
    flags = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", str(max_len), "--max-topk",
             str(topk), *ENGINE_FLAGS[engine], "--inference", f"prompt_reuse={'true' if reuse else 'false'}",
             "--no-verbose"]
    return SubprocessServer(flags, startup_timeout=600)


def measure(model_dir: Path, engine: str, args, loads: dict, max_len: int) -> dict:
    """Every client and traffic on a reuse-on and a reuse-off server. Torch servers run side by side
    and take turns run by run, so the machine's load drifts over both alike; vLLM servers run one
    at a time (one vLLM engine per machine here)."""
    results: dict[tuple[str, str, bool], list[dict]] = {}
    baselines: dict[tuple[str, str], dict] = {}
    warm = traffic(1, 4, args.prompt, args.response, shared=False, seed=3)

    def rounds(servers: dict[bool, SubprocessServer]) -> None:
        for server in servers.values():
            run(server, "trl", warm, args)
        for repeat in range(args.repeats):
            for (client, name), load in loads.items():
                for reuse, server in servers.items():
                    results.setdefault((client, name, reuse), []).append(run(server, client, load[repeat], args))
        if False in servers:  # the engine's own noise: the first load again, reuse off, arriving in reverse
            for (client, name), load in loads.items():
                again = run(servers[False], client, load[0][::-1], args)
                again["answers"] = again["answers"][::-1]
                baselines[client, name] = again

    if engine == "vllm":
        for reuse in (True, False):
            server = serve(model_dir, engine, reuse, max_len, args.topk)
            try:
                rounds({reuse: server})
            finally:
                server.stop()
    else:
        servers = {}
        try:
            for reuse in (True, False):
                servers[reuse] = serve(model_dir, engine, reuse, max_len, args.topk)
            rounds(servers)
        finally:
            for server in servers.values():
                server.stop()
    return results, baselines


def report(engine: str, results: dict, baselines: dict, model_dir: Path, loads: dict, checked: int) -> None:
    for (client, name, reuse), done in sorted(results.items()):
        best = max(done, key=lambda r: r["tokens_s"])
        print(f"{engine:6} {client:6} {name:7} {'on' if reuse else 'off':3} {best['wall']:7.2f} {best['tokens_s']:8.0f} "
              f"{best['cpu']:7.2f} {best['engine_computed_tokens'] / best['tokens']:9.3f} "
              f"{best['prompt_reuse_tokens'] / best['tokens']:9.3f} {best['prompt_reuse_hits']:5.0f} "
              f"{best['prompt_reuse_misses']:6.0f}")
    for client in sorted({c for c, _, _ in results}):
        for name in ("shared", "unique"):
            on, off = results[client, name, True], results[client, name, False]
            speed = max(r["tokens_s"] for r in on) / max(r["tokens_s"] for r in off)
            computed = on[0]["engine_computed_tokens"] / off[0]["engine_computed_tokens"]
            cpu = min(r["cpu"] for r in on) / min(r["cpu"] for r in off)
            worst, same_ids = gap(on[0]["answers"], off[0]["answers"])
            noise, _ = gap(baselines[client, name]["answers"], off[0]["answers"])
            print(f"{engine:6} {client:6} {name:7} on/off: tokens/s {speed:.2f}x, engine-computed tokens "
                  f"{computed:.2f}x, serving CPU-s {cpu:.2f}x; answers max |on - off| {worst:.1e} "
                  f"(off again, reversed: {noise:.1e}), top-K ids {'equal' if same_ids else 'DIFFER'}")
            if name == "shared" and checked:
                first = loads[client, name][0][:checked]
                print(f"{engine:6} {client:6} {name:7} max |log-prob - float64 forward| over {checked} sequences: "
                      f"reuse on {float64_error(model_dir, first, on[0]['answers']):.1e}, "
                      f"off {float64_error(model_dir, first, off[0]['answers']):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--clients", default="trl,openai")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checked", type=int, default=6, help="shared sequences checked against float64")
    args = parser.parse_args()
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "teacher", hidden_size=256, num_layers=4, num_heads=4,
                                num_kv_heads=2, intermediate_size=512)
    clients = args.clients.split(",")
    loads = {(client, name): [traffic(args.groups, args.n, args.prompt, args.response, shared=name == "shared",
                                      seed=100 * c + (10 if name == "shared" else 50) + i) for i in range(args.repeats)]
             for c, client in enumerate(clients) for name in ("shared", "unique")}  # fresh sequences every run
    print(f"{args.groups} groups x n={args.n}, prompt {args.prompt}, response {args.response}, every row from 1 "
          f"with top-{args.topk}, {args.concurrency} calls in flight; 4-layer teacher (hidden 256), float32")
    print(f"{'engine':6} {'client':6} {'traffic':7} {'reuse':3} {'wall s':>7} {'tok/s':>8} {'CPU-s':>7} "
          f"{'computed':>9} {'reused':>9} {'hits':>5} {'misses':>6}   (computed, reused: per scored token)")
    for engine in args.engines.split(","):
        max_len = args.prompt + args.response + 64
        report(engine, *measure(model_dir, engine, args, loads, max_len), model_dir, loads, args.checked)


if __name__ == "__main__":
    main()
