"""The verl client adapter: proctor's TeacherClient behind the teacher-client interface verl calls.

verl 0.9's agent loop scores each finished sequence through
`verl.experimental.teacher_loop.teacher_manager.AsyncTeacherLLMServerManager`, which holds
one client per teacher key (`dict[str, LLMServerClient]`) and awaits
`client.generate(request_id, prompt_ids=..., sampling_params={"max_tokens": 1,
"prompt_logprobs": K, ...}, image_data=..., video_data=..., audio_data=...,
mm_processor_kwargs=...)`, reading `output.extra_fields["prompt_ids"]` and
`["prompt_logprobs"]` (`[T, max(K, 1)]` nested lists, laid out by `verl_layout`).
`ProctorTeacherClient` is such a client, answering from a proctor server instead of an
in-cluster vLLM replica, so verl's own padding, batching and losses run unchanged on
`teacher_ids` / `teacher_logprobs`. With `hidden_states: true` it adds
`extra_fields["teacher_hidden_states"]` ([T, H], verl's rows) and `["teacher_key"]`, and
`teacher_unembeddings` fetches each teacher's `[V, H]` unembedding once.

The rest builds those clients from verl's config (`make_teacher_clients`, from
`distillation.teacher_models` and a top-level `proctor:` block) and hands them to verl: as its
teacher manager (`ProctorTeacherModelManager`, what `verl_patch` makes verl build) or its
agent-loop manager (`ProctorAgentLoopManager[TQ]`, for
`actor_rollout_ref.rollout.agent.agent_loop_manager_class`). verl is imported only inside the
functions that need it, so that this module loads where verl is not installed.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from proctor.client import Media, TeacherClient
from proctor.client.loss.settings import config_value
from proctor.trainer_adapter.verl_layout import verl_hidden_rows, verl_rows

DEFAULT_TOKEN_ENV = "PROCTOR_AUTH_TOKEN"

# The prompt/response split of the sequence verl's agent loop is having scored: verl's teacher call
# (`compute_teacher_logprobs_single` → `generate(prompt_ids=prompt + response)`) passes the whole
# sequence only, so `patch_verl` sets this around `AgentLoopWorker._compute_teacher_logprobs`, which
# knows both parts, and `generate` sends the prompt's length: the server then computes no prompt
# rows into outputs, and reuse keys on the prompt (it finds shared prefixes without it too).
SEQUENCE_SPLIT: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "proctor_sequence_split", default=None)


def prompt_length_of(sequence_length: int) -> int | None:
    """The prompt length verl's agent loop gave for a sequence of this length (None: unknown, or
    another sequence's split)."""
    split = SEQUENCE_SPLIT.get()
    if split is None:
        return None
    prompt, total = split
    return prompt if total == sequence_length and 0 < prompt < total else None


@dataclass
class VerlTokenOutput:
    """Stand-in for `verl.workers.rollout.replica.TokenOutput` when verl is not importable."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    stop_reason: str | None = "completed"
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _token_output(extra_fields: dict[str, Any]) -> Any:
    """verl's own TokenOutput where verl imports (its agent loop reads that type), else the stand-in."""
    try:
        from verl.workers.rollout.replica import TokenOutput
    except ImportError:
        return VerlTokenOutput(extra_fields=extra_fields)
    return TokenOutput(token_ids=[], extra_fields=extra_fields, stop_reason="completed")


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "audio/wav"), (b"fLaC", "audio/flac"), (b"ID3", "audio/mpeg"), (b"\x93NUMPY", "application/x-npy"))


