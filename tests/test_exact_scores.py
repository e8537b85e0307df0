"""Both engines against an independent float64 transformers forward: every output, at T in
{1, 0.7, 2}, with and without a prompt length, on a plain teacher and on teachers whose logits
are not lm_head(h) alone (Gemma-2's final soft-cap, Granite's logit scaling).

The reference is the model's own forward in float64 (`model(ids).logits`, which applies the
family's transforms), read in proctor's row convention (`support.reference`); the engines serve
the same checkpoints in float32, so 1e-5 is their float32 rounding. The vLLM Qwen2 engine runs with
chunked prefill on and a 128-token step, so a sequence's rows arrive in several pooler calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from proctor.server.engines.base import EngineConfigError, EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine

from support.reference import reference_rows

session_loop = pytest.mark.asyncio(loop_scope="session")

TOL = 1e-5
TEMPERATURES = (1.0, 0.7, 2.0)
TOPK, SCORE_K = 8, 6
VLLM_INFERENCE = {"gpu_memory_utilization": 0.1, "max_model_len": 1024, "enforce_eager": True}
# The Qwen2 vLLM engine prefills in chunks of 128 tokens: every request below spans several steps.
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128, "max_num_seqs": 8}


@pytest.fixture(scope="module", params=["qwen2", "gemma2", "granite"])
def family(request, tmp_path_factory):
    from proctor.server.cli.tiny_model import make_tiny_model

    return request.param, make_tiny_model(tmp_path_factory.mktemp(f"exact-{request.param}"), family=request.param)


def _requests(seed: int) -> list[EngineRequest]:
    """Sequences of 150-300 tokens, every output asked, at each temperature, from row 1 and from a prompt length."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i, temperature in enumerate(TEMPERATURES):
        for first_row in (1, 97):
            ids = torch.randint(3, 512, (150 + 50 * i + first_row % 7,), generator=generator)
            rows = ids.shape[0] - first_row
            score_ids = torch.randint(0, 512, (rows, SCORE_K), generator=generator)
            score_ids[::5, -2:] = -1  # padding
            requests.append(EngineRequest(
                request_id=f"t{temperature}-p{first_row}", token_ids=ids, first_row=first_row, logprobs=True,
                topk=TOPK, hidden_states=True, score_ids=score_ids, temperature=temperature, ranks=first_row == 1))
    return requests


def assert_exact(result, request: EngineRequest, model_dir) -> None:
    ref = reference_rows(model_dir, request.token_ids.tolist(), request.first_row,
                         temperature=request.temperature, dtype=torch.float64)
    torch.testing.assert_close(result.logprobs.double(), ref.logprobs, rtol=0, atol=TOL)
    if request.ranks:
        ranks = (ref.distributions > ref.logprobs[:, None]).sum(dim=1) + 1
        assert torch.equal(result.ranks.to(torch.int64), ranks), request.request_id
    else:  # not asked: not computed (the vLLM pooler leaves it out of its answer)
        assert result.ranks is None, request.request_id
    ids, values = ref.topk(request.topk)
    assert torch.equal(result.topk_ids.to(torch.int64), ids), request.request_id
    torch.testing.assert_close(result.topk_logprobs.double(), values, rtol=0, atol=TOL)
    wanted = torch.from_numpy(request.score_ids.astype(np.int64))
    expected = ref.distributions.gather(1, wanted.clamp_min(0)).masked_fill(wanted < 0, float("-inf"))
    torch.testing.assert_close(result.score_logprobs.double(), expected, rtol=0, atol=TOL)
    # Hidden states to 1e-5 of their own scale (post-norm activations of a few units; float32 holds
    # ~7 digits of each, so an absolute 1e-5 is below its resolution for the larger ones).
    scale = max(1.0, float(ref.hidden_states.abs().max()))
    torch.testing.assert_close(result.hidden_states.double(), ref.hidden_states, rtol=0, atol=TOL * scale)


async def _check_engine(spec: EngineSpec, model_dir) -> None:
    engine = create_engine(spec)
    await engine.start()
    try:
        assert engine.describe().temperature
        batch = _requests(seed=0)
        outcomes = await engine.score(batch)
        for request, outcome in zip(batch, outcomes, strict=True):
            assert type(outcome).__name__ == "EngineResult", outcome
            assert_exact(outcome, request, model_dir)
    finally:
        await engine.close()


@session_loop
async def test_torch_engine_scores_equal_a_float64_forward(family):
    _, model_dir = family
    await _check_engine(EngineSpec(name="torch", model_path=str(model_dir), dtype="float32", max_topk=64), model_dir)


@pytest.mark.vllm
@session_loop
async def test_vllm_engine_scores_equal_a_float64_forward(family):
    pytest.importorskip("vllm")
    name, model_dir = family
    inference = {**VLLM_INFERENCE, **(CHUNKED if name == "qwen2" else {})}
    spec = EngineSpec(name="vllm", model_path=str(model_dir), device="cpu", dtype="float32", max_topk=64,
                      inference=inference)
    await _check_engine(spec, model_dir)


@session_loop
async def test_torch_engine_refuses_a_model_whose_logits_it_cannot_reproduce(tmp_path, monkeypatch):
    """A logit transform the engine does not know (here: the soft-cap moved to a config key it does
    not read) is refused at start, naming the reason, never scored wrongly."""
    import json

    from proctor.server.cli.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "gemma", family="gemma2")
    engine = create_engine(EngineSpec(name="torch", model_path=str(model_dir), dtype="float32"))
    from proctor.server.engines.torch import engine as torch_engine

    monkeypatch.setattr(torch_engine, "logit_transforms", lambda config: torch_engine.LogitTransforms())
    with pytest.raises(EngineConfigError, match="logits are not its lm_head's output"):
        await engine.start()
    assert json.loads((model_dir / "config.json").read_text())["final_logit_softcapping"] == 5.0
