"""The omni demo's student: the Thinker of a Qwen2.5-Omni checkpoint with noise on its weights.

Its rollouts are what an omni OPD rollout is: a prompt of text, an image and an audio clip,
made into token ids by the model's own processor (placeholders expanded), a response sampled
by the student's full multimodal forward, and the media sent to the teacher as the wire
carries them (PNG, WAV). The teacher must score the response given the same media; if it
scored it without them, or misaligned, the loss would not fall.

Trainer side: transformers' own classes and processor, no proctor server code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from proctor.client import Media
from proctor.client.media_files import png_media, wav_media, wav_samples
from proctor.trainer_adapter.rollout import RolloutSample

IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
RATE = 16000
MARKERS = ["<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]


@dataclass
class OmniPrompt:
    """A prompt's token ids, the processor's media tensors (for the student) and wire media."""

    ids: list[int]
    inputs: dict[str, torch.Tensor]
    images: list[Media]
    audios: list[Media]


class OmniStudent:
    """A noisy Thinker; prompts carry an image and an audio clip each."""

    def __init__(self, model_dir: str | Path, *, noise: float, seed: int) -> None:
        import transformers
        from transformers import AutoConfig, AutoProcessor

        architecture = AutoConfig.from_pretrained(model_dir).architectures[0]
        wrapper = getattr(transformers, architecture).from_pretrained(model_dir, local_files_only=True,
                                                                      dtype=torch.float32)
        self.model = wrapper.thinker
        self.processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        # A response never holds media markers (a random student would sample them now and then).
        tokenizer = self.processor.tokenizer
        self._media_tokens = tokenizer.convert_tokens_to_ids(MARKERS)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # noise on the language model only: the towers stay the teacher's
            for param in self.model.get_decoder().parameters():
                if param.dim() >= 2:
                    param.add_(torch.randn(param.shape, generator=generator) * param.std() * noise)
            head = self.model.get_output_embeddings().weight
            head.add_(torch.randn(head.shape, generator=generator) * head.std() * noise)

    def prompts(self, texts: Sequence[str], copies: int) -> list[OmniPrompt]:
        rng = np.random.default_rng(0)
        out = []
        for index, text in enumerate(texts):
            pixels = rng.integers(0, 256, (56 + 14 * (index % 3), 70, 3), dtype=np.uint8)
            seconds = 0.3 + 0.1 * (index % 4)
            t = np.arange(int(seconds * RATE)) / RATE
            clip = wav_media((0.3 * np.sin(2 * np.pi * (220 + 40 * index) * t)).astype(np.float32), RATE)
            image = png_media(pixels)
            inputs = self.processor(text=[f"User: {IMAGE} {AUDIO} {text}"], images=[pixels],
                                    audio=[wav_samples(clip)], sampling_rate=RATE, return_tensors="pt")
            ids = inputs.pop("input_ids")[0].tolist()
            inputs.pop("attention_mask")
            out += [OmniPrompt(ids, dict(inputs), [image], [clip])] * copies
        return out

    @torch.no_grad()
    def sample(self, prompts: list[OmniPrompt], *, length: int, seed: int) -> list[RolloutSample]:
        """One multimodal generate per prompt (their media differ)."""
        self.model.eval()
        torch.manual_seed(seed)
        rollouts = []
        for prompt in prompts:
            ids = torch.tensor([prompt.ids])
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.inputs,
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
                                      min_new_tokens=length, pad_token_id=self.processor.tokenizer.pad_token_id,
                                      suppress_tokens=self._media_tokens)
            sample = RolloutSample(prompt.ids, out[0, len(prompt.ids):].tolist(), images=prompt.images,
                                   audios=prompt.audios)
            sample.meta = {"inputs": prompt.inputs}
            rollouts.append(sample)
        return rollouts

    def response_hidden(self, samples: Sequence[RolloutSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Student (hidden [N, H], sampled ids [N]) for every response row, from the full forward."""
        self.model.train()
        rows, targets = [], []
        for sample in samples:
            captured: list[Any] = []
            handle = self.model.get_decoder().register_forward_hook(
                lambda _m, _a, out, keep=captured.append: keep(out))
            try:
                ids = torch.tensor([sample.token_ids])
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **sample.meta["inputs"])
            finally:
                handle.remove()
            hidden = captured[0].last_hidden_state[0]
            rows.append(hidden[sample.prompt_length - 1 : len(sample.token_ids) - 1])
            targets.append(ids[0, sample.prompt_length :])
        return torch.cat(rows), torch.cat(targets)
