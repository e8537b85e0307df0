"""verl integration: proctor teachers behind the interface verl's agent loop calls.

verl 0.9's agent loop scores each finished sequence through
`verl.experimental.teacher_loop.teacher_manager.AsyncTeacherLLMServerManager`, which holds
one client per teacher key (`dict[str, LLMServerClient]`) and awaits
`client.generate(request_id, prompt_ids=..., sampling_params={"max_tokens": 1,
"prompt_logprobs": K, ...}, image_data=..., video_data=..., audio_data=...,
mm_processor_kwargs=...)`, reading `output.extra_fields["prompt_ids"]` and
`["prompt_logprobs"]` (`[T, max(K, 1)]` nested lists in verl's row convention, laid out by
`verl/workers/rollout/vllm_rollout/utils.py::extract_prompt_logprobs`). `ProctorTeacherClient`
is such a client, answering from a proctor server instead of an in-cluster vLLM replica, so
verl's own padding, batching and losses run unchanged on `teacher_ids` / `teacher_logprobs`.

For the full-vocabulary losses, `hidden_states: true` adds `extra_fields
["teacher_hidden_states"]` ([T, H], verl's rows) and `["teacher_key"]`, and
`teacher_unembeddings` fetches each teacher's `[V, H]` unembedding once.

Wiring (see trainer_adapter/README.md): `make_teacher_clients(config)` builds the dict from
verl's `distillation.teacher_models` and a top-level `proctor:` block;
`ProctorAgentLoopManager` (for `actor_rollout_ref.rollout.agent.agent_loop_manager_class`)
hands that dict to verl's AgentLoopManager in place of the in-cluster clients.
This module imports verl only inside the functions that need it.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from proctor.client import Media, TeacherClient, TeacherScores

DEFAULT_TOKEN_ENV = "PROCTOR_AUTH_TOKEN"


@dataclass
class VerlTokenOutput:
    """Stand-in for `verl.workers.rollout.replica.TokenOutput` when verl is not importable."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    stop_reason: str | None = "completed"
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _token_output(extra_fields: dict[str, Any]):
    try:
        from verl.workers.rollout.replica import TokenOutput
    except ImportError:
        return VerlTokenOutput(extra_fields=extra_fields)
    return TokenOutput(token_ids=[], extra_fields=extra_fields, stop_reason="completed")


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "audio/wav"), (b"fLaC", "audio/flac"), (b"ID3", "audio/mpeg"), (b"\x93NUMPY", "application/x-npy"))


def _npy(array: Any) -> bytes:
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


# ------------------------------------------------------------------------------------------
# verl's row layout
#
# Proctor's rows: row i is about token i given tokens 0..i-1, rows first_row..T-1 sent.
# verl's rows (`verl/experimental/teacher_loop/teacher_manager.py`, fed by
# `verl/workers/rollout/vllm_rollout/utils.py::extract_prompt_logprobs`): one row per token,
# row i is the distribution that predicts token i+1 (the logits at position i), the last row a
# dummy of zeros; `_pad_teacher_outputs` then left-pads the prompt part to the batch's prompt
# width and right-pads the response part to its response width (ids with the pad token,
# log-probs with 0.0), and the agent loop concatenates sequences into
# `teacher_ids` / `teacher_logprobs` of shape [B, prompt_width + response_width, K]. With
# `topk = 0` (sampled-token losses) K is 1 and row i holds token i+1 and its log-prob.
# ------------------------------------------------------------------------------------------


