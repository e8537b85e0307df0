"""`/v1/completions` under load, on one real `proctor serve` (torch engine, tiny teacher).

- A 20 MB body (four prompts of 1.3M token ids each) is parsed, turned into ScoreRequests and
  refused for its length while `/health/live` is polled: the work that grows with the body runs
  in a worker thread, so every poll is answered within a second (and well within the call).
- The front's CPU per scored top-k token over gRPC, on fresh sequences, best of three rounds, under
  a generous bound (`FRONT_US_PER_TOKEN`, above issue 42's goal of 2.5): a loaded host measured
  1.3-2.0 µs (top-32, torch engine); per-value Python work in the front (decoding or formatting an
  answer's rows: 1 µs and more a token) crosses it. `bench/front_cpu.py --fresh-only` prints the figures it guards.
- Twelve rounds of the same load (what TRL's VLLMClient sends: one prompt per request,
  `prompt_logprobs=K`, several at a time): the front process's CPU per scored token does not
  climb and its RSS stays flat. CPU seconds per token (psutil, the front alone) rather than
  tokens/s, so that a busy machine does not decide the test; the best round of the first half
  against the best of the second half. Other processes on the host only ever add to a round's CPU
  (cache and core contention), never take from it, so the minimum over six rounds is the
  estimate of the front's own cost; over three, one noisy stretch of the host decided it. The
  bound, 1.25×, is above what a loaded host's drift showed in full runs (1.14× and 1.19×, with a
  flat cost on a quiet host: `bench/completions_rounds.py`, 16 rounds, last/first 0.98×): it
  catches a climb of a quarter or more within twelve rounds, not a slower one.
  `bench/completions_rounds.py` prints the per-round figures (tokens/s too).
"""

from __future__ import annotations

import asyncio
import random

import httpx
import psutil
import pytest

from support.servers import SubprocessServer, poll_live_while

PROMPT_TOKENS = 480
TOPK = 32
REQUESTS = 32
CONCURRENCY = 8
ROUNDS = 12
FRONT_US_PER_TOKEN = 3.0
FRESH_SEQS = 96  # 45k tokens a round: a 10 ms CPU tick is 0.22 µs a token


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    served = SubprocessServer(["--model", str(tiny_model_dir), "--max-topk", str(TOPK), "--teacher-name", "load",
                               "--no-verbose"])
    yield served
    served.stop()


def test_a_16_mb_body_leaves_health_polls_answered(server):
    # 4M ids: under the count a body may hold before its parse (`ScoringService.most_body_numbers`:
    # as many prompts as the queue admits), so it is parsed, off the loop, and then refused by length
    prompt = b"[" + b"123," * 1_000_000 + b"7]"
    body = b'{"model": "load", "max_tokens": 1, "prompt_logprobs": 1, "prompt": [' + b",".join([prompt] * 4) + b"]}"
    assert len(body) > 16_000_000
    latencies, took, reply = poll_live_while(server.http_url, lambda: httpx.post(
        server.http_url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120))
    assert reply.status_code == 400, reply.text[:300]  # vLLM's status for a prompt over max_model_len
    error = reply.json()["error"]
    assert error["param"] == "token_ids" and "max_model_len 4096" in error["message"], error
    assert len(latencies) > 5, (latencies, took)
    assert max(latencies) < min(1.0, max(0.25, took / 4)), (max(latencies), took)
    good = httpx.post(server.http_url + "/v1/completions", json={
        "model": "load", "prompt": [5, 17, 33, 2], "max_tokens": 1, "prompt_logprobs": 2}, timeout=60)
    assert good.status_code == 200 and len(good.json()["choices"][0]["prompt_logprobs"]) == 4


async def _round(http: httpx.AsyncClient, seqs: list[list[int]]) -> int:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(ids: list[int]) -> int:
        async with gate:
            answer = await http.post("/v1/completions", json={
                "model": "load", "prompt": ids, "max_tokens": 1, "prompt_logprobs": TOPK})
        assert answer.status_code == 200, answer.text[:300]
        rows = answer.json()["choices"][0]["prompt_logprobs"]
        assert len(rows) == len(ids) and rows[0] is None
        return len(ids)

    return sum(await asyncio.gather(*(one(ids) for ids in seqs)))


def _front_cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()  # the front alone: its replica workers are children, not counted
    return times.user + times.system


async def test_the_fronts_cpu_per_scored_token_stays_under_its_bound(server):
    import grpc

    from proctor.proto import scoring_pb2

    rng = random.Random(1)
    front = psutil.Process(server.proc.pid)
    per_token = []
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        score = channel.unary_unary("/proctor.v1.TeacherScoring/Score")
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(ids: list[int]) -> None:
            async with gate:
                await score(scoring_pb2.ScoreRequest(token_ids=ids, logprobs=True, topk=TOPK).SerializeToString())

        for round_ in range(4):  # fresh ids every round: nothing answered from memory; round 0 warms up
            seqs = [[rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for _ in range(FRESH_SEQS)]
            before = _front_cpu(front)
            await asyncio.gather(*(one(ids) for ids in seqs))
            if round_:
                per_token.append((_front_cpu(front) - before) / (FRESH_SEQS * (PROMPT_TOKENS - 1)) * 1e6)
    assert min(per_token) < FRONT_US_PER_TOKEN, [f"{value:.2f} us" for value in per_token]


async def test_rounds_of_the_same_load_keep_the_fronts_cost_and_memory(server):
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    front = psutil.Process(server.proc.pid)
    cpu_per_token, rss = [], []
    async with httpx.AsyncClient(base_url=server.http_url, timeout=300) as http:
        await _round(http, seqs[:CONCURRENCY])  # warm-up: tokenizer, decoded-token table
        for _ in range(ROUNDS):
            before = _front_cpu(front)
            tokens = await _round(http, seqs)
            cpu_per_token.append((_front_cpu(front) - before) / tokens)
            rss.append(front.memory_info().rss)
    early, late = min(cpu_per_token[: ROUNDS // 2]), min(cpu_per_token[ROUNDS // 2 :])
    assert late <= early * 1.25, [f"{value * 1e6:.1f} us" for value in cpu_per_token]
    assert rss[-1] - rss[1] < 24 << 20, [f"{value / 2**20:.1f} MiB" for value in rss]
