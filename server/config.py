"""Server configuration: verl's `distillation:` block as-is, plus proctor's `server:` block.

A user's verl (or verl-omni) YAML is the source of truth for the teachers, so it is read
as verl reads it: same field names, same defaults (those of verl's
`trainer/config/distillation/distillation.yaml`, which is what a verl run gets), Hydra
`+key` overrides written into the YAML (the `+` is stripped, dotted keys are expanded), and
`${oc.select:...}` interpolations resolved against the same document. What verl leaves
implicit becomes an explicit message here: unknown keys are reported (with the nearest known
name), the default `teacher_model` entry that verl silently drops when other teachers are
added is an error that says what to rename, and the pool sizes are checked by
`proctor.server.pool` with the numbers and the teacher to change.

Every problem is collected before anything is reported, so `proctor check-config` lists
them all at once rather than one per run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proctor.proto.loss_modes import HIDDEN_STATE_MODES, LOSS_MODES, TOPK_MODES, VERL_LOSS_DEFAULTS
from proctor.server.engines import EngineConfigError, EngineSpec
from proctor.server.engines.checks import check_model_path
from proctor.server.pool import PlacementError, PlacementPlan, ReplicaGroupPlan, TeacherDemand, plan_placement

if typing.TYPE_CHECKING:
    from proctor.server.routing import Router
    from proctor.server.runtime import ServerOptions

DEFAULT_TEACHER = "teacher_model"  # the entry verl's distillation.yaml ships in teacher_models


class ConfigError(ValueError):
    """The configuration cannot be served; `problems` lists every reason, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


# ------------------------------------------------------------------------------------------
# The schema
# ------------------------------------------------------------------------------------------


class _Block(BaseModel):
    """A config block: declared fields are validated; `accepted` keys pass through unchecked.

    Any other key is reported by `_unknown_keys` (with the nearest known name), so a typo such
    as `tensor_model_parallel_sise` never silently falls back to a default.
    """

    model_config = ConfigDict(extra="allow", validate_default=True)
    accepted: ClassVar[frozenset[str]] = frozenset({"_target_"})


# verl's RolloutConfig fields (verl/workers/config/rollout.py): a teacher's `inference` block is a
# RolloutConfig, so any of them may appear; engines read those that apply to them.
_VERL_ROLLOUT_FIELDS = frozenset(
    """_target_ mode nnodes n_gpus_per_node temperature top_k top_p do_sample n repetition_penalty
    full_determinism seed over_sample_rate ignore_eos standalone_gpu_memory_utilization enforce_eager
    cudagraph_capture_sizes free_cache_engine expert_parallel_size moe_tensor_parallel_size logprobs_mode
    scheduling_policy val_kwargs max_num_seqs log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu disable_log_stats multi_stage_wake_up
    calculate_log_probs agent trace multi_turn server prometheus custom checkpoint_manager_class
    checkpoint_engine profiler enable_prefix_caching load_format layered_summon layer_name_map
    sglang_engine_mode limit_images skip_tokenizer_init quantization quantization_config_file
    enable_rollout_routing_replay moe_load_balance_metrics_interval enable_sleep_mode mtp qat
    disaggregation""".split()  # noqa: SIM905  (a word list reads better than 56 quoted names)
)


