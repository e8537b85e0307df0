"""The vLLM engine: one pooling engine per replica running proctor's scoring model on the
teacher's own architecture (`scoring_model`, registered as a vLLM plugin), whose packed row
scores (`pooled_scores`) the replica unpacks (`engine`). vLLM's internals are touched only in
`adapter` (the releases it supports); `family` is what the vLLM and vLLM-Omni engines share,
`args`, `errors`, `media` and `prefix` their settings, error kinds, media prompts and prompt reuse."""
