"""Rollout + scoring wall time: scoring overlapped with the rollout vs scoring after it.

Two pipelines over the same sequences against a real proctor server on loopback:
- sequential: generate every group, then `score_many` everything;
- overlapped: `RolloutScorer.scored` scores each group as soon as it is generated.

Rows:
- "gpu-like": generation and the teacher's forward are waits (asyncio sleeps stand in for
  devices working while the host idles); the teacher is the real torch engine behind a
  per-batch delay. Generation per group is calibrated so the whole rollout takes about as
  long as scoring everything: the case the goal (overlapped ≤ 0.6 × sequential) is about.
- "cpu": the tiny student samples on the CPU (in a thread) and the tiny teacher scores on
  the same CPU cores, so both compete for them and overlap can help less.

Run: .venv/bin/python bench/client_overlap.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from proctor.client import TeacherClient
from proctor.server.cli.tiny_model import ensure_default_model
from proctor.server.engines.base import EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.front.fleet.routing import Replica, ReplicaSet, Router
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions
from proctor.trainer_adapter.rollout import RolloutSample, RolloutScorer

from support.engines import InjectedEngine


def server_for(spec: EngineSpec, delay_s: float | None) -> ServerThread:
    async def build():
        if delay_s is None:
            return create_engine(spec)
        # A larger teacher on an accelerator: a fixed wait per batch, and small batches so
        # that scoring time grows with the number of sequences.
        return InjectedEngine(create_engine(spec), delay_per_batch_s=delay_s, token_budget=256)

    router = Router([ReplicaSet("tiny", [Replica("tiny-0", build)])])
    return ServerThread(router, ServerOptions(grpc_port=0, http_port=0))  # started by `with`


def make_groups(groups: int, per_group: int, prompt: int, response: int) -> list[list[RolloutSample]]:
    return [[RolloutSample([(g * 31 + i * 7 + j) % 500 for j in range(prompt)],
                           [(g * 13 + i * 3 + j) % 500 for j in range(response)])
             for i in range(per_group)] for g in range(groups)]


async def sequential(client: TeacherClient, groups, generate) -> float:
    started = time.monotonic()
    finished = []
    for group in groups:
        finished.extend(await generate(group))
    await asyncio.gather(*(client.score(s.token_ids, prompt_length=s.prompt_length) for s in finished))
    return time.monotonic() - started


async def overlapped(client: TeacherClient, groups, generate) -> float:
    started = time.monotonic()
    scorer = RolloutScorer(client, key_column=None)

    async def rollout():
        for group in groups:
            for sample in await generate(group):
                yield sample

    count = 0
    async for _ in scorer.scored(rollout()):
        count += 1
    assert count == sum(len(g) for g in groups)
    return time.monotonic() - started


async def gpu_like(target: str, groups) -> tuple[float, float, float]:
    async with TeacherClient(target, max_concurrency=64) as client:
        flat = [s for g in groups for s in g]
        await client.score_many([s.token_ids for s in flat[:8]])  # warm up
        started = time.monotonic()
        await asyncio.gather(*(client.score(s.token_ids, prompt_length=s.prompt_length) for s in flat))
        scoring = time.monotonic() - started
        per_group = scoring / len(groups)  # rollout as long as scoring: the case of interest

        async def generate(group):
            await asyncio.sleep(per_group)
            return group

        seq = await sequential(client, groups, generate)
        ovl = await overlapped(client, groups, generate)
    return scoring, seq, ovl


async def cpu(target: str, model_dir, groups_n: int, per_group: int, response: int) -> tuple[float, float, float]:
    from transformers import AutoModelForCausalLM

    from proctor.trainer_adapter.student import sample_responses

    student = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    prompts = [[(g * 31 + i * 7 + j) % 500 for j in range(12)] for g in range(groups_n) for i in range(per_group)]
    groups = [prompts[g * per_group:(g + 1) * per_group] for g in range(groups_n)]

    async def generate(group):
        rollouts = await asyncio.to_thread(sample_responses, student, group, length=response, pad_token_id=0, seed=0)
        return [RolloutSample(r.prompt_ids, r.response_ids) for r in rollouts]

    async with TeacherClient(target, max_concurrency=64) as client:
        await generate(groups[0])
        seq = await sequential(client, groups, generate)
        ovl = await overlapped(client, groups, generate)
    return float("nan"), seq, ovl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--teacher-delay-ms", type=float, default=40.0)
    parser.add_argument("--transport", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    spec = EngineSpec(name="torch", model_path=str(model_dir))
    rows = []
    with server_for(spec, args.teacher_delay_ms / 1000) as server:
        target = f"grpc://{server.grpc_target}" if args.transport == "grpc" else server.http_url
        groups = make_groups(args.groups, args.per_group, prompt=32, response=32)
        rows.append(("gpu-like", *asyncio.run(gpu_like(target, groups))))
    with server_for(spec, None) as server:
        target = f"grpc://{server.grpc_target}" if args.transport == "grpc" else server.http_url
        rows.append(("cpu", *asyncio.run(cpu(target, model_dir, args.groups, args.per_group, 32))))
    print(f"\nrollout + scoring of {args.groups} groups x {args.per_group} sequences over {args.transport}")
    print(f"{'setting':<10} {'scoring alone s':>16} {'sequential s':>13} {'overlapped s':>13} {'overlapped/sequential':>22}")
    for name, scoring, seq, ovl in rows:
        print(f"{name:<10} {scoring:>16.3f} {seq:>13.3f} {ovl:>13.3f} {ovl / seq:>22.2f}")


if __name__ == "__main__":
    main()
