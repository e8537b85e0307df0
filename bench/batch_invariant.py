"""The throughput cost of `inference.batch_invariant` on the torch engine, side by side in one run.

Two real torch engines on the same teacher, one batch-invariant (one unpadded forward and one head
pass per sequence) and one not (the padded batched pass), score the same batches of 32 sequences
with log-probs and top-8: interleaved, round after round, so both see the same machine. Reported:
CPU seconds per 1k scored tokens of each (the process's CPU time, one intra-op thread so that
OpenMP's spinning is not counted) and the ratio invariant / padded, for batches of mixed lengths
(where padding wastes work) and of equal lengths (where it wastes none). The goal is <= 1.3x.

    .venv/bin/python bench/batch_invariant.py [--rounds 5] [--quick]

Teachers (made locally, random weights): the tiny teacher (hidden 64, 2 layers, vocab 512: every
forward is overhead) and a small one (hidden 512, 4 layers, vocab 8192) unless --quick.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

BATCH = 32
TOPK = 8


def _batches(vocab: int, rounds: int, lengths: tuple[int, int], equal: bool):
    from proctor.server.engines.base import EngineRequest

    g = torch.Generator().manual_seed(0)
    out = []
    for r in range(rounds):
        sizes = [lengths[1]] * BATCH if equal else torch.randint(lengths[0], lengths[1] + 1, (BATCH,), generator=g).tolist()
        out.append([EngineRequest(f"{r}-{i}", torch.randint(3, vocab, (n,), generator=g), 1, True, TOPK, False)
                    for i, n in enumerate(sizes)])
    return out


async def _cpu_seconds(engine, batch) -> float:
    started = time.process_time()
    await engine.score(batch)
    return time.process_time() - started


async def _compare(model: Path, vocab: int, rounds: int, lengths: tuple[int, int], equal: bool) -> tuple[float, ...]:
    from proctor.server.engines.base import EngineSpec
    from proctor.server.engines.factory import create_engine

    engines = {flag: create_engine(EngineSpec("torch", str(model), inference={"batch_invariant": flag}))
               for flag in (False, True)}
    for engine in engines.values():
        await engine.start()
    batches = _batches(vocab, rounds + 1, lengths, equal)
    spent: dict[bool, list[float]] = {False: [], True: []}
    for index, batch in enumerate(batches):
        order = (False, True) if index % 2 else (True, False)
        for flag in order:
            seconds = await _cpu_seconds(engines[flag], batch)
            if index:  # the first round warms both up
                spent[flag].append(seconds)
    tokens = [sum(r.num_tokens for r in batch) for batch in batches[1:]]
    per_k = {flag: 1e6 * sum(spent[flag]) / sum(tokens) for flag in spent}  # CPU ms per 1k tokens
    ratios = [inv / pad for inv, pad in zip(spent[True], spent[False], strict=True)]
    return per_k[False], per_k[True], per_k[True] / per_k[False], statistics.median(ratios)


GOAL = 1.3  # invariant / padded CPU time per token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the tiny teacher only, 2 rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from proctor.server.cli.tiny_model import make_tiny_model

    teachers = {"tiny (h64, 2 layers, V512)": dict(hidden_size=64, num_layers=2, vocab_size=512)}
    if not args.quick:
        teachers["small (h512, 4 layers, V8192)"] = dict(hidden_size=512, num_layers=4, vocab_size=8192,
                                                          num_heads=8, num_kv_heads=2, intermediate_size=1024)
    rounds = 2 if args.quick else args.rounds
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in teachers.items():
            model = make_tiny_model(Path(tmp) / name.split()[0], **shape)
            for label, lengths, equal in (("mixed 16-512", (16, 512), False), ("equal 256", (256, 256), True)):
                rows.append((name, label, *asyncio.run(_compare(model, shape["vocab_size"], rounds, lengths, equal))))
    print(f"\ntorch engine, batches of {BATCH} sequences, log-probs + top-{TOPK}, {rounds} rounds, 1 thread: "
          "CPU ms per 1k tokens")
    print(f"{'teacher':<30}{'lengths':<15}{'padded':>10}{'invariant':>11}{'ratio':>8}{'median':>8}")
    for name, label, padded, invariant, ratio, median in rows:
        print(f"{name:<30}{label:<15}{padded:>10.1f}{invariant:>11.1f}{ratio:>7.2f}x{median:>7.2f}x")
    missed = [(name, label, ratio) for name, label, _, _, ratio, _ in rows if ratio > GOAL]
    if not missed:
        print(f"goal: invariant / padded <= {GOAL}x: met on every row")
        return
    print(f"goal: invariant / padded <= {GOAL}x: MISSED on " + "; ".join(
        f"{name.split()[0]} {label} ({ratio:.2f}x)" for name, label, ratio in missed)
        + (" (--quick: 2 rounds of the tiny teacher, whose ratio is the noisiest; run without it before judging)"
           if args.quick else ""))


if __name__ == "__main__":
    main()
