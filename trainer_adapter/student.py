"""The demo's student: a copy of the teacher with noise on its weights, sampling on the CPU.

A noise-perturbed copy makes convergence visible and checkable: the distillation target is
reachable exactly (the teacher itself), so the KL must fall towards zero if the scores, the
row alignment and the loss are right, and any mistake among them shows as a flat curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from proctor.trainer_adapter.rollout import RolloutSample


def noisy_student(model_dir: str | Path, *, noise: float, seed: int):
    """The teacher's weights plus Gaussian noise of `noise` × each matrix's own std."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * noise)
    return model


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]


@torch.no_grad()
def sample_responses(model, prompts: list[list[int]], *, length: int, pad_token_id: int, seed: int) -> list[Rollout]:
    """Sample `length` tokens for every prompt in one batched, left-padded generate call."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    torch.manual_seed(seed)
    model.eval()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=length, min_new_tokens=length, pad_token_id=pad_token_id,
    )
    return [Rollout(list(prompt), out[row, width:].tolist()) for row, prompt in enumerate(prompts)]


def response_hidden(model, sequences: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Student (hidden [N, H], sampled-token ids [N]) for every response row, packed in order.

    Row r of a sequence with prompt length p is the activation at position p + r - 1, the
    one that predicts token p + r: the same pairing as the teacher's rows p..T-1.
    """
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (tokens, _) in enumerate(sequences):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    model.train()
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    rows, targets = [], []
    for row, (tokens, prompt_length) in enumerate(sequences):
        rows.append(hidden[row, prompt_length - 1 : len(tokens) - 1])
        targets.append(ids[row, prompt_length : len(tokens)])
    return torch.cat(rows), torch.cat(targets)


class TextStudent:
    """The demo's student for a text teacher: prompts are token ids, one batched generate."""

    def __init__(self, model_dir: str | Path, *, noise: float, seed: int) -> None:
        from transformers import AutoTokenizer

        self.model = noisy_student(model_dir, noise=noise, seed=seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def prompts(self, texts: Sequence[str], copies: int) -> list[list[int]]:
        return [self.tokenizer(text)["input_ids"] for text in texts for _ in range(copies)]

    def sample(self, prompts: list[list[int]], *, length: int, seed: int) -> list[RolloutSample]:
        rollouts = sample_responses(self.model, prompts, length=length, pad_token_id=self.tokenizer.pad_token_id,
                                    seed=seed)
        return [RolloutSample(r.prompt_ids, r.response_ids) for r in rollouts]

    def response_hidden(self, samples: Sequence[RolloutSample]) -> tuple[torch.Tensor, torch.Tensor]:
        return response_hidden(self.model, [(s.token_ids, s.prompt_length) for s in samples])
