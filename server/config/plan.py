"""The serving plan: the one place that decides, per teacher, its engine, devices per replica,
whether it serves hidden states, and its limits; and the checks that need the whole config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from proctor.server.config.checkpoints import checkpoint_line, missing_checkpoint, weights_source
from proctor.server.config.reading import parse_config, read_yaml
from proctor.server.config.schema import (
    DEFAULT_TEACHER,
    ConfigError,
    DistillationLossConfig,
    InferenceConfig,
    ProctorConfig,
    ServerBlock,
    TeacherModelConfig,
)
from proctor.server.engines.base import EngineConfigError, EngineSpec
from proctor.server.engines.fingerprint import model_architecture
from proctor.server.worker.pool import PlacementError, PlacementPlan, TeacherDemand, plan_placement

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
    # The Megatron checkpoint it serves (`builder.convert_checkpoints` swaps in its folder).
    dist_ckpt_path: str | None = None


@dataclass
class ServingPlan:
    """What the config resolves to: teachers, placement, server settings, and notes to show."""

    config: ProctorConfig
    device_kind: str
    teachers: dict[str, ResolvedTeacher]
    placement: PlacementPlan
    notes: list[str] = field(default_factory=list)
    # Files the config names that are not on this machine (check-config only: `proctor serve`
    # refuses them as problems). The config is often checked elsewhere than where it serves.
    missing_here: list[str] = field(default_factory=list)

    def summary(self) -> str:
        server = self.config.server
        if server.ray.enabled:
            mode = f"Ray actors (address {server.ray.address})"
        else:
            mode = "a worker process each, on this machine"
            if any(group.shared for group in self.placement.groups):
                mode += " (teachers sharing a slot take turns in the front process)"
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
                + (", batch-invariant (prompt reuse off)" if t.spec.inference.get("batch_invariant") else "")
            )
            if t.dist_ckpt_path:
                line = checkpoint_line(t.dist_ckpt_path, t.spec.model_path, server.checkpoint_cache_dir)
                lines.append(f"teacher {t.name}: {line}")
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


def _engine_problems(
    name: str, engine: str, teacher: TeacherModelConfig, loss: DistillationLossConfig, max_topk: int,
    device_kind: str,
) -> list[str]:
    """The engine startup checks (`proctor.server.engines.checks`) that need only the config.

    Each check raises on its own, so they are called one by one to collect every problem; their
    messages name the `inference.*` setting, prefixed here with the teacher's path.
    """
    from proctor.server.engines import checks
    from proctor.server.engines.invariance import check_batch_invariant

    inf = teacher.inference
    lengths = (inf.prompt_length, inf.response_length)
    calls: list[Callable[[], object]] = [lambda: checks.check_engine_name(engine)]
    if inf.batch_invariant:
        calls.append(lambda: check_batch_invariant(engine, device_kind))
    if loss.is_hidden_state and inf.hidden_states is False:
        calls.append(lambda: checks.refuse(
            f"inference.hidden_states is false, but distillation_loss.loss_mode {loss.loss_mode} needs the "
            "teacher's hidden states: remove the setting or choose a loss that does not"))
    if inf.max_model_len is not None:
        calls.append(lambda: checks.check_max_model_len(inf.max_model_len, *lengths))
    if engine in ("vllm", "vllm_omni"):
        # The student's top-k travels as score_ids, held to the same max_logprobs as a top-k.
        topk = loss.topk if (loss.is_topk or loss.is_student_topk) and loss.topk else 0
        calls.append(lambda: checks.check_max_logprobs(max_topk, topk, engine=engine))
        # vLLM-Omni's AR runner returns hidden states of whole prefills only; vLLM's scoring pooler
        # keeps each prefill chunk's outputs, so there chunked prefill and any step size work.
        if engine == "vllm_omni":  # its output mode and model family (a VL model is no Omni Thinker)
            from proctor.server.engines.vllm_omni.config import omni_pipeline
            calls.append(lambda: omni_pipeline(EngineSpec(name=engine, model_path=str(teacher.model_path),
                                                          inference={"engine_kwargs": inf.engine_kwargs})))
        if loss.is_hidden_state and engine == "vllm_omni":
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
    hidden states cost nothing (torch; vLLM's scoring pooler computes them only for requests that
    ask), and for vLLM-Omni (whose AR runner copies them out on every request) only when the
    loss needs them."""
    if inference.hidden_states is not None:
        return inference.hidden_states
    # vLLM-Omni scores score_ids (the student top-k modes) from its hidden states.
    return engine != "vllm_omni" or loss.is_hidden_state or loss.is_student_topk


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
        problems.extend(_engine_problems(name, engine, teacher, d.distillation_loss, max_topk, device_kind))
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
            dist_ckpt_path=teacher.dist_ckpt_path,
        )
    return resolved


def resolve_plan(config: ProctorConfig, *, files_must_exist: bool = True) -> ServingPlan:
    """Teachers, engines and placement for a parsed config; ConfigError lists every problem.

    `files_must_exist=False` (check-config, config linting) lists missing model directories and
    token/TLS files in `missing_here` instead: the config is often checked on another machine than
    the one that serves it.
    """
    problems: list[str] = []
    notes: list[str] = []
    missing: list[str] = []
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
    for t in list(teachers.values()):
        missing.extend(missing_checkpoint(t.name, t.dist_ckpt_path))
        if t.spec.model_path:
            path = weights_source(t.name, t.spec.model_path, download=files_must_exist, missing=missing, notes=notes)
            if path is not None:
                teachers[t.name] = replace(t, spec=replace(t.spec, model_path=path))
    missing.extend(_missing_files(server))
    if files_must_exist:
        problems.extend(missing)
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
    return ServingPlan(config=config, device_kind=device_kind, teachers=teachers, placement=placement, notes=notes,
                       missing_here=[] if files_must_exist else missing)


def _missing_files(server: ServerBlock) -> list[str]:
    """The server block's files (token, TLS) and student tokenizer directories that are not here."""
    missing = []
    for label, path in (
        ("server.auth_token_file", server.auth_token_file),
        ("server.tls.cert_file", server.tls.cert_file),
        ("server.tls.key_file", server.tls.key_file),
        ("server.tls.client_ca_file", server.tls.client_ca_file),
    ):
        if path and not Path(path).is_file():
            missing.append(f"{label}: {path} is not a readable file here")
    for key, path in server.student_tokenizers.items():
        if not Path(path).is_dir():
            missing.append(f"server.student_tokenizers.{key}: {path} is not a tokenizer directory here")
    return missing


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
