"""What aligning a teacher's scores to a student's tokens costs, beside what scoring costs.

One run, side by side, for responses of about 1,000 student tokens (the tiny student's
tokenizer) to the tiny teacher (hidden 64, 2 layers) and to engine_bench's small teacher (hidden
256, 4 layers), both over the tiny teacher's tokenizer, through an in-process `ScoringService`
(torch engine in its replica worker):

- alignment: the front's work for one aligned request, timed alone in this thread: decoding the student's ids to bytes, the teacher's tokenization, the
  chunks and the teacher's request (`plan_aligned`), mapping the scored rows back and encoding
  the aligned answer;
- scoring: the same teacher sequence scored as a plain request through the service
  (validation, admission, the engine's forward pass in its worker, the answer);
- aligned request: the aligned request end to end through the same service.

Each is timed `--repeat` times interleaved and the best kept (the run least disturbed by other
load on the machine), then the median over the responses is printed.

    .venv/bin/python bench/alignment_cost.py [--requests 12] [--tokens 1000] [--topk 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine_bench import make_teacher

WORDS = ["the", "teacher", "scores", "every", "token", "über", "東京", "🙂", "12345", "fox", "naïve", "dog", "\n",
         "  ", "distillation", "3.14159", "student", "rollout"]


def responses(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` responses of `tokens` student tokens each (random words, digits, multi-byte text)."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer(" " + " ".join(rng.choice(WORDS) for _ in range(50)))["input_ids"]
        out.append(ids[:tokens])
    return out


async def bench(model: Path, student_dir: Path, args) -> dict[str, float]:
    from transformers import AutoTokenizer

    from proctor.proto import scoring_pb2
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.aligned_request import plan_aligned
    from proctor.server.front.responses import Responses
    from proctor.server.front.service import ScoringService

    spec = EngineSpec(name="torch", model_path=str(model), dtype="float32", max_topk=64,
                      inference={"max_model_len": 4096, "prompt_reuse": False})
    service = ScoringService(single_teacher_router(spec, name="bench"), student_tokenizers={"student": str(student_dir)})
    await service.start()
    answers = Responses(service.metrics)
    student = AutoTokenizer.from_pretrained(student_dir)
    prompt_ids = student("User: write something long.\nAssistant:")["input_ids"]
    teacher_prompt = [1, 87, 326, 201, 74, 75, 2, 201, 1, 366, 495, 201]
    pair = service.aligned.tokenizers.pair("student", "bench")
    info = service.router.teachers["bench"].info
    align_s, score_s, aligned_s, teacher_tokens = [], [], [], []
    try:
        for response in responses(student, args.requests, args.tokens):
            aligned = scoring_pb2.ScoreRequest(token_ids=prompt_ids + response, prompt_length=len(prompt_ids),
                                               topk=args.topk, student_tokenizer="student",
                                               teacher_prompt_ids=teacher_prompt)
            best = {"align": float("inf"), "score": float("inf"), "aligned": float("inf")}
            for _ in range(args.repeat):  # interleaved, best of each: the least disturbed by other load
                started = time.perf_counter()
                plan = plan_aligned(aligned, pair, info, "bench")
                prepared = time.perf_counter() - started
                started = time.perf_counter()
                scored = await service.score(plan.teacher_request)
                answers.protobuf(scored)
                best["score"] = min(best["score"], time.perf_counter() - started)
                started = time.perf_counter()
                plan.answer(scored.result).protobuf()
                best["align"] = min(best["align"], prepared + time.perf_counter() - started)
                started = time.perf_counter()
                answers.protobuf(await service.score(aligned))
                best["aligned"] = min(best["aligned"], time.perf_counter() - started)
            align_s.append(best["align"])
            score_s.append(best["score"])
            aligned_s.append(best["aligned"])
            teacher_tokens.append(len(plan.teacher_sequence) - plan.teacher_first_row)
    finally:
        await service.stop()
    return {"align": statistics.median(align_s), "score": statistics.median(score_s),
            "aligned": statistics.median(aligned_s), "teacher_tokens": statistics.median(teacher_tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from proctor.server.cli.tiny_model import STUDENT_SEED, STUDENT_VOCAB_SIZE, make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        student_dir = make_tiny_model(Path(tmp) / "student", vocab_size=STUDENT_VOCAB_SIZE, seed=STUDENT_SEED,
                                      student_tokenizer=True)
        for label, quick in (("tiny (hidden 64, 2 layers)", True), ("small (hidden 256, 4 layers)", False)):
            model = make_teacher(Path(tmp) / label.split()[0], quick)
            print(f"  {label} ...", file=sys.stderr, flush=True)
            rows.append((label, asyncio.run(bench(model, student_dir, args))))
    print(f"\n{args.requests} responses of {args.tokens} student tokens, top-{args.topk}; median of best-of-{args.repeat}")
    print("| teacher | teacher tokens | alignment (ms) | scoring (ms) | alignment / scoring | aligned request / plain |")
    print("|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['teacher_tokens']:.0f} | {r['align'] * 1e3:.2f} | {r['score'] * 1e3:.2f} | "
              f"**{r['align'] / r['score']:.1%}** | {r['aligned'] / r['score']:.2f}x |")


if __name__ == "__main__":
    main()
