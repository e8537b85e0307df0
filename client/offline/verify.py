"""`proctor verify-dataset`: a random sample of stored sequences re-scored by a live teacher.

The live teacher scores each sampled sequence with the stored settings (K, temperature) and, as
score_ids, the stored top-k ids, so every stored top-k log-prob meets the teacher's exact
log-prob at the same id. The report gives the largest |stored - live| per output beside the
error the stored form states (`codecs.row_error`), and how many values exceed it. A teacher whose
fingerprint is not the stored one is reported first: the rows then came from other weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from proctor.client.client import ScoreInput, TeacherClient
from proctor.client.offline.reader import OfflineScores
from proctor.client.offline.shards import StoredSequence

LIVE_TOLERANCE = 1e-5  # what two exact float32 teachers may differ by (batching, kernels)


@dataclass
class VerifyReport:
    """The comparison of a stored sample with a live teacher."""

    directory: str
    sequences: int = 0
    positions: int = 0
    fingerprint_problem: str = ""
    logprob_diff: float = 0.0
    topk_diff: float = 0.0
    topk_stated: float = 0.0  # the largest stated error of a stored top-k value in the sample
    topk_over: int = 0  # stored top-k values further from the live ones than stated + LIVE_TOLERANCE
    logprob_over: int = 0
    ids_equal: int = 0  # rows whose stored top-k ids are the live top-k ids
    topk_form: str = ""
    lines_extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.fingerprint_problem and self.topk_over == 0 and self.logprob_over == 0

    def lines(self) -> list[str]:
        out = [self.fingerprint_problem] if self.fingerprint_problem else []
        out.append(f"{self.directory}: {self.sequences} sequences sampled, {self.positions} positions re-scored")
        out.append(f"sampled-token log-prob (float32): max |stored - live| = {self.logprob_diff:.3g} "
                   f"(stated: {LIVE_TOLERANCE:g}); {self.logprob_over} over")
        if self.topk_form:
            out.append(f"top-k log-probs ({self.topk_form}): max |stored - live| = {self.topk_diff:.3g} "
                       f"(stated quantization error: up to {self.topk_stated:.3g}, + {LIVE_TOLERANCE:g}); "
                       f"{self.topk_over} over")
            out.append(f"top-k ids: {self.ids_equal}/{self.positions} rows equal to the live teacher's")
        out.extend(self.lines_extra)
        out.append("ok" if self.ok else "MISMATCH")
        return out


def _largest(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def _compare(report: VerifyReport, stored: StoredSequence, live) -> None:
    scores = stored.scores
    report.positions += scores.num_rows
    if scores.logprobs is not None:
        diff = (scores.logprobs.double() - live.logprobs.double()).abs()
        report.logprob_diff = max(report.logprob_diff, _largest(diff))
        report.logprob_over += int((diff > LIVE_TOLERANCE).sum())
    if scores.topk_ids is not None:
        diff = (scores.topk_logprobs.double() - live.score_logprobs.double()).abs()
        report.topk_diff = max(report.topk_diff, _largest(diff))
        report.topk_stated = max(report.topk_stated, _largest(stored.topk_error))
        report.topk_over += int((diff > stored.topk_error.double() + LIVE_TOLERANCE).sum())
        same = torch.sort(scores.topk_ids, 1).values == torch.sort(live.topk_ids, 1).values
        report.ids_equal += int(same.all(1).sum())


async def verify_dataset(directory: Path | str, target: str, *, sample: int = 64, seed: int = 0,
                         teacher_key: str | None = None, token: str | None = None) -> VerifyReport:
    """Re-score `sample` random stored sequences (seeded) at `target` and compare."""
    dataset = OfflineScores(directory)
    identity = dataset.identity
    report = VerifyReport(str(directory), topk_form=identity.topk_form if identity.topk else "")
    picked = sorted(random.Random(seed).sample(range(len(dataset)), min(sample, len(dataset))))
    stored = [dataset[i] for i in picked]
    async with TeacherClient(target, token=token, max_concurrency=32) as client:
        info = await client.teacher_for_key(teacher_key or identity.teacher)
        if info.fingerprint != identity.fingerprint:
            report.fingerprint_problem = (
                f"fingerprint: stored {identity.fingerprint!r}, teacher {info.name!r} now {info.fingerprint!r}: "
                "the stored rows were scored by other weights or tokenizer")
        requests = [ScoreInput(s.token_ids, prompt_length=s.scores.first_row,
                               score_ids=s.scores.topk_ids if identity.topk else None) for s in stored]
        live = await client.score_many(requests, teacher_key=teacher_key or identity.teacher, logprobs=True,
                                       topk=identity.topk, temperature=identity.temperature)
    for one, answer in zip(stored, live, strict=True):
        _compare(report, one, answer)
    report.sequences = len(stored)
    return report