def _npy(array: Any) -> bytes:
    """A decoded array as .npy bytes: lossless, dtype and shape kept, no pickle for the server to trust."""
    import numpy as np

    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def media_item(item: Any, kind: str) -> Media:
    """One verl media item (PIL image, array/tensor, encoded bytes, (array, rate) audio) as
    bytes plus a media type; decoded arrays travel as .npy (application/x-npy)."""
    if isinstance(item, Media):
        return item
    if isinstance(item, (bytes, bytearray)):
        media_type = next((t for magic, t in _MAGIC if bytes(item[: len(magic)]) == magic), None)
        if media_type is None:
            raise ValueError(f"{kind}: cannot tell the media type of {len(item)} raw bytes; pass proctor Media")
        return Media(bytes(item), media_type)
    if hasattr(item, "save") and hasattr(item, "mode"):  # PIL.Image
        buffer = io.BytesIO()
        item.save(buffer, format="PNG")
        return Media(buffer.getvalue(), "image/png")
    if isinstance(item, tuple) and len(item) == 2 and not isinstance(item[1], str):  # (waveform, rate)
        return Media(_npy(item[0]), f"application/x-npy; rate={int(item[1])}")  # the rate travels too
    if hasattr(item, "shape"):
        return Media(_npy(item), "application/x-npy")
    raise ValueError(f"{kind}: unsupported media item of type {type(item).__name__}")


class ProctorTeacherClient:
    """verl's teacher-client interface (`LLMServerClient.generate`) served by proctor.

    Picklable (verl ships it to Ray agent-loop workers): the connection is opened lazily in
    the worker, once per event loop. `teacher_key` is the key sent to the proctor server
    (None: the server's only teacher).
    """

    def __init__(
        self,
        target: str,
        *,
        teacher_key: str | None = None,
        token: str | None = None,
        token_env: str = DEFAULT_TOKEN_ENV,
        max_concurrency: int = 64,
        timeout: float | None = 600.0,
        hidden_states: bool = False,
    ) -> None:
        self.target = target
        self.teacher_key = teacher_key
        self._token = token
        self.token_env = token_env
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.hidden_states = hidden_states
        self._clients: dict[int, TeacherClient] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the open clients: their channels belong to this process's event loops."""
        state = dict(self.__dict__)
        state["_clients"] = {}
        return state

    def client(self) -> TeacherClient:
        """This event loop's TeacherClient (grpc.aio channels belong to one loop)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None:
            token = self._token or os.environ.get(self.token_env) or None
            client = TeacherClient(self.target, token=token, max_concurrency=self.max_concurrency,
                                   timeout=self.timeout)
            self._clients[id(loop)] = client
        return client

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        image_data: Sequence[Any] | None = None,
        video_data: Sequence[Any] | None = None,
        audio_data: Sequence[Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Score `prompt_ids` (verl's whole prompt + response) and answer as verl's vLLM
        teacher would: `extra_fields["prompt_ids"/"prompt_logprobs"]`, [T, max(K, 1)]. Where verl's
        agent loop said where the prompt ends (`SEQUENCE_SPLIT`), only the response rows and the
        last prompt token's are scored; the prompt rows before it are zeros, which verl masks."""
        topk = sampling_params.get("prompt_logprobs")
        if topk is None:
            raise ValueError("proctor answers teacher requests only: sampling_params needs 'prompt_logprobs'")
        scores = await self.client().score(
            prompt_ids,
            teacher_key=self.teacher_key,
            prompt_length=prompt_length_of(len(prompt_ids)),
            logprobs=True,
            topk=int(topk),
            hidden_states=self.hidden_states,
            images=[media_item(x, "images") for x in image_data or ()],
            videos=[media_item(x, "videos") for x in video_data or ()],
            audios=[media_item(x, "audios") for x in audio_data or ()],
            mm_processor_kwargs=mm_processor_kwargs,
            request_id=str(request_id),
        )
        ids, logprobs = verl_rows(scores, prompt_ids, topk=int(topk))
        extra: dict[str, Any] = {"prompt_ids": ids.tolist(), "prompt_logprobs": logprobs.tolist()}
        if self.hidden_states:
            extra["teacher_hidden_states"] = verl_hidden_rows(scores)
            extra["teacher_key"] = scores.teacher
        return _token_output(extra)

    async def unembedding(self) -> torch.Tensor:
        """This teacher's `[V, H]` unembedding (needs a gRPC target)."""
        return await self.client().unembedding(self.teacher_key)

    async def close(self) -> None:
        """Close every event loop's client (each owns channels that outlive a dropped reference)."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


def proctor_serves_teachers(config: Any) -> bool:
    """Whether this verl config's teachers are proctor's (a `proctor.target` is set)."""
    return bool(config_value(config_value(config, "proctor"), "target"))


def verl_teacher_keys(config: Any) -> list[str]:
    """The routing keys verl gives its teachers, resolved as
    `DistillationConfig._resolve_teacher_models` does: one `teacher_model` entry → "default",
    several → each entry's `key`, the `teacher_model` placeholder dropped."""
    models = config_value(config_value(config, "distillation"), "teacher_models") or {}
    names = list(models.keys())
    if names == ["teacher_model"]:
        return ["default"]
    keys = []
    for name in names:
        if name == "teacher_model" and len(names) > 1:
            continue
        key = config_value(models[name], "key")
        if not key:
            raise ValueError(f"distillation.teacher_models.{name}.key must be set with several teachers")
        keys.append(str(key))
    return keys