class InferenceConfig(_Block):
    """`teacher_models.<name>.inference`: verl's RolloutConfig, the fields proctor acts on declared."""

    accepted: ClassVar[frozenset[str]] = _VERL_ROLLOUT_FIELDS

    name: str | None = None  # None: "torch" on CPU, "vllm" on accelerators
    dtype: str | None = None  # None: the checkpoint's own dtype
    tensor_model_parallel_size: int = Field(2, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    # None: verl's 0.5 on accelerators; on CPU the engine's own default (see vllm_common).
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=2)
    prompt_length: int = Field(512, ge=1)
    response_length: int = Field(512, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    enable_chunked_prefill: bool = True
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # proctor's: whether the teacher serves hidden states (None: when the loss needs them, or
    # lazily on first use for a vLLM teacher), and how long a replica may take to start.
    hidden_states: bool | None = None
    startup_timeout_s: float = Field(1800.0, gt=0)

    @property
    def per_replica(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


class TeacherModelConfig(_Block):
    """`teacher_models.<name>`: verl's DistillationTeacherModelConfig."""

    # Older verl teacher entries carried their own pool keys; verl-omni adds nitrobrew_d_comp.
    accepted: ClassVar[frozenset[str]] = frozenset(
        {"_target_", "nitrobrew_d_comp", "task", "enable_resource_pool", "n_gpus_per_node", "nnodes"}
    )

    key: str | None = None
    model_path: str | None = None
    num_replicas: int | None = Field(0, ge=0)  # 0 / null: size automatically (see pool.py)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)


class DistillationLossConfig(_Block):
    """`distillation_loss`: the trainer's loss; the server reads topk and what the loss needs."""

    accepted: ClassVar[frozenset[str]] = frozenset(
        {
            "_target_", "global_batch_info", "loss_settings",  # verl runtime fields
            "kd_temperature", "jsd_beta", "use_policy_loss",  # verl-omni / older verl
            "loss_agg_mode", "chunk_tokens", "chunk_vocab", "pg_ratio", "gkd_ratio",  # proctor client
        }
    )  # fmt: skip

    loss_mode: Literal[LOSS_MODES] = VERL_LOSS_DEFAULTS["loss_mode"]  # type: ignore[valid-type]
    topk: int | None = Field(VERL_LOSS_DEFAULTS["topk"], ge=1)
    use_task_rewards: bool = VERL_LOSS_DEFAULTS["use_task_rewards"]
    distillation_loss_coef: float = VERL_LOSS_DEFAULTS["distillation_loss_coef"]
    loss_max_clamp: float | None = VERL_LOSS_DEFAULTS["loss_max_clamp"]
    log_prob_min_clamp: float | None = VERL_LOSS_DEFAULTS["log_prob_min_clamp"]
    use_policy_gradient: bool = VERL_LOSS_DEFAULTS["use_policy_gradient"]
    policy_loss_mode: str = VERL_LOSS_DEFAULTS["policy_loss_mode"]
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    use_chunked_topk: bool = False
    chunked_topk_chunk_size: int = 4096

    # The loss families live in proctor.proto, shared with the client's loss library.
    @property
    def needs_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES

    @property
    def needs_hidden_states(self) -> bool:
        return self.loss_mode in HIDDEN_STATE_MODES


class DistillationConfig(_Block):
    """verl's `distillation:` block (DistillationConfig), with verl's YAML defaults."""

    accepted: ClassVar[frozenset[str]] = frozenset({"_target_", "defaults", "enable_resource_pool"})

    enabled: bool = False
    n_gpus_per_node: int = Field(8, ge=0)
    nnodes: int = Field(0, ge=0)
    teacher_key: str = "data_source"
    teacher_models: dict[str, TeacherModelConfig] = Field(default_factory=dict)
    distillation_loss: DistillationLossConfig = Field(default_factory=DistillationLossConfig)


class TlsConfig(_Block):
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None  # set: clients must present a certificate it signed


class RayConfig(_Block):
    """Replicas as Ray actors on placement groups (several machines); off: in-process replicas."""

    enabled: bool = False
    address: str = "auto"
    namespace: str = "proctor"
    device_resource: str | None = None  # None: GPU for cuda, NPU for npu, none for cpu
    cpus_per_replica: float = Field(1.0, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)


class ServerBlock(_Block):
    """proctor's own `server:` block."""

    host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535)
    auth_token_file: str | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)
    max_queue_requests: int = Field(1024, ge=1)
    max_queue_tokens: int = Field(8_000_000, ge=1)
    request_timeout_s: float | None = Field(None, gt=0)
    drain_grace_s: float = Field(30.0, ge=0)
    max_message_bytes: int = Field(64 << 20, ge=1 << 20)
    stream_chunk_bytes: int = Field(2 << 20, ge=1 << 10)
    # Paths of the HTTP port that need no bearer token (probes and scrapers).
    open_paths: list[str] = Field(default_factory=lambda: ["/health/live", "/health/ready", "/metrics"])
    metrics_port: int | None = Field(None, ge=0, le=65535)
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    routing_policy: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    health_check_interval_s: float | None = Field(5.0, gt=0)
    restart_initial_backoff_s: float = Field(0.5, gt=0)
    restart_max_backoff_s: float = Field(30.0, gt=0)
    swap_max_consecutive_batches: int = Field(4, ge=1)
    ray: RayConfig = Field(default_factory=RayConfig)


