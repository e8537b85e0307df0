"""`proctor demo`: on-policy distillation end to end on the CPU, in about a minute.

A proctor server serves the built-in tiny teacher (`proctor demo` starts it and hands
`run_demo` its targets and model directory); the student is that teacher with noise
on its weights. Each step the student samples responses for a few prompts in small batches;
every finished batch goes to the teacher through the rollout hook while the next batch is
being sampled (scoring overlaps generation); then the chosen distillation loss trains the
student. For the full-vocabulary losses the teacher sends hidden states and, once, its
unembedding, and the loss runs chunked on student hidden states + lm_head against them.
Because the target is reachable exactly, the loss must fall clearly: a flat curve means the
scores, the row alignment or the loss is wrong.

Trainer side only: the teacher is reached through `proctor.client`, as a trainer would reach
a remote one; the model directory is read for the tokenizer and the student's weights.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from proctor.client import TeacherClient
from proctor.client.batch import hidden_states_batch, packed_score_logprobs, student_topk_ids
from proctor.client.loss import distillation_loss
from proctor.proto import hidden_forms
from proctor.trainer_adapter.plot import plot_losses
from proctor.trainer_adapter.rollout import RolloutScorer, ScoredSample
from proctor.trainer_adapter.student import TextStudent

# demo option -> the loss library's loss_mode
LOSSES = {
    "k1": "k1",
    "k3": "k3",
    "forward_kl_topk": "forward_kl_topk",
    "full_forward_kl": "nitrobrew",
    "full_reverse_kl": "nitrobrew_reverse_kl",
    "full_jsd": "full_jsd",
    "student_topk_reverse_kl": "student_topk_reverse_kl",
}
FULL_VOCAB_MODES = ("nitrobrew", "nitrobrew_reverse_kl", "full_jsd")  # from teacher hidden states
# What each loss is, as the demo's first line says it (all are natural-log divergences: nats per token).
MEANINGS = {
    "k1": "the k1 estimate of KL(student || teacher) at the sampled tokens",
    "k3": "the k3 estimate of KL(student || teacher) at the sampled tokens",
    "forward_kl_topk": "KL(teacher || student) over the teacher's top-k tokens",
    "full_forward_kl": "KL(teacher || student) over the whole vocabulary, from the teacher's hidden states",
    "full_reverse_kl": "KL(student || teacher) over the whole vocabulary, from the teacher's hidden states",
    "full_jsd": "the Jensen-Shannon divergence over the whole vocabulary, from the teacher's hidden states",
    "student_topk_reverse_kl": "KL(student || teacher) over the student's top-k tokens (the teacher scores them: score_ids)",
}
UNIT = "nats per response token"
TRANSPORTS = ("grpc", "http")
TEACHERS = ("text", "omni")  # the built-in tiny teacher, or the tiny Qwen2.5-Omni Thinker
PROMPTS = [
    "User: what is 12 times 7? Assistant:",
    "The quick brown fox",
    "On-policy distillation trains a student",
    "def score(tokens):",
    "Pack my box with",
    "The teacher replays the student's prompt",
    "0 1 2 3 4",
    "Reinforcement learning with verifiable rewards,",
]


@dataclass
class DemoSettings:
    steps: int = 30
    loss: str = "full_forward_kl"
    transport: str = "grpc"
    seed: int = 0
    response_length: int = 16
    groups: int = 4  # sampling batches per step; each is scored while the next is sampled
    samples_per_prompt: int = 2  # responses per prompt (a GRPO-style group)
    topk: int = 32
    noise: float = 0.6
    lr: float = 3e-3
    hidden_form: str = ""  # the teacher's hidden states' wire form (full-vocabulary losses); "": exact


@dataclass
class StepLog:
    step: int
    loss: float
    loss_min: float
    loss_max: float
    tokens_per_s: float
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)


def _line(log: StepLog) -> str:
    return (f"step {log.step:3d}  distillation/loss {log.loss:8.4f}  loss_min {log.loss_min:8.4f}  "
            f"loss_max {log.loss_max:8.4f}  scoring {log.tokens_per_s:7.0f} tok/s  ({log.seconds:.2f}s)")


class _Progress:
    """A tqdm bar on a terminal (when installed), plain lines otherwise: in a log (stderr not a
    terminal) a bar's redraws would land between the step lines. Per-step metrics are printed
    either way."""

    def __init__(self, total: int) -> None:
        self._bar = None
        if not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="distilling", unit="step", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass

    def step(self, log: StepLog) -> None:
        if self._bar is None:
            print(_line(log), flush=True)
            return
        self._bar.write(_line(log))
        self._bar.set_postfix(loss=f"{log.loss:.4f}")
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _student_topk(student, rollouts, k: int) -> list[torch.Tensor]:
    """The student's top-k per response row of each rollout (what it put its mass on), the
    score_ids that `student_topk_reverse_kl` needs the teacher to score."""
    with torch.no_grad():
        weight = student.model.get_output_embeddings().weight
        out = []
        for rollout in rollouts:
            hidden, _ = student.response_hidden([rollout])
            out.append(student_topk_ids(hidden @ weight.T, k))
        return out


async def _rollout_and_score(student, prompts, scorer: RolloutScorer, settings: DemoSettings,
                             step: int) -> tuple[list[ScoredSample], float, float]:
    """Sample in `groups` batches on a worker thread; each finished batch is scored while the
    next one is sampled. Returns the scored samples (input order), scoring seconds, total seconds."""
    groups = [prompts[i :: settings.groups] for i in range(settings.groups)]
    started = time.monotonic()
    first_submit: list[float] = []

    async def finished_rollouts():
        for g, group in enumerate(groups):
            rollouts = await asyncio.to_thread(student.sample, group, length=settings.response_length,
                                               seed=settings.seed * 100_003 + step * 97 + g)
            supports = (_student_topk(student, rollouts, settings.topk) if settings.loss == "student_topk_reverse_kl"
                        else [None] * len(rollouts))
            first_submit.append(time.monotonic())
            for rollout, support in zip(rollouts, supports, strict=True):
                rollout.score_ids = support
                yield rollout

    results = [scored async for scored in scorer.scored(finished_rollouts())]
    ended = time.monotonic()
    results.sort(key=lambda s: s.index)
    return results, ended - first_submit[0], ended - started


def _loss_inputs(mode: str, results: list[ScoredSample], student, teacher_weight) -> dict:
    hidden, targets = student.response_hidden([s.sample for s in results])
    weight = student.model.get_output_embeddings().weight
    if mode in ("k1", "k3"):
        logits = hidden @ weight.T
        student_logprobs = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)
        teacher = torch.cat([s.scores.logprobs for s in results])
        return {"student_logprobs": student_logprobs, "teacher_logprobs": teacher}
    inputs = {"student_hidden": hidden, "student_weight": weight}
    if mode == "student_topk_reverse_kl":  # the student's support, scored by the teacher
        inputs["student_topk_ids"] = torch.cat([s.sample.score_ids for s in results])
        inputs["teacher_score_logprobs"] = packed_score_logprobs([s.scores for s in results])
        return inputs
    if mode == "forward_kl_topk":
        inputs["teacher_topk_ids"] = torch.cat([s.scores.topk_ids for s in results]).long()
        inputs["teacher_topk_logprobs"] = torch.cat([s.scores.topk_logprobs for s in results])
        return inputs
    teacher_hidden, _ = hidden_states_batch([s.scores for s in results]).packed()
    # Packed fp8 rows go to the loss as they came (it dequantises them a chunk at a time).
    inputs["teacher_hidden"] = teacher_hidden if hidden_forms.is_fp8_rows(teacher_hidden) else teacher_hidden.float()
    inputs["teacher_weight"] = teacher_weight
    return inputs


def train(target: str, student, settings: DemoSettings) -> list[StepLog]:
    """The distillation loop against the teacher at `target` (`student`: a `TextStudent` or
    an `OmniStudent`); returns one StepLog per step."""
    mode = LOSSES[settings.loss]
    optimizer = torch.optim.Adam(student.model.parameters(), lr=settings.lr)
    prompts = student.prompts(PROMPTS, settings.samples_per_prompt)
    # No log-prob floor: verl's -10 default zeroes the gradient exactly where the noisy
    # student is furthest from the teacher, and the curve would stall.
    config = {"loss_mode": mode, "topk": settings.topk, "use_task_rewards": False, "log_prob_min_clamp": None,
              "use_policy_gradient": mode == "k1", "loss_agg_mode": "token-mean"}
    logs: list[StepLog] = []
    progress = _Progress(settings.steps)

    async def run() -> None:
        full_vocab = mode in FULL_VOCAB_MODES
        async with TeacherClient(target, max_concurrency=16) as client:
            teacher_weight = None
            if full_vocab:
                teacher_weight = await client.unembedding(projected=settings.hidden_form in hidden_forms.PROJECTED_FORMS)
            scorer = RolloutScorer(client, key_column=None, logprobs=True, hidden_states=full_vocab,
                                   hidden_form=settings.hidden_form if full_vocab else "",
                                   topk=settings.topk if mode == "forward_kl_topk" else 0)
            for step in range(1, settings.steps + 1):
                tokens_before = scorer.scored_tokens
                results, scoring_s, step_s = await _rollout_and_score(student, prompts, scorer, settings, step)
                output = distillation_loss(config, **_loss_inputs(mode, results, student, teacher_weight))
                if output.loss is not None:
                    objective = output.loss
                else:  # k1 as a policy gradient: the detached penalty weights log pi(a)
                    penalty = output.advantage_penalty
                    student_logprobs = _loss_inputs("k1", results, student, None)["student_logprobs"]
                    objective = (penalty * student_logprobs).mean()
                optimizer.zero_grad()
                objective.backward()
                optimizer.step()
                m = output.metrics
                log = StepLog(step, m["loss"], m["loss_min"], m["loss_max"],
                              (scorer.scored_tokens - tokens_before) / max(scoring_s, 1e-9), step_s)
                logs.append(log)
                progress.step(log)

    try:
        asyncio.run(run())
    finally:
        progress.close()
    return logs


def option_error(*, steps: int, loss: str, transport: str, teacher: str = "text", hidden_form: str = "") -> str | None:
    """What is wrong with the demo's options, said as the command line would, or None.

    `proctor demo` asks before it starts a server; `run_demo` asks again for direct callers.
    """
    if loss not in LOSSES:
        return f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}"
    if transport not in TRANSPORTS:
        return f"--transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
    if steps < 1:
        return "--steps must be at least 1"
    if teacher not in TEACHERS:
        return f"--teacher must be one of {', '.join(TEACHERS)}, got {teacher!r}"
    if hidden_form and hidden_form not in hidden_forms.FORMS:
        return f"--hidden-form must be one of {', '.join(hidden_forms.FORMS)}, got {hidden_form!r}"
    if hidden_form and LOSSES[loss] not in FULL_VOCAB_MODES:
        return f"--hidden-form applies to the full-vocabulary losses, not {loss}"
    return None


def loss_line(loss: str) -> str:
    """What the loss is, in its unit, and its loss_mode name (the demo's first lines say it)."""
    return f"loss {loss}: {MEANINGS[loss]}, in {UNIT} (the loss library's loss_mode {LOSSES[loss]!r}, verl-omni's name)"


def run_demo(targets: Mapping[str, str], model_dir: Path, *, steps: int = 30, loss: str = "full_forward_kl",
             transport: str = "grpc", out: Path = Path("out"), seed: int = 0, teacher: str = "text",
             **overrides) -> int:
    """Distil a noisy student from the teacher served at `targets[transport]` (grpc://… and
    http://… of one server), write the loss plot and log to `out`; the exit code."""
    problem = option_error(steps=steps, loss=loss, transport=transport, teacher=teacher,
                           hidden_form=overrides.get("hidden_form", ""))
    if problem:
        print(f"proctor demo: {problem}", file=sys.stderr)
        return 2
    settings = DemoSettings(steps=steps, loss=loss, transport=transport, seed=seed, **overrides)
    torch.manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if teacher == "omni":  # prompts with an image and an audio clip each, for the Thinker teacher
        from proctor.trainer_adapter.omni_student import OmniStudent

        student = OmniStudent(model_dir, noise=settings.noise, seed=seed)
    else:
        student = TextStudent(model_dir, noise=settings.noise, seed=seed)
    form = f", hidden states as {settings.hidden_form}" if settings.hidden_form else ""
    print(f"on-policy distillation of the {teacher} teacher{form}: transport {transport}, {steps} steps, "
          f"{len(PROMPTS)} prompts x {settings.samples_per_prompt} samples x {settings.response_length} tokens, "
          f"sampled in {settings.groups} batches")
    print(loss_line(loss))
    started = time.monotonic()
    logs = train(targets[transport], student, settings)
    elapsed = time.monotonic() - started
    losses = [log.loss for log in logs]
    stem = f"loss_{loss}_{settings.hidden_form}" if settings.hidden_form else f"loss_{loss}"  # a form beside the exact
    plot, log_file = out / f"{stem}.png", out / f"{stem}.json"
    writer = plot_losses(plot, losses, [log.loss_min for log in logs], [log.loss_max for log in logs],
                         f"proctor demo: {loss}{form} over {transport}", unit=UNIT)
    log_file.write_text(json.dumps([log.__dict__ for log in logs], indent=1))
    ratio = losses[-1] / losses[0] if losses[0] else float("nan")
    drawn = "matplotlib" if writer == "matplotlib" else "a bare curve without axis text: install matplotlib for one"
    print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} {UNIT} (x{ratio:.3f}) in {elapsed:.1f}s; "
          f"plot {plot} ({drawn}), log {log_file}")
    return 0
