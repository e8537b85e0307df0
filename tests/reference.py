"""Independent references: a plain transformers forward pass, read in proctor's row convention.

Row i is about token i given tokens 0..i-1, so it comes from the logits and the last hidden
state at position i-1. Nothing here touches proctor's engines.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def _model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()


def reference_rows(model_dir: Path | str, token_ids: list[int], first_row: int = 1, topk: int = 0) -> dict:
    """logprobs [R], topk ids/logprobs [R, K] and post-norm hidden states [R, H] for rows first_row..T-1."""
    model = _model(str(model_dir))
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0].double(), dim=-1)[first_row - 1 : -1]
    targets = ids[0, first_row:]
    rows = {
        "logprobs": logp.gather(1, targets[:, None]).squeeze(1),
        "hidden_states": out.hidden_states[-1][0, first_row - 1 : -1],
    }
    if topk:
        values, indices = torch.topk(logp, topk, dim=-1)
        rows["topk_logprobs"], rows["topk_ids"] = values, indices
    return rows