def make_teacher_clients(config: Any) -> dict[str, ProctorTeacherClient]:
    """verl's `teacher_client` dict, served by the proctor server of the `proctor:` block.

    `proctor.target` (grpc://host:port | http://host:port), optional `token_env`,
    `max_concurrency`, `timeout`, `hidden_states`, and `teachers` (verl key → proctor teacher
    key; by default the verl key itself, and the server's only teacher for verl's "default").
    """
    block = config_value(config, "proctor")
    target = config_value(block, "target")
    if not target:
        raise ValueError("set proctor.target (e.g. +proctor.target=grpc://teacher-host:50051) to use proctor teachers")
    mapping = dict(config_value(block, "teachers") or {})
    options = {
        "token_env": config_value(block, "token_env", DEFAULT_TOKEN_ENV),
        "max_concurrency": int(config_value(block, "max_concurrency", 64)),
        "timeout": config_value(block, "timeout", 600.0),
        "hidden_states": bool(config_value(block, "hidden_states", False)),
    }
    clients = {}
    for key in verl_teacher_keys(config):
        proctor_key = mapping.get(key, None if key == "default" else key)
        clients[key] = ProctorTeacherClient(str(target), teacher_key=proctor_key, **options)
    return clients


async def teacher_unembeddings(clients: Mapping[str, ProctorTeacherClient]) -> dict[str, torch.Tensor]:
    """Each teacher's `[V, H]` unembedding (fetched once per client and fingerprint-checked)."""
    weights = await asyncio.gather(*(c.unembedding() for c in clients.values()))
    return dict(zip(clients.keys(), weights, strict=True))


class ProctorTeacherModelManager:
    """Drop-in for `verl.experimental.teacher_loop.MultiTeacherModelManager(config,
    resource_pool)`: same `get_client()`, but it starts no teacher replicas."""

    def __init__(self, config: Any, resource_pool: Any = None) -> None:
        self.config = config
        self.resource_pool = resource_pool
        self._clients = make_teacher_clients(config)
        self.server_addresses = {key: [c.target] for key, c in self._clients.items()}

    def get_client(self) -> dict[str, ProctorTeacherClient]:
        """A copy of the teacher-client dict, as verl's manager hands one to each caller."""
        return dict(self._clients)


def _with_proctor_teachers(base: type) -> type:
    """A subclass of verl's agent-loop manager `base` (kept a subclass so verl's checks hold)."""

    class Manager(base):
        """verl's agent-loop manager with proctor teacher clients in place of in-cluster ones."""

        def __init__(self, *args: Any, teacher_client: Any = None, **kwargs: Any) -> None:
            config = kwargs.get("config", args[0] if args else None)
            super().__init__(*args, teacher_client=make_teacher_clients(config), **kwargs)

    Manager.__name__ = Manager.__qualname__ = f"Proctor{base.__name__}"
    return Manager


def __getattr__(name: str) -> type:
    """`ProctorAgentLoopManager` / `ProctorAgentLoopManagerTQ`, built on first use so that
    importing this module does not import verl."""
    if name == "ProctorAgentLoopManager":
        from verl.experimental.agent_loop import AgentLoopManager

        cls = _with_proctor_teachers(AgentLoopManager)
    elif name == "ProctorAgentLoopManagerTQ":
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ

        cls = _with_proctor_teachers(AgentLoopManagerTQ)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls
    return cls