def verl_rows(
    scores: TeacherScores, token_ids: Sequence[int] | torch.Tensor, *, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in verl's unpadded layout: (ids int32 [T, K'], log-probs float32 [T, K']).

    K' = topk, or 1 with topk = 0 (then ids are the sequence's own next tokens). Rows the
    server did not send (before first_row - 1, i.e. inside the prompt) and the last row are
    zeros, as verl's dummy row; trainers only read rows from the last prompt token on.
    """
    tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    total = tokens.shape[0]
    if scores.num_tokens != total:
        raise ValueError(f"scores cover {scores.num_tokens} tokens but token_ids has {total}")
    width = topk if topk > 0 else 1
    ids = torch.zeros((total, width), dtype=torch.int32)
    logprobs = torch.zeros((total, width), dtype=torch.float32)
    rows = slice(scores.first_row - 1, total - 1)  # verl row i = proctor row i + 1
    if topk > 0:
        if scores.topk_ids is None or scores.topk_ids.shape[1] < topk:
            have = None if scores.topk_ids is None else scores.topk_ids.shape[1]
            raise ValueError(f"verl asks for top-{topk} but the scores carry top-{have}; score with topk={topk}")
        ids[rows] = scores.topk_ids[:, :topk].to(torch.int32)
        logprobs[rows] = scores.topk_logprobs[:, :topk].float()
    else:
        if scores.logprobs is None:
            raise ValueError("sampled-token rows need the teacher's logprobs; score with logprobs=True")
        ids[rows, 0] = tokens[scores.first_row :].to(torch.int32)
        logprobs[rows, 0] = scores.logprobs.float()
    return ids, logprobs


def pad_verl_rows(
    rows: torch.Tensor,
    *,
    prompt_length: int,
    prompt_width: int,
    response_width: int,
    value: float | int,
) -> torch.Tensor:
    """[T, K'] → [1, prompt_width + response_width, K']: prompt left-padded, response right-padded."""
    total = rows.shape[0]
    response_length = total - prompt_length
    if not 0 < prompt_length <= prompt_width or not 0 <= response_length <= response_width:
        raise ValueError(
            f"a sequence of {prompt_length} prompt + {response_length} response tokens does not fit "
            f"widths {prompt_width} + {response_width}"
        )
    out = torch.full((prompt_width + response_width, *rows.shape[1:]), value, dtype=rows.dtype)
    out[prompt_width - prompt_length : prompt_width + response_length] = rows
    return out.unsqueeze(0)


def verl_teacher_batch(
    scores: Sequence[TeacherScores],
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    prompt_lengths: Sequence[int],
    *,
    prompt_width: int,
    response_width: int,
    topk: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """`teacher_ids` int32 and `teacher_logprobs` float32, both [B, prompt_width + response_width, K'].

    What verl's agent loop assembles from `ProctorTeacherClient` answers, for trainers that
    batch verl-style outside that loop (the README's trainer-side API); equal to verl's own
    padding and concatenation (tests/test_verl_adapter.py).
    """
    if not len(scores) == len(token_ids) == len(prompt_lengths):
        raise ValueError("scores, token_ids and prompt_lengths must have one entry per sequence")
    ids_out, lps_out = [], []
    for score, tokens, prompt_length in zip(scores, token_ids, prompt_lengths, strict=True):
        ids, lps = verl_rows(score, tokens, topk=topk)
        layout = {"prompt_length": prompt_length, "prompt_width": prompt_width, "response_width": response_width}
        ids_out.append(pad_verl_rows(ids, value=pad_token_id, **layout))
        lps_out.append(pad_verl_rows(lps, value=0.0, **layout))
    return {"teacher_ids": torch.cat(ids_out, dim=0), "teacher_logprobs": torch.cat(lps_out, dim=0)}


def verl_hidden_rows(scores: TeacherScores) -> torch.Tensor:
    """Hidden states [T, H] in verl's row convention: row i produced the prediction of token
    i+1 (the activation at position i); rows the server did not send and the last are zeros."""
    if scores.hidden_states is None:
        raise ValueError("no hidden states in these scores; score with hidden_states=True")
    hidden = scores.hidden_states
    out = torch.zeros((scores.num_tokens, hidden.shape[1]), dtype=hidden.dtype)
    out[scores.first_row - 1 : scores.num_tokens - 1] = hidden
    return out


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
    ):
        """Score `prompt_ids` (verl's whole prompt + response) and answer as verl's vLLM
        teacher would: `extra_fields["prompt_ids"/"prompt_logprobs"]`, [T, max(K, 1)]."""
        topk = sampling_params.get("prompt_logprobs")
        if topk is None:
            raise ValueError("proctor answers teacher requests only: sampling_params needs 'prompt_logprobs'")
        scores = await self.client().score(
            prompt_ids,
            teacher_key=self.teacher_key,
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
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, Mapping) or hasattr(node, "keys"):
        try:
            return node.get(key, default)
        except (AttributeError, TypeError):
            return default
    return getattr(node, key, default)


def verl_teacher_keys(config: Any) -> list[str]:
    """The routing keys verl gives its teachers, resolved as
    `DistillationConfig._resolve_teacher_models` does: one `teacher_model` entry → "default",
    several → each entry's `key`, the `teacher_model` placeholder dropped."""
    models = _get(_get(config, "distillation"), "teacher_models") or {}
    names = list(models.keys())
    if names == ["teacher_model"]:
        return ["default"]
    keys = []
    for name in names:
        if name == "teacher_model" and len(names) > 1:
            continue
        key = _get(models[name], "key")
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
    block = _get(config, "proctor")
    target = _get(block, "target")
    if not target:
        raise ValueError("set proctor.target (e.g. +proctor.target=grpc://teacher-host:50051) to use proctor teachers")
    mapping = dict(_get(block, "teachers") or {})
    options = {
        "token_env": _get(block, "token_env", DEFAULT_TOKEN_ENV),
        "max_concurrency": int(_get(block, "max_concurrency", 64)),
        "timeout": _get(block, "timeout", 600.0),
        "hidden_states": bool(_get(block, "hidden_states", False)),
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
        return dict(self._clients)


def _with_proctor_teachers(base: type) -> type:
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


# ------------------------------------------------------------------------------------------
# verl without a teacher pool
#
# verl 0.9 builds in-cluster teachers whenever `distillation.enabled` is true: its resource-pool
# setup (v1 `PPOTrainer._init_resource_pool_mgr`, v0 `BaseTaskRunner.init_resource_pool_mgr` /
# `add_teacher_model_resource_pool`, the fully-async rollouter's `_create_teacher_model_manager`)
# asks for `distillation.n_gpus_per_node × nnodes` devices and refuses 0, and the trainers start
# a `MultiTeacherModelManager` on them. `patch_verl()` changes exactly that for a config whose
# teachers proctor serves (a `proctor.target`): no teacher pool is requested (0 / 0 accepted),
# and the manager verl builds is `ProctorTeacherModelManager`, whose `get_client()` hands verl's
# trainers and agent loops proctor's clients. Configs without `proctor.target` run as verl
# runs them. It also teaches verl's distillation loss the top-k modes it lacks.
# ------------------------------------------------------------------------------------------

_PATCH_LOCK = threading.Lock()
# Held while a pool setup runs with `is_distillation_enabled` swapped (one at a time per module).
_SWAP_LOCK = threading.Lock()


def proctor_serves_teachers(config: Any) -> bool:
    """Whether this verl config's teachers are proctor's (a `proctor.target` is set)."""
    return bool(_get(_get(config, "proctor"), "target"))


def _teacher_manager_class(verl_manager: type) -> type:
    """verl's MultiTeacherModelManager that becomes a ProctorTeacherModelManager for proctor configs."""

    class MultiTeacherModelManager(verl_manager):  # a subclass, so verl's isinstance checks still hold
        __proctor__ = True

        def __new__(cls, *args: Any, **kwargs: Any):
            config = kwargs.get("config", args[0] if args else None)
            if proctor_serves_teachers(config):
                return ProctorTeacherModelManager(config, kwargs.get("resource_pool"))
            return super().__new__(cls)

    MultiTeacherModelManager.__qualname__ = verl_manager.__qualname__
    MultiTeacherModelManager.__module__ = verl_manager.__module__
    return MultiTeacherModelManager


def _without_teacher_pool(method: Any, module: Any, config_of: Any) -> Any:
    """`method` run, for proctor configs, with its module's `is_distillation_enabled` answering
    False: verl's pool setup then asks for no teacher pool and checks no teacher device count,
    while everything else it sets up (actor, critic, reward pools) is verl's own code."""

    def run(*args: Any, **kwargs: Any):
        if not proctor_serves_teachers(config_of(*args, **kwargs)):
            return method(*args, **kwargs)
        with _SWAP_LOCK:
            enabled = module.is_distillation_enabled
            module.is_distillation_enabled = lambda config: False
            try:
                return method(*args, **kwargs)
            finally:
                module.is_distillation_enabled = enabled

    run.__proctor__ = True  # type: ignore[attr-defined]
    run.__wrapped__ = method  # type: ignore[attr-defined]
    run.__name__ = method.__name__
    return run


def _patched(owner: Any, name: str) -> bool:
    return getattr(getattr(owner, name, None), "__proctor__", False)


def _patch_teacher_managers() -> None:
    import verl.experimental.teacher_loop as teacher_loop
    import verl.experimental.teacher_loop.teacher_model as teacher_model

    if not _patched(teacher_loop, "MultiTeacherModelManager"):
        manager = _teacher_manager_class(teacher_model.MultiTeacherModelManager)
        teacher_loop.MultiTeacherModelManager = teacher_model.MultiTeacherModelManager = manager
    try:
        import verl.trainer.ppo.v1.trainer_base as trainer_base  # imported the manager by name
    except ImportError:  # the v1 trainer's dependencies (transfer_queue) are absent: nothing to patch
        return
    trainer_base.MultiTeacherModelManager = teacher_loop.MultiTeacherModelManager


def _patch_resource_pools() -> None:
    from verl.single_controller.ray import ResourcePoolManager
    from verl.trainer.ppo.utils import Role

    if not _patched(ResourcePoolManager, "get_resource_pool"):
        verl_get = ResourcePoolManager.get_resource_pool

        def get_resource_pool(self, role):
            """verl's, but None for a teacher that has no pool (proctor serves it)."""
            if role == Role.TeacherModel and role not in self.mapping:
                return None
            return verl_get(self, role)

        get_resource_pool.__proctor__ = True  # type: ignore[attr-defined]
        ResourcePoolManager.get_resource_pool = get_resource_pool
    try:
        import verl.trainer.main_ppo_v0 as v0
        import verl.trainer.ppo.v1.trainer_base as v1
    except ImportError:  # a trainer whose dependencies are absent cannot run either
        return
    if not _patched(v1.PPOTrainer, "_init_resource_pool_mgr"):
        v1.PPOTrainer._init_resource_pool_mgr = _without_teacher_pool(
            v1.PPOTrainer._init_resource_pool_mgr, v1, lambda self: self.config)
    for name in ("init_resource_pool_mgr", "add_teacher_model_resource_pool"):
        if not _patched(v0.BaseTaskRunner, name):
            setattr(v0.BaseTaskRunner, name, _without_teacher_pool(
                getattr(v0.BaseTaskRunner, name), v0, lambda self, config: config))


def _patch_fully_async_rollouter() -> None:
    try:
        from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter as actor
    except ImportError:
        return
    # a Ray actor class: the class its actors are made of is what Ray workers import and run
    FullyAsyncRollouter = getattr(actor, "__ray_actor_class__", actor)
    if _patched(FullyAsyncRollouter, "_create_teacher_model_manager"):
        return
    verl_create = FullyAsyncRollouter._create_teacher_model_manager

    async def _create_teacher_model_manager(self) -> None:
        """verl's, but proctor's clients and no teacher pool when proctor serves the teachers."""
        if not proctor_serves_teachers(self.config):
            return await verl_create(self)
        self.teacher_model_manager = ProctorTeacherModelManager(self.config)

    _create_teacher_model_manager.__proctor__ = True  # type: ignore[attr-defined]
    FullyAsyncRollouter._create_teacher_model_manager = _create_teacher_model_manager


def _patch_losses() -> None:
    import verl.trainer.distillation.losses as losses

    from proctor.trainer_adapter.verl_losses import VERL_EXTRA_TOPK_MODES, with_proctor_topk_modes

    if not _patched(losses, "compute_topk_loss"):
        losses.compute_topk_loss = with_proctor_topk_modes(losses.compute_topk_loss)
    missing = [mode for mode in VERL_EXTRA_TOPK_MODES if mode not in losses.DISTILLATION_LOSS_REGISTRY]
    if missing:  # the logits processor computed them; verl's top-k loss function turns them into metrics
        settings = losses.DistillationLossSettings(names=missing, use_topk=True)
        losses.register_distillation_loss(settings)(losses.compute_forward_kl_topk)


def _check_verl_version() -> None:
    """Refuse a verl release this adapter was not tested against (it replaces verl internals):
    one line naming the installed and the supported release (pyproject's `verl` extra). Without
    verl there is nothing to patch and nothing to check."""
    from proctor.proto.versions import check_versions, installed

    if installed("verl") is not None:
        check_versions(["verl"], needed_by="proctor.trainer_adapter.patch_verl")


def patch_verl() -> None:
    """Make verl 0.9 run with proctor teachers and proctor's top-k losses; idempotent.

    Safe in every process of a verl job (the entrypoint runs it in the driver, its TaskRunner
    and, through Ray's `worker_process_setup_hook`, every Ray worker): each piece checks whether
    it is already in place, and a trainer whose dependencies are absent is left alone.
    """
    _check_verl_version()
    with _PATCH_LOCK:
        _patch_teacher_managers()
        _patch_resource_pools()
        _patch_fully_async_rollouter()
        _patch_losses()
