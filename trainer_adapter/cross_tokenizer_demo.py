"""`proctor demo --cross-tokenizer`: a student with its own tokenizer distils from the tiny teacher.

The teacher (the built-in tiny teacher, its byte-level tokenizer of 512 ids) and the student (a
tiny Qwen2 of its own random weights over another byte-level tokenizer: other merges, 400 ids)
share no token ids. Each step the student samples responses to the demo's prompts; each is sent
with the student's ids, the server's key for the student's tokenizer and the prompt as a
conversation (`messages`, rendered by the teacher's chat template); the answer comes aligned to
the student's tokens. The loss is the GOLD-style hybrid (top-k KL where a chunk is one token on
both sides, ULD at the first token of the other chunks) plus the chunk-likelihood loss over
every chunk (`proctor.client.loss.cross_tokenizer`). The student starts from noise, so the loss
falls only if the alignment hands it the teacher's distributions at the right rows.

Trainer side only: the teacher is reached through `proctor.client`; the student's directory is
read for its tokenizer and weights.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from proctor.client import AlignedScores, TeacherClient, pack_aligned
from proctor.client.loss import chunk_likelihood_loss, gold_hybrid_loss
from proctor.trainer_adapter.plot import plot_losses
from proctor.trainer_adapter.rollout import RolloutSample
from proctor.trainer_adapter.student import TextStudent

LOSSES = ("gold_hybrid", "chunk_likelihood")
QUESTIONS = ["what is 12 times 7?", "name a quick brown animal.", "what does a teacher do?", "count to five.",
             "what is on-policy distillation?", "say something about dogs."]


@dataclass
class CrossSettings:
    steps: int = 20
    loss: str = "gold_hybrid"
    samples_per_prompt: int = 2
    response_length: int = 16
    topk: int = 16
    lr: float = 1e-2
    seed: int = 0


def _student_prompt(question: str) -> str:
    return f"User: {question}\nAssistant:"  # the student's own prompt format: it has no chat template


async def _score(client: TeacherClient, samples: list[RolloutSample], questions: list[str], student_key: str,
                 topk: int) -> list[AlignedScores]:
    jobs = [client.score(s.token_ids, prompt_length=s.prompt_length, topk=topk, student_tokenizer=student_key,
                         messages=[{"role": "user", "content": q}]) for s, q in zip(samples, questions, strict=True)]
    return list(await asyncio.gather(*jobs))


def _loss(student: TextStudent, samples: list[RolloutSample], answers: list[AlignedScores], loss: str):
    """The step's objective and its per-row values (for the log's min/max)."""
    hidden, targets = student.response_hidden(samples)
    logits = hidden @ student.model.get_output_embeddings().weight.T
    batch = pack_aligned(answers)
    student_logprobs = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)
    chunks = chunk_likelihood_loss(student_logprobs, batch.chunk_ids, batch.chunk_logprobs)
    if loss == "chunk_likelihood":
        return chunks.mean(), chunks.detach()
    rows = gold_hybrid_loss(logits, batch.topk_ids, batch.topk_logprobs, batch.exact, batch.uld,
                            batch.uld_teacher_logprobs)
    terms = batch.exact | batch.uld
    return rows[terms].mean() + chunks.mean(), rows[terms].detach()


def train_cross_tokenizer(target: str, student_dir: Path, student_key: str, settings: CrossSettings) -> list[dict]:
    """The loop; one log entry per step (loss, its min and max over rows or chunks, seconds)."""
    torch.manual_seed(settings.seed)
    student = TextStudent(student_dir, noise=0.0, seed=settings.seed)
    optimizer = torch.optim.Adam(student.model.parameters(), lr=settings.lr)
    questions = [q for q in QUESTIONS for _ in range(settings.samples_per_prompt)]
    prompts = student.prompts([_student_prompt(q) for q in QUESTIONS], settings.samples_per_prompt)
    logs: list[dict] = []

    async def run() -> None:
        async with TeacherClient(target, max_concurrency=16) as client:
            for step in range(1, settings.steps + 1):
                started = time.monotonic()
                samples = student.sample(prompts, length=settings.response_length, seed=settings.seed * 1009 + step)
                answers = await _score(client, samples, questions, student_key, settings.topk)
                objective, values = _loss(student, samples, answers, settings.loss)
                optimizer.zero_grad()
                objective.backward()
                optimizer.step()
                logs.append({"step": step, "loss": objective.item(), "loss_min": float(values.min()),
                             "loss_max": float(values.max()), "seconds": time.monotonic() - started})
                print(f"step {step:3d}  cross-tokenizer/{settings.loss} {logs[-1]['loss']:8.4f}  "
                      f"({logs[-1]['seconds']:.2f}s)", flush=True)

    asyncio.run(run())
    return logs


def cross_option_error(*, steps: int, loss: str, transport: str, teacher: str = "text") -> str | None:
    """What is wrong with `--cross-tokenizer`'s options, said as the command line would, or None."""
    if loss not in LOSSES:
        return f"--loss with --cross-tokenizer must be one of {', '.join(LOSSES)}, got {loss!r}"
    if transport not in ("grpc", "http"):
        return f"--transport must be grpc or http, got {transport!r}"
    if steps < 1:
        return "--steps must be at least 1"
    if teacher != "text":
        return "--cross-tokenizer distils from the text teacher; leave --teacher out"
    return None


def run_cross_tokenizer_demo(target: str, student_dir: Path, student_key: str, *, steps: int, loss: str, out: Path,
                             seed: int = 0) -> int:
    """Distil the tiny student (its own tokenizer) from the teacher at `target`; write the plot and
    log to `out`; the exit code."""
    settings = CrossSettings(steps=steps, loss=loss, seed=seed)
    print(f"cross-tokenizer distillation: student tokenizer {student_key!r}, loss {loss}, {steps} steps, "
          f"{len(QUESTIONS)} prompts x {settings.samples_per_prompt} samples x {settings.response_length} tokens")
    logs = train_cross_tokenizer(target, student_dir, student_key, settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"loss_cross_tokenizer_{loss}"
    plot_losses(out / f"{name}.png", [e["loss"] for e in logs], [e["loss_min"] for e in logs],
                [e["loss_max"] for e in logs], f"proctor demo --cross-tokenizer: {loss}")
    (out / f"{name}.json").write_text(json.dumps(logs, indent=1))
    first, last = logs[0]["loss"], logs[-1]["loss"]
    print(f"\nloss {first:.4f} -> {last:.4f} (x{last / first:.3f}); plot {out / f'{name}.png'}")
    return 0