class ProctorConfig(_Block):
    """The whole file. Other top-level sections of a verl trainer YAML are ignored (and listed)."""

    distillation: DistillationConfig
    server: ServerBlock = Field(default_factory=ServerBlock)


# ------------------------------------------------------------------------------------------
# Reading: Hydra-style keys, interpolations, unknown keys
# ------------------------------------------------------------------------------------------

_OPAQUE = ("engine_kwargs", "global_batch_info", "custom")  # user dicts: keys are not config paths


def normalize(node: Any, *, opaque: bool = False) -> Any:
    """Strip Hydra's `+`/`++` from keys and expand dotted keys (`a.b: 1` -> `a: {b: 1}`)."""
    if isinstance(node, list):
        return [normalize(v, opaque=opaque) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for raw_key, value in node.items():
        key = str(raw_key).lstrip("+") if not opaque else str(raw_key)
        parts = key.split(".") if not opaque else [key]
        value = normalize(value, opaque=opaque or parts[-1] in _OPAQUE)
        for part in reversed(parts[1:]):
            value = {part: value}
        _merge(out, parts[0], value)
    return out


def _merge(target: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(target.get(key), dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(target[key], k, v)
    else:
        target[key] = value


_INTERPOLATION = re.compile(r"^\$\{(?:(oc\.select|oc\.env):)?([^,}]+)(?:,([^}]*))?\}$")
_MISSING = object()


def resolve_interpolations(root: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Resolve whole-value `${a.b}`, `${oc.select:a.b[,default]}` and `${oc.env:VAR[,default]}`.

    An `oc.select` whose path is absent is dropped, so the field takes its default (what verl's
    YAML means when, say, no `actor_rollout_ref.rollout.prompt_length` is around to copy).
    """

    def lookup(path: str) -> Any:
        node: Any = root
        for part in path.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def resolve(value: Any, where: str, depth: int = 0) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                r = resolve(v, f"{where}.{k}" if where else k, depth)
                if r is not _MISSING:
                    out[k] = r
            return out
        if isinstance(value, list):
            return [resolve(v, where, depth) for v in value]
        match = _INTERPOLATION.match(value) if isinstance(value, str) else None
        if match is None:
            return value
        if depth > 8:
            problems.append(f"{where}: interpolation {value!r} is circular")
            return _MISSING
        resolver, path, default = match.groups()
        if resolver == "oc.env":
            found = os.environ.get(path.strip(), _MISSING)
            if found is _MISSING and default is None:
                problems.append(f"{where}: environment variable {path.strip()} is not set (from {value!r})")
        else:
            found = lookup(path)
        if found is _MISSING and default is not None:
            found = yaml.safe_load(default) if default.strip() else None
        if found is _MISSING:
            if resolver is None:
                problems.append(f"{where}: interpolation {value!r} points at nothing in this file")
            return _MISSING
        return resolve(found, where, depth + 1)

    return resolve(root, "")


def _field_model(annotation: Any) -> tuple[str, type[_Block]] | None:
    """("model", M) for a block field, ("dict", M) for dict[str, M], else None."""
    if isinstance(annotation, type) and issubclass(annotation, _Block):
        return "model", annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2:
        inner = _field_model(args[1])
        return ("dict", inner[1]) if inner and inner[0] == "model" else None
    for arg in args:  # Optional[...] / unions
        inner = _field_model(arg)
        if inner is not None:
            return inner
    return None


def _unknown_keys(model: type[_Block], data: Any, path: str) -> list[str]:
    if not isinstance(data, dict):
        return []
    problems = []
    known = set(model.model_fields) | set(model.accepted)
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        field_info = model.model_fields.get(key)
        if field_info is None:
            if key not in model.accepted:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(model.model_fields))})"
                problems.append(f"{where}: unknown key{hint}")
            continue
        sub = _field_model(field_info.annotation)
        if sub is None:
            continue
        kind, sub_model = sub
        if kind == "model":
            problems += _unknown_keys(sub_model, value, where)
        elif isinstance(value, dict):
            for name, item in value.items():
                problems += _unknown_keys(sub_model, item, f"{where}.{name}")
    return problems


def _pydantic_problems(error: ValidationError) -> list[str]:
    out = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        got = item.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        out.append(f"{where}: {item['msg']}{shown}")
    return out


# ------------------------------------------------------------------------------------------
# Resolving: teachers, engines, placement
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedTeacher:
    """A teacher as proctor will serve it: its routing key and one replica's engine spec."""

    name: str
    key: str
    spec: EngineSpec
    per_replica: int


@dataclass
class ServingPlan:
    """What the config resolves to: teachers, placement, server settings, and notes to show."""

    config: ProctorConfig
    device_kind: str
    teachers: dict[str, ResolvedTeacher]
    placement: PlacementPlan
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        server = self.config.server
        mode = f"Ray actors (address {server.ray.address})" if server.ray.enabled else "in-process replicas"
        lines = [
            f"device: {self.device_kind}; replicas: {mode}; routing: {server.routing_policy}",
            f"serving gRPC {server.host}:{server.grpc_port}, HTTP {server.host}:{server.http_port}"
            + (", TLS" if server.tls.cert_file else "")
            + (", token auth" if server.auth_token_file else ""),
            f"routing column: {self.config.distillation.teacher_key}",
        ]
        for t in self.teachers.values():
            lines.append(
                f"teacher {t.name}: key {t.key!r}, engine {t.spec.name}, model {t.spec.model_path}, "
                f"{t.per_replica} device(s) per replica, max top-k {t.spec.max_topk}"
            )
        lines.append(self.placement.summary())
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def detect_device() -> str:
    """The accelerator this machine has: cuda, npu, else cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "npu"
    except ImportError:
        pass
    return "cpu"


def model_architecture(model_path: str) -> str | None:
    """A label for a checkpoint's weight layout (teachers with equal labels can swap weights)."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    volatile = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
    stable = {k: v for k, v in config.items() if k not in volatile}
    digest = hashlib.sha1(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:8]
    shape = "/".join(
        str(config.get(k, "?")) for k in ("num_hidden_layers", "hidden_size", "vocab_size")
    )
    return f"{config.get('model_type', 'model')}[{shape}]#{digest}"


def _engine_problems(
    name: str, engine: str, teacher: TeacherModelConfig, loss: DistillationLossConfig, max_topk: int
) -> list[str]:
    """The engine startup checks (`proctor.server.engines.checks`) that need only the config.

    Each check raises on its own, so they are called one by one to collect every problem; their
    messages name the `inference.*` setting, prefixed here with the teacher's path.
    """
    from proctor.server.engines import EngineConfigError, checks

    inf = teacher.inference
    lengths = (inf.prompt_length, inf.response_length)
    calls: list[Callable[[], object]] = [lambda: checks.check_engine_name(engine)]
    if loss.needs_hidden_states and inf.hidden_states is False:
        calls.append(lambda: checks.refuse(
            f"inference.hidden_states is false, but distillation_loss.loss_mode {loss.loss_mode} needs the "
            "teacher's hidden states: remove the setting or choose a loss that does not"))
    if inf.max_model_len is not None:
        calls.append(lambda: checks.check_max_model_len(inf.max_model_len, *lengths))
    if engine in ("vllm", "vllm_omni"):
        topk = loss.topk if loss.needs_topk and loss.topk else 0
        calls.append(lambda: checks.check_max_logprobs(max_topk, topk, engine=engine))
        # vLLM-Omni serves hidden states from its one AR engine; vLLM from a pooling engine that
        # always runs without chunked prefill and with whole sequences, whatever is set.
        if loss.needs_hidden_states and engine == "vllm_omni":
            calls.append(lambda: checks.check_hidden_states_prefill(inf.enable_chunked_prefill))
            calls.append(lambda: checks.check_batched_tokens(inf.max_num_batched_tokens, *lengths))
    problems = []
    for call in calls:
        try:
            call()
        except EngineConfigError as exc:
            problems.append(f"distillation.teacher_models.{name}.{exc}")
    return problems


VERL_GPU_MEMORY_UTILIZATION = 0.5  # verl's rollout default, what a verl run gives its teachers


def serves_hidden_states(engine: str, inference: InferenceConfig, loss: DistillationLossConfig) -> bool:
    """The one hidden-state decision: `inference.hidden_states` as set; else on where unused
    hidden states cost nothing (torch; vLLM starts its pooling engine on the first request that
    asks), and for vLLM-Omni (whose AR runner copies them out on every request) only when the
    loss needs them."""
    if inference.hidden_states is not None:
        return inference.hidden_states
    return engine != "vllm_omni" or loss.needs_hidden_states


def _engine_name(inference: InferenceConfig, device_kind: str) -> str:
    return inference.name or ("torch" if device_kind == "cpu" else "vllm")


def _max_topk(name: str, inference: InferenceConfig, loss: DistillationLossConfig) -> int:
    """Largest top-k a request may ask for: the engine's max_logprobs, else max(64, the loss's topk)."""
    kwargs = inference.engine_kwargs.get(name) or {}
    if kwargs.get("max_logprobs"):
        return int(kwargs["max_logprobs"])
    return max(64, loss.topk or 0)


def _teachers(config: ProctorConfig, device_kind: str, problems: list[str], notes: list[str]) -> dict:
    d = config.distillation
    entries = dict(d.teacher_models)
    if DEFAULT_TEACHER in entries and len(entries) > 1:
        default = entries[DEFAULT_TEACHER]
        others = ", ".join(n for n in entries if n != DEFAULT_TEACHER)
        if default.model_path or default.key:
            problems.append(
                f"distillation.teacher_models.{DEFAULT_TEACHER}: verl silently drops this default entry when "
                f"other teachers ({others}) are added, so its model would never be used: rename it, e.g. "
                f"`+distillation.teacher_models.{DEFAULT_TEACHER}1.*` (or teacher_models.<domain>)"
            )
        else:  # verl's untouched default: dropping it is what the user meant
            notes.append(f"teacher_models.{DEFAULT_TEACHER} has no model_path: ignored, as verl does")
            del entries[DEFAULT_TEACHER]
    if not entries:
        problems.append("distillation.teacher_models: no teacher configured (set teacher_models.<name>.model_path)")
    resolved: dict[str, ResolvedTeacher] = {}
    keys: dict[str, str] = {}
    for name, teacher in entries.items():
        where = f"distillation.teacher_models.{name}"
        if not teacher.model_path:
            problems.append(f"{where}.model_path: required (a model directory or Hugging Face id)")
        if len(entries) > 1 and not teacher.key:
            problems.append(
                f"{where}.key: required with several teachers: the value of each sample's "
                f"`{d.teacher_key}` that routes to this teacher (e.g. openai/gsm8k)"
            )
        key = teacher.key or name
        if key in keys:
            problems.append(f"{where}.key: {key!r} is also the key of teacher {keys[key]!r}; keys must differ")
        keys[key] = name
        engine = _engine_name(teacher.inference, device_kind)
        max_topk = _max_topk(engine, teacher.inference, d.distillation_loss)
        problems.extend(_engine_problems(name, engine, teacher, d.distillation_loss, max_topk))
        inference = teacher.inference.model_dump(exclude={"name", "dtype", "hidden_states", "startup_timeout_s"})
        inference.update(teacher.inference.model_extra or {})
        inference.pop("_target_", None)
        if inference.get("gpu_memory_utilization") is None and device_kind != "cpu":
            inference["gpu_memory_utilization"] = VERL_GPU_MEMORY_UTILIZATION
        resolved[name] = ResolvedTeacher(
            name=name,
            key=key,
            spec=EngineSpec(
                name=engine,
                model_path=str(teacher.model_path or ""),
                device=device_kind,
                dtype=teacher.inference.dtype or "auto",
                max_topk=max_topk,
                inference=inference,
                hidden_states=serves_hidden_states(engine, teacher.inference, d.distillation_loss),
                startup_timeout_s=teacher.inference.startup_timeout_s,
            ),
            per_replica=teacher.inference.per_replica,
        )
    return resolved


def resolve_plan(config: ProctorConfig, *, files_must_exist: bool = True) -> ServingPlan:
    """Teachers, engines and placement for a parsed config; ConfigError lists every problem.

    `files_must_exist=False` (check-config, config linting) turns missing token/TLS files into
    notes: the config is often checked on another machine than the one that serves it.
    """
    problems: list[str] = []
    notes: list[str] = []
    server = config.server
    device_kind = detect_device() if server.device == "auto" else server.device
    if server.device == "auto":
        notes.append(f"server.device is auto: {device_kind} on this machine")
    if not config.distillation.enabled:
        notes.append("distillation.enabled is false: verl would not call these teachers; proctor serves them anyway")
    teachers = _teachers(config, device_kind, problems, notes)
    if bool(server.tls.key_file) != bool(server.tls.cert_file):
        problems.append("server.tls: cert_file and key_file go together: set both or neither")
    if server.tls.client_ca_file and not server.tls.cert_file:
        problems.append("server.tls.client_ca_file needs server.tls.cert_file and key_file (mutual TLS is TLS)")
    for t in teachers.values():
        if t.spec.model_path:
            try:
                check_model_path(t.spec.model_path)
            except EngineConfigError as exc:
                (problems if files_must_exist else notes).append(f"distillation.teacher_models.{t.name}.{exc}")
    for label, path in (
        ("server.auth_token_file", server.auth_token_file),
        ("server.tls.cert_file", server.tls.cert_file),
        ("server.tls.key_file", server.tls.key_file),
        ("server.tls.client_ca_file", server.tls.client_ca_file),
    ):
        if path and not Path(path).is_file():
            (problems if files_must_exist else notes).append(f"{label}: {path} is not a readable file here")
    demands = [
        TeacherDemand(
            name=t.name,
            per_replica=t.per_replica,
            num_replicas=config.distillation.teacher_models[t.name].num_replicas or None,
            architecture=model_architecture(t.spec.model_path) if t.spec.model_path else None,
        )
        for t in teachers.values()
    ]
    placement = None
    try:
        placement = plan_placement(
            demands,
            n_gpus_per_node=config.distillation.n_gpus_per_node,
            nnodes=config.distillation.nnodes,
            device_kind=device_kind,
        )
    except PlacementError as exc:
        problems.extend(f"placement: {p}" for p in exc.problems)
    if placement is not None:
        problems.extend(_serving_problems(placement, teachers, server))
    if problems:
        raise ConfigError(problems)
    return ServingPlan(config=config, device_kind=device_kind, teachers=teachers, placement=placement, notes=notes)


def _serving_problems(placement: PlacementPlan, teachers: dict[str, ResolvedTeacher], server: ServerBlock) -> list[str]:
    problems = []
    if not server.ray.enabled and placement.nnodes > 1:
        problems.append(
            f"distillation.nnodes is {placement.nnodes}, but server.ray.enabled is false: in-process replicas "
            "run on this one machine; enable server.ray (and start a Ray cluster) or set nnodes to 1"
        )
    shared = [g for g in placement.groups if g.shared]
    if shared:
        names = shared[0].teachers
        not_torch = [n for n in names if teachers[n].spec.name != "torch"]
        if not_torch:
            problems.append(
                f"teachers {', '.join(names)} must share devices (more teachers than replica slots), but weight "
                f"swapping is implemented for the torch engine only and {', '.join(not_torch)} use(s) another "
                "engine: give every teacher num_replicas and enough devices"
            )
        if server.ray.enabled:
            problems.append(
                f"teachers {', '.join(names)} must share devices (weight swapping), which runs in-process: "
                "set server.ray.enabled to false or give every teacher its own devices"
            )
    return problems


def parse_config(data: Any) -> tuple[ProctorConfig | None, list[str], list[str]]:
    """Validate a loaded document: (config or None when it does not validate, problems, ignored sections).

    Unknown keys are problems but do not stop validation, so that they are reported together
    with whatever the rest of the file gets wrong.
    """
    if not isinstance(data, dict):
        return None, ["the file must be a YAML mapping with a `distillation:` block"], []
    problems: list[str] = []
    data = resolve_interpolations(normalize(data), problems)
    ignored = sorted(k for k in data if k not in ProctorConfig.model_fields)
    if "distillation" not in data:
        problems.append("distillation: missing; put verl's `distillation:` block (teacher_models, ...) in the file")
    body = {k: v for k, v in data.items() if k in ProctorConfig.model_fields}
    problems += _unknown_keys(ProctorConfig, body, "")
    try:
        return ProctorConfig.model_validate(body), problems, ignored
    except ValidationError as exc:
        problems += [p for p in _pydantic_problems(exc) if not p.startswith("distillation: Field required")]
        return None, problems, ignored


class _YamlRefused(yaml.composer.ComposerError):
    """A document _BoundedYamlLoader will not compose (too deep, too large, self-referring)."""

    def __init__(self, problem: str, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"refused: {problem}", mark)


class _BoundedYamlLoader(yaml.SafeLoader):
    """A SafeLoader that refuses, while composing, documents nested deeper than MAX_DEPTH or
    larger than MAX_NODES once every alias is expanded: a few lines of aliases ("billion
    laughs") stand for billions of nodes that validation and hashing would walk, and deep
    nesting exhausts the recursive composer. Sizes are counted per node and reused, so the
    count itself stays linear in the text."""

    MAX_DEPTH = 64
    MAX_NODES = 100_000

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> nodes in its expansion
        self._open: list[int] = [0]  # nodes so far below each node being composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:
                raise _YamlRefused("an alias refers to its own ancestor", mark)
        else:
            if len(self._open) > self.MAX_DEPTH:
                raise _YamlRefused(f"nested deeper than {self.MAX_DEPTH} levels", mark)
            self._open.append(0)
            node = super().compose_node(parent, index)
            size = 1 + self._open.pop()
            self._sizes[id(node)] = size
        self._open[-1] += size
        if sum(self._open) > self.MAX_NODES:
            raise _YamlRefused(f"more than {self.MAX_NODES} nodes once aliases are expanded", mark)
        return node


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from exc
    loader = _BoundedYamlLoader(text)
    try:
        return loader.get_single_data() or {}
    except _YamlRefused as exc:
        raise ConfigError([f"{path}: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML ({exc})"]) from exc
    finally:
        loader.dispose()


def load_plan(path: str | Path, *, files_must_exist: bool = True) -> ServingPlan:
    """Read, validate and resolve a config file; ConfigError lists every problem found."""
    config, problems, ignored = parse_config(read_yaml(path))
    if config is None:
        raise ConfigError(problems)
    try:
        plan = resolve_plan(config, files_must_exist=files_must_exist)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    if ignored:
        plan.notes.append(f"top-level sections ignored (not proctor's): {', '.join(ignored)}")
    return plan


def load_config(path: str | Path) -> ProctorConfig:
    """The validated config of a file (every check run, nothing loaded); raises ConfigError."""
    return load_plan(path, files_must_exist=False).config


# ------------------------------------------------------------------------------------------
# Building the server
# ------------------------------------------------------------------------------------------


def _replica_spec(spec: EngineSpec, group: ReplicaGroupPlan, kind: str, *, in_process: bool) -> EngineSpec:
    """One replica's spec: its device ids; in-process replicas also address their first device."""
    device = kind
    if in_process and kind != "cpu":
        device = f"{kind}:{group.local_devices[0]}"
    return replace(spec, device=device, devices=tuple(str(d) for d in group.local_devices))


def build_router(plan: ServingPlan) -> Router:
    """Teachers with their replicas (in-process engines, swap groups or Ray actors) behind a Router."""
    from proctor.server.engines import create_replica_engine
    from proctor.server.routing import Replica, RestartPolicy, Router, Teacher
    from proctor.server.swap import SwapGroup, SwappedTeacherEngine

    server = plan.config.server
    ray_pool = None
    if server.ray.enabled:
        from proctor.server.ray_replica import RayPool

        ray_pool = RayPool(plan.placement, server.ray)
    swap_groups: dict[str, SwapGroup] = {}
    for group in plan.placement.groups:
        if group.shared:
            specs = {
                n: _replica_spec(plan.teachers[n].spec, group, plan.device_kind, in_process=True)
                for n in group.teachers
            }
            swap_groups[group.group_id] = SwapGroup(
                group.group_id, specs, max_consecutive_batches=server.swap_max_consecutive_batches
            )

    def in_process(spec: EngineSpec, replica_id: str) -> Callable:
        async def build():
            return create_replica_engine(spec, name=replica_id)

        return build

    def swapped(group: SwapGroup, teacher: str) -> Callable:
        async def build():
            return SwappedTeacherEngine(group, teacher)

        return build

    teachers = []
    for name, resolved in plan.teachers.items():
        replicas = []
        for group in plan.placement.groups_of(name):
            if group.shared:
                factory = swapped(swap_groups[group.group_id], name)
                replica_id = f"{name}@{group.group_id}"
            elif ray_pool is not None:
                factory = ray_pool.factory(
                    _replica_spec(resolved.spec, group, plan.device_kind, in_process=False), group
                )
                replica_id = group.group_id
            else:
                replica_id = group.group_id
                factory = in_process(_replica_spec(resolved.spec, group, plan.device_kind, in_process=True), replica_id)
            replicas.append(
                Replica(replica_id, factory, devices=tuple(map(str, group.local_devices)), node=f"node{group.node}")
            )
        teachers.append(
            Teacher(
                name,
                replicas,
                keys=(resolved.key,),
                restart=RestartPolicy(server.restart_initial_backoff_s, server.restart_max_backoff_s),
                policy=server.routing_policy,
                health_check_interval_s=server.health_check_interval_s,
                swap_groups=tuple({id(g): g for g in swap_groups.values() if name in g.specs}.values()),
            )
        )
    return Router(teachers)


def server_options(plan: ServingPlan, *, host: str | None = None) -> ServerOptions:
    from proctor.server.auth import load_token
    from proctor.server.runtime import ServerOptions
    from proctor.server.service import Limits

    s = plan.config.server
    return ServerOptions(
        host=host or s.host,
        grpc_port=s.grpc_port,
        http_port=s.http_port,
        auth_token=load_token(token_file=s.auth_token_file),
        max_message_bytes=s.max_message_bytes,
        stream_chunk_bytes=s.stream_chunk_bytes,
        drain_grace_s=s.drain_grace_s,
        limits=Limits(
            max_queue_requests=s.max_queue_requests,
            max_queue_tokens=s.max_queue_tokens,
            default_timeout_s=s.request_timeout_s,
        ),
        tls_cert_file=s.tls.cert_file,
        tls_key_file=s.tls.key_file,
        tls_client_ca_file=s.tls.client_ca_file,
        open_paths=tuple(s.open_paths),
        metrics_port=s.metrics_port,
    )


def load_server_config(path: str | Path, *, host: str | None = None) -> tuple[Router, ServerOptions]:
    """What `proctor serve --config` runs: the Router (engines not yet started) and ServerOptions."""
    plan = load_plan(path)
    return build_router(plan), server_options(plan, host=host)


def check_config_command(path: str | Path, *, out=None) -> int:
    """`proctor check-config`: print the resolved plan (exit 0) or every problem (exit 1)."""
    out = out or sys.stdout
    try:
        plan = load_plan(path, files_must_exist=False)
    except ConfigError as exc:
        print(f"{path}: {len(exc.problems)} problem(s):", file=out)
        for problem in exc.problems:
            print(f"  - {problem}", file=out)
        return 1
    print(f"{path}: OK", file=out)
    print(plan.summary(), file=out)
    return 0
