"""The built-in default teacher: a tiny Qwen-style causal LM made locally, no downloads.

Weights are random from a fixed seed and the tokenizer is a byte-level BPE trained with the
`tokenizers` library on a small built-in text, so the same directory comes out on every
machine. It is what `proctor serve` serves when no model is given, what the demo distils
from, and what the tests score against.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from proctor.server.engines.torch.loading import build

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "proctor" / "tiny-teacher"
DEFAULT_STUDENT_DIR = Path.home() / ".cache" / "proctor" / "tiny-student"

# ChatML, as Qwen's, over the special tokens the tiny tokenizers already have: `messages` of an
# aligned request are rendered with it (an unknown role is refused, as real templates refuse it).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
On-policy distillation trains a student on its own samples while a frozen teacher scores
every token. The teacher replays the student's prompt and response in one forward pass and
returns the log-probability of each token, its top candidates, or its last hidden states.
Reinforcement learning with verifiable rewards, math problems, code, proofs and dialogue:
the student explores, the teacher grades, and the loss pulls the two distributions closer.
0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " # $ % & @ ^ _ ` | ~
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def score(tokens): return teacher(tokens).log_softmax(-1)
User: what is 12 times 7? Assistant: 12 times 7 is 84.
"""
# The tiny student tokenizer's own text: other merges than the teacher's (and digits split one
# by one), so the two tokenize most text differently.
_STUDENT_CORPUS = """
A student model samples rollouts; the teacher scores them and the trainer distils. Tokenizers
differ between model families: each cuts text into its own pieces, so scores are aligned by
the bytes both tokenizations share. Bytes, characters, words and numbers: 3.14159 and 2718.
Über naïve café, 東京 and 数学, emoji 🙂 and symbols ± × ÷ ≤ ≥ → all travel as UTF-8 bytes.
User: what is 12 times 7? Assistant: it is 84, since 12 * 7 = 84.
"""


def build_tokenizer(vocab_size: int, extra_special: dict[str, str] | None = None, *, student: bool = False,
                    chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on the built-in corpus (deterministic); `extra_special`
    names a model family's own special tokens (its media placeholders, `{"image_token":
    "<|image_pad|>", ...}`, attributes that its processor reads), given ids after the base three.
    `student`: the tiny student's tokenizer instead, byte-level too but trained on other text with
    digits split one by one (other merges, another vocabulary), for cross-tokenizer distillation;
    `chat_template`: the tokenizer's (`CHAT_TEMPLATE` for the tiny text models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if student else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    extra_special = dict(extra_special or {})
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special.values()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_STUDENT_CORPUS if student else _CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=chat_template,
        **({"extra_special_tokens": extra_special} if extra_special else {}),
    )


def make_tiny_model(
    out_dir: str | Path = DEFAULT_MODEL_DIR,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,  # head size 32: the smallest vLLM's CPU attention supports
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    family: str = "qwen2",
    student_tokenizer: bool = False,
) -> Path:
    """Write a tiny causal LM (config, safetensors weights, tokenizer with `CHAT_TEMPLATE`) to
    out_dir: a Qwen2, or with `family` one whose logits are not lm_head(h) alone (`FAMILIES`:
    Gemma-2's final soft-cap, Granite's logit scaling), for checking that engines score with the
    model's own logits, or a GPT-2 (another architecture's names for its weights); with the tiny
    student's tokenizer (`build_tokenizer(student=True)`) when `student_tokenizer`."""
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, student=student_tokenizer, chat_template=CHAT_TEMPLATE)
    config_class, extra = _family_config(family)
    tie_word_embeddings = tie_word_embeddings or family in ("gemma2", "gpt2")
    config = config_class(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.dtype = torch.float32
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = build(AutoModelForCausalLM.from_config, config, dtype=torch.float32)
        # The default init is near-uniform; widen it so the teacher has a peaked distribution.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.25 if name.startswith("lm_head") else 0.08)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out, safe_serialization=True, state_dict=_checkpoint_state(model, tie_word_embeddings))
    tokenizer.save_pretrained(out)
    (out / "proctor_tiny.json").write_text(json.dumps({"seed": seed, "generator": "proctor.make_tiny_model"}))
    return out


def _checkpoint_state(model, tied: bool) -> dict[str, torch.Tensor]:
    """The weights to write. A tied head is left out of the file, as real tied checkpoints (GPT-2,
    Gemma-2) leave it: done here rather than trusting save_pretrained's alias detection, which keeps
    `lm_head.weight` whenever the tie was not in place at save time."""
    state = model.state_dict()
    if not tied:
        return state
    model.tie_weights()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.data_ptr() != embedding.data_ptr():
        raise RuntimeError("tiny model: the head is not tied to the input embedding after tie_weights()")
    return {name: tensor for name, tensor in state.items() if name != "lm_head.weight"}


# Tiny model families: the default, two whose final logits are transformed, and GPT-2 (its output
# embedding is `lm_head` tied to `transformer.wte`: the checkpoint holds only the latter).
FAMILIES = ("qwen2", "gemma2", "granite", "gpt2")


def _family_config(family: str):
    """(config class, its family-specific settings)."""
    import transformers

    if family == "gemma2":  # tanh(x / 5) * 5 on the final logits; no attention soft-cap (vLLM's CPU attention);
        # its head is the embeddings, as in every Gemma-2 checkpoint (vLLM's Gemma2 has no lm_head of its own)
        return transformers.Gemma2Config, {"final_logit_softcapping": 5.0, "attn_logit_softcapping": None,
                                           "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 4096}
    if family == "gpt2":  # its own names for the sizes (hidden_size etc. are aliases it maps)
        return transformers.GPT2Config, {"n_inner": None, "activation_function": "gelu_new"}
    if family == "granite":  # the logits divided by 8, as Granite 3 checkpoints divide theirs (8 or 16)
        return transformers.GraniteConfig, {"logits_scaling": 8.0}
    return transformers.Qwen2Config, {}


def ensure_default_model(path: str | Path = DEFAULT_MODEL_DIR) -> Path:
    """Build the default teacher once; later calls reuse the directory (one built before it had a
    chat template is built again: the same weights and token ids, from the same seed)."""
    out = Path(path)
    if not all((out / name).exists() for name in ("config.json", "model.safetensors", "chat_template.jinja")):
        make_tiny_model(out)
    return out


# The tiny student of cross-tokenizer distillation: its own tokenizer, its own weights.
STUDENT_VOCAB_SIZE = 400
STUDENT_SEED = 7


def ensure_tiny_student(path: str | Path = DEFAULT_STUDENT_DIR) -> Path:
    """Build the tiny student once (a Qwen2 of `STUDENT_VOCAB_SIZE` ids over the student tokenizer,
    random weights from `STUDENT_SEED`); later calls reuse the directory."""
    out = Path(path)
    if not all((out / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        make_tiny_model(out, vocab_size=STUDENT_VOCAB_SIZE, seed=STUDENT_SEED, student_tokenizer=True)
    return out
