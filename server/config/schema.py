"""The config schema: verl's `distillation:` block as verl defines it, and proctor's `server:` block.

Each block validates its declared fields; keys a block merely accepts pass through, and any
other key is reported by `reading` with the nearest known name.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from proctor.proto.loss_modes import (
    LOSS_MODES,
    LOSS_SETTINGS,
    VERL_IGNORED_LOSS_KEYS,
    LossFamilies,
)
from proctor.server.engines.prompt_reuse import ReuseSettings
from proctor.server.front.fleet.drift import DriftSettings
from proctor.server.front.settings import DEFAULTS

if typing.TYPE_CHECKING:
    pass


DEFAULT_TEACHER = "teacher_model"  # the entry verl's distillation.yaml ships in teacher_models


class ConfigError(ValueError):
    """The configuration cannot be served; `problems` lists every reason, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


# ------------------------------------------------------------------------------------------
# The schema
# ------------------------------------------------------------------------------------------


class ConfigBlock(BaseModel):
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


_REUSE = ReuseSettings()
_DRIFT = DriftSettings()


class InferenceConfig(ConfigBlock):
    """`teacher_models.<name>.inference`: verl's RolloutConfig, the fields proctor acts on declared."""

    accepted: ClassVar[frozenset[str]] = _VERL_ROLLOUT_FIELDS
    # Keys `proctor serve --inference` takes and a config file refuses (there: engine_kwargs.vllm
    # for vLLM's, and one process or a health deadline are debugging switches, not a plan's).
    command_line_only: ClassVar[frozenset[str]] = frozenset(
        {"replica_worker", "health_timeout_s", "max_logprobs", "kv_cache_dtype", "trust_remote_code"})

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
    # Rank r of the hidden-state projection (`engines/hidden_forms.py`; 0: no projected forms).
    hidden_projection_rank: int = Field(0, ge=0)
    # Shared-prefix reuse (`proctor.server.engines.prompt_reuse`): on for shared prefixes of at least min_tokens.
    prompt_reuse: bool = _REUSE.enabled
    prompt_reuse_min_tokens: int = Field(_REUSE.min_tokens, ge=1)
    prompt_reuse_memory_mb: float = Field(_REUSE.memory_bytes / (1 << 20), ge=0)
    prompt_reuse_ttl_s: float = Field(_REUSE.ttl_s, ge=0)
    prompt_reuse_block_tokens: int = Field(_REUSE.block_tokens, ge=1)
    # Scores that do not depend on the batch, padding or replica (`engines/invariance.py`; reuse off).
    batch_invariant: bool = False
    # The replicas' drift check on fixed canaries (`front/drift.py`); interval null: no check.
    drift_check_interval_s: float | None = Field(_DRIFT.interval_s, gt=0)
    drift_canaries: int = Field(_DRIFT.canaries, ge=1)
    drift_canary_tokens: int = Field(_DRIFT.canary_tokens, ge=2)
    max_drift: float = Field(_DRIFT.max_drift, ge=0)

    @property
    def per_replica(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


class TeacherModelConfig(ConfigBlock):
    """`teacher_models.<name>`: verl's DistillationTeacherModelConfig."""

    # Older verl teacher entries carried their own pool keys; verl-omni adds nitrobrew_d_comp.
    accepted: ClassVar[frozenset[str]] = frozenset(
        {"_target_", "nitrobrew_d_comp", "task", "enable_resource_pool", "n_gpus_per_node", "nnodes"}
    )

    key: str | None = None
    model_path: str | None = None
    # One training step's Megatron distributed checkpoint (LoongSage's `dist_ckpt_path`): its
    # weights are served, converted once at start (`engines/megatron/convert.py`); model_path
    # gives the architecture (config.json) and tokenizer, its weights are not read.
    dist_ckpt_path: str | None = None
    num_replicas: int | None = Field(0, ge=0)  # 0 / null: size automatically (see pool.py)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)


class DistillationLossConfig(LossFamilies, ConfigBlock):
    """`distillation_loss`: the trainer's loss. The server reads the mode and its top-k (what the
    loss needs served); every other key of the schema (`proctor.proto.loss_modes`) is accepted
    as it is, for the trainer's side to read."""

    accepted: ClassVar[frozenset[str]] = frozenset(LOSS_SETTINGS) | VERL_IGNORED_LOSS_KEYS

    loss_mode: Literal[LOSS_MODES] = LOSS_SETTINGS["loss_mode"]  # type: ignore[valid-type]
    topk: int | None = Field(LOSS_SETTINGS["topk"], ge=1)


class DistillationConfig(ConfigBlock):
    """verl's `distillation:` block (DistillationConfig), with verl's YAML defaults."""

    accepted: ClassVar[frozenset[str]] = frozenset({"_target_", "defaults", "enable_resource_pool"})

    enabled: bool = False
    n_gpus_per_node: int = Field(8, ge=0)
    nnodes: int = Field(0, ge=0)
    teacher_key: str = "data_source"
    teacher_models: dict[str, TeacherModelConfig] = Field(default_factory=dict)
    distillation_loss: DistillationLossConfig = Field(default_factory=DistillationLossConfig)


class TlsConfig(ConfigBlock):
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None  # set: clients must present a certificate it signed


class RayConfig(ConfigBlock):
    """Replicas as Ray actors on placement groups (several machines); off: in-process replicas."""

    enabled: bool = False
    address: str = "auto"
    namespace: str = "proctor"
    device_resource: str | None = None  # None: GPU for cuda, NPU for npu, none for cpu
    cpus_per_replica: float = Field(1.0, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)


class ServerBlock(ConfigBlock):
    """proctor's own `server:` block."""

    # Defaults are the runtime's (proctor.server.front.settings.DEFAULTS): one table for both.
    host: str = DEFAULTS.host
    grpc_port: int = Field(DEFAULTS.grpc_port, ge=0, le=65535)
    http_port: int = Field(DEFAULTS.http_port, ge=0, le=65535)
    auth_token_file: str | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)
    max_queue_requests: int = Field(DEFAULTS.limits.max_queue_requests, ge=1)
    max_queue_tokens: int = Field(DEFAULTS.limits.max_queue_tokens, ge=1)
    request_timeout_s: float | None = Field(DEFAULTS.limits.default_timeout_s, gt=0)
    drain_grace_s: float = Field(DEFAULTS.drain_grace_s, ge=0)
    max_message_bytes: int = Field(DEFAULTS.max_message_bytes, ge=1 << 20)
    stream_chunk_bytes: int = Field(DEFAULTS.stream_chunk_bytes, ge=1 << 10)
    # Paths of the HTTP port that need no bearer token (probes and scrapers).
    open_paths: list[str] = Field(default_factory=lambda: list(DEFAULTS.open_paths))
    metrics_port: int | None = Field(DEFAULTS.metrics_port, ge=0, le=65535)
    http_header_timeout_s: float = Field(DEFAULTS.http_header_timeout_s, gt=0)
    http_max_connections: int = Field(DEFAULTS.http_max_connections, ge=1)
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    routing_policy: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    health_check_interval_s: float | None = Field(5.0, gt=0)
    restart_initial_backoff_s: float = Field(0.5, gt=0)
    restart_max_backoff_s: float = Field(30.0, gt=0)
    # Where dist_ckpt_path conversions are cached (None: ~/.cache/proctor/dist-ckpt).
    checkpoint_cache_dir: str | None = None
    swap_max_consecutive_batches: int = Field(4, ge=1)
    # Student tokenizers (key -> tokenizer directory) that aligned requests may name.
    student_tokenizers: dict[str, str] = Field(default_factory=lambda: dict(DEFAULTS.student_tokenizers))
    ray: RayConfig = Field(default_factory=RayConfig)


class ProctorConfig(ConfigBlock):
    """The whole file. Other top-level sections of a verl trainer YAML are ignored (and listed)."""

    distillation: DistillationConfig
    server: ServerBlock = Field(default_factory=ServerBlock)


# ------------------------------------------------------------------------------------------
# Reading: Hydra-style keys, interpolations, unknown keys
