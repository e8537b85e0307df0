"""Models are built one at a time in a process (`engines.torch.loading`).

transformers' own load-time patches (`no_tie_weights`) interleaved by two threads leave
`PreTrainedModel.tie_weights` a no-op for good (shown here with transformers' real context
managers), after which a tied model's head is no longer its embeddings; `build` refuses to
build on such a process, and loads through it from several threads at once stay correct.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from proctor.server.engines.torch.loading import TransformersStateCorrupted, build, check_intact


def _tied_model():
    import transformers

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    return build(transformers.AutoModelForCausalLM.from_config, config)


def test_interleaved_load_patches_leave_tying_off_and_build_refuses():
    from transformers import PreTrainedModel
    from transformers.initialization import no_tie_weights

    original = PreTrainedModel.tie_weights
    first, second = no_tie_weights(), no_tie_weights()
    try:
        first.__enter__()
        second.__enter__()  # keeps the no-op as "the original"
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)  # ...and puts it back
        assert PreTrainedModel.tie_weights is not original
        with pytest.raises(TransformersStateCorrupted, match="tie_weights"):
            check_intact()
        with pytest.raises(TransformersStateCorrupted):
            _tied_model()
    finally:
        PreTrainedModel.tie_weights = original
    check_intact()


def test_models_built_from_many_threads_at_once_are_tied():
    with ThreadPoolExecutor(4) as pool:
        models = list(pool.map(lambda _: _tied_model(), range(8)))
    for model in models:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)
    check_intact()
