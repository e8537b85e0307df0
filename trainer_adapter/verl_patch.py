"""verl without a teacher pool: the reversible patches `patch_verl()` applies to verl's own code.

verl 0.9 builds in-cluster teachers whenever `distillation.enabled` is true: its resource-pool
setup (v1 `PPOTrainer._init_resource_pool_mgr`, v0 `BaseTaskRunner.init_resource_pool_mgr` /
`add_teacher_model_resource_pool`, the fully-async rollouter's `_create_teacher_model_manager`)
asks for `distillation.n_gpus_per_node × nnodes` devices and refuses 0, and the trainers start
a `MultiTeacherModelManager` on them. `patch_verl()` changes exactly that for a config whose
teachers proctor serves (a `proctor.target`): no teacher pool is requested (0 / 0 accepted),
and the manager verl builds is `ProctorTeacherModelManager`, whose `get_client()` hands verl's
trainers and agent loops proctor's clients. Configs without `proctor.target` run as verl runs
them. It also teaches verl's distillation loss the top-k modes it lacks (`verl_losses`).

These replace verl internals, so they are applied only on the verl release pyproject's table
supports, and every replacement is recorded (`VerlPatch`: where, verl's original, proctor's
replacement): `unpatch_verl()` puts each original object back and drops the loss modes it
registered, so a process (a test, a notebook) can return to plain verl.

The pool setup runs verl's own code with `is_distillation_enabled` answering False. Rather than
swapping that module global in and out around each call (visible to every thread while it is
out), the v0 and v1 trainer modules get, once, an `is_distillation_enabled` that reads a
context variable; the wrapped pool-setup methods set it for the duration of their own call.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proctor.trainer_adapter.verl_client import (
    SEQUENCE_SPLIT,
    ProctorTeacherModelManager,
    proctor_serves_teachers,
)

__all__ = ["VerlPatch", "applied_patches", "patch_verl", "unpatch_verl"]

# One patch or unpatch at a time per process (Ray may run the setup hook while a driver patches).
_PATCH_LOCK = threading.RLock()
# True while a proctor config's resource pools are set up: verl's pool code then sees no teachers.
_NO_TEACHER_POOL: contextvars.ContextVar[bool] = contextvars.ContextVar("proctor_no_teacher_pool", default=False)


@dataclass(frozen=True)
class VerlPatch:
    """One attribute of verl replaced by proctor, with what it takes to put verl's back.

    `own` says whether `original` was the owner's own attribute (a module's, or in a class's
    `__dict__`); if it was inherited, unpatching deletes the replacement instead of setting one.
    """

    owner: Any
    name: str
    original: Any
    replacement: Any
    own: bool = True

    def restore(self) -> None:
        """Put verl's original back (or uncover the inherited one)."""
        if self.own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


_APPLIED: dict[tuple[int, str], VerlPatch] = {}  # in order of application
_REGISTERED_MODES: list[str] = []  # loss modes added to verl's two loss registries


def _mark(replacement: Any, original: Any) -> Any:
    """Tag a replacement as proctor's: `__proctor__` for the checks, and verl's original kept on
    it, so a replacement met without a record (a reloaded module) still unwraps to verl's."""
    replacement.__proctor__ = True
    replacement.__proctor_original__ = original
    if callable(original) and not isinstance(original, type):
        replacement.__wrapped__ = original
    return replacement


def _replace(owner: Any, name: str, make: Callable[[Any], Any]) -> VerlPatch:
    """Set `owner.name` to `make(verl's original)` once, recording the original."""
    key = (id(owner), name)
    if key in _APPLIED:
        return _APPLIED[key]
    own = not isinstance(owner, type) or name in vars(owner)
    current = getattr(owner, name)
    original = getattr(current, "__proctor_original__", current)
    replacement = make(original)
    setattr(owner, name, replacement)
    _APPLIED[key] = patch = VerlPatch(owner, name, original, replacement, own)
    return patch


def _teacher_manager_class(verl_manager: type) -> type:
    """verl's MultiTeacherModelManager that becomes a ProctorTeacherModelManager for proctor configs."""

    class MultiTeacherModelManager(verl_manager):  # a subclass, so verl's isinstance checks still hold
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            """proctor's manager for proctor configs (its `__init__` then never runs), else verl's."""
            config = kwargs.get("config", args[0] if args else None)
            if proctor_serves_teachers(config):
                return ProctorTeacherModelManager(config, kwargs.get("resource_pool"))
            return super().__new__(cls)

    MultiTeacherModelManager.__qualname__ = verl_manager.__qualname__
    MultiTeacherModelManager.__module__ = verl_manager.__module__
    return _mark(MultiTeacherModelManager, verl_manager)


def _pool_aware(verl_is_enabled: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A trainer module's `is_distillation_enabled`: verl's answer, except False inside a proctor
    config's pool setup (this context only; other threads and later calls get verl's answer)."""

    def is_distillation_enabled(config: Any) -> bool:
        if _NO_TEACHER_POOL.get():
            return False
        return verl_is_enabled(config)

    is_distillation_enabled.__doc__ = verl_is_enabled.__doc__
    return _mark(is_distillation_enabled, verl_is_enabled)


def _without_teacher_pool(method: Callable[..., Any], config_of: Callable[..., Any]) -> Callable[..., Any]:
    """`method` run, for proctor configs, with its module's `is_distillation_enabled` answering
    False: verl's pool setup then asks for no teacher pool and checks no teacher device count,
    while everything else it sets up (actor, critic, reward pools) is verl's own code."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not proctor_serves_teachers(config_of(*args, **kwargs)):
            return method(*args, **kwargs)
        token = _NO_TEACHER_POOL.set(True)
        try:
            return method(*args, **kwargs)
        finally:
            _NO_TEACHER_POOL.reset(token)

    run.__name__ = method.__name__
    run.__qualname__ = method.__qualname__
    run.__doc__ = method.__doc__
    return _mark(run, method)


def _patch_teacher_managers() -> None:
    """Every name verl builds its teacher manager by: the package's, the defining module's, and
    the v1 trainer's (it imported the class by name at import time)."""
    import verl.experimental.teacher_loop as teacher_loop
    import verl.experimental.teacher_loop.teacher_model as teacher_model

    manager = _replace(teacher_model, "MultiTeacherModelManager", _teacher_manager_class).replacement
    _replace(teacher_loop, "MultiTeacherModelManager", lambda _: manager)
    try:
        import verl.trainer.ppo.v1.trainer_base as trainer_base
    except ImportError:  # the v1 trainer's dependencies (transfer_queue) are absent: nothing to patch
        return
    _replace(trainer_base, "MultiTeacherModelManager", lambda _: manager)


def _get_resource_pool(verl_get: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`ResourcePoolManager.get_resource_pool`, answering None for a teacher that has no pool."""
    from verl.trainer.ppo.utils import Role

    def get_resource_pool(self: Any, role: Any) -> Any:
        """verl's, but None for a teacher that has no pool (proctor serves it)."""
        if role == Role.TeacherModel and role not in self.mapping:
            return None
        return verl_get(self, role)

    return _mark(get_resource_pool, verl_get)


def _patch_resource_pools() -> None:
    """The v1 and v0 pool setups run without a teacher pool for proctor configs."""
    from verl.single_controller.ray import ResourcePoolManager

    _replace(ResourcePoolManager, "get_resource_pool", _get_resource_pool)
    try:
        import verl.trainer.main_ppo_v0 as v0
        import verl.trainer.ppo.v1.trainer_base as v1
    except ImportError:  # a trainer whose dependencies are absent cannot run either
        return
    for module in (v1, v0):
        _replace(module, "is_distillation_enabled", _pool_aware)
    _replace(v1.PPOTrainer, "_init_resource_pool_mgr", lambda m: _without_teacher_pool(m, lambda self: self.config))
    for name in ("init_resource_pool_mgr", "add_teacher_model_resource_pool"):
        _replace(v0.BaseTaskRunner, name, lambda m: _without_teacher_pool(m, lambda self, config: config))


def _create_teacher_model_manager(verl_create: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The fully-async rollouter's manager factory: proctor's clients and no pool for proctor configs."""

    async def _create_teacher_model_manager(self: Any) -> None:
        """verl's, but proctor's clients and no teacher pool when proctor serves the teachers."""
        if not proctor_serves_teachers(self.config):
            return await verl_create(self)
        self.teacher_model_manager = ProctorTeacherModelManager(self.config)

    return _mark(_create_teacher_model_manager, verl_create)


def _patch_fully_async_rollouter() -> None:
    """Patched on the class Ray's actors are made of, which is what Ray workers import and run."""
    try:
        from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter as actor
    except ImportError:
        return
    rollouter = getattr(actor, "__ray_actor_class__", actor)
    _replace(rollouter, "_create_teacher_model_manager", _create_teacher_model_manager)


def _with_sequence_split(verl_compute: Callable[..., Any]) -> Callable[..., Any]:
    """verl's per-sample teacher call, with the sample's prompt/response split made known to
    `ProctorTeacherClient.generate` (`verl_client.SEQUENCE_SPLIT`) for the duration of the call."""

    async def _compute_teacher_logprobs(self: Any, output: Any, prompt_ids: Any, response_ids: Any,
                                        *args: Any, **kwargs: Any) -> Any:
        token = SEQUENCE_SPLIT.set((len(prompt_ids), len(prompt_ids) + len(response_ids)))
        try:
            return await verl_compute(self, output, prompt_ids, response_ids, *args, **kwargs)
        finally:
            SEQUENCE_SPLIT.reset(token)

    return _mark(_compute_teacher_logprobs, verl_compute)


def _patch_agent_loop() -> None:
    """The agent loop's teacher call tells proctor's client where each sample's prompt ends."""
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    except ImportError:
        return
    _replace(AgentLoopWorker, "_compute_teacher_logprobs", _with_sequence_split)


def _patch_losses() -> None:
    """proctor's top-k modes in verl's logits processor, and registered so verl's config accepts
    them and its top-k loss function turns the processor's outputs into metrics."""
    import verl.trainer.distillation.losses as losses

    from proctor.trainer_adapter.verl_losses import VERL_EXTRA_TOPK_MODES, with_proctor_topk_modes

    _replace(losses, "compute_topk_loss", lambda verl_fn: _mark(with_proctor_topk_modes(verl_fn), verl_fn))
    missing = [mode for mode in VERL_EXTRA_TOPK_MODES if mode not in losses.DISTILLATION_LOSS_REGISTRY]
    if missing:
        settings = losses.DistillationLossSettings(names=missing, use_topk=True)
        losses.register_distillation_loss(settings)(losses.compute_forward_kl_topk)
        _REGISTERED_MODES.extend(missing)


def _check_verl_version() -> None:
    """Refuse a verl release this adapter was not tested against (it replaces verl internals):
    one line naming the installed and the supported release (pyproject's `verl` extra). Without
    verl there is nothing to patch and nothing to check."""
    from proctor.proto.versions import check_versions, installed

    if installed("verl") is not None:
        check_versions(["verl"], needed_by="proctor.trainer_adapter.patch_verl")


def patch_verl() -> tuple[VerlPatch, ...]:
    """Make verl 0.9 run with proctor teachers and proctor's top-k losses; idempotent.

    Safe in every process of a verl job (the entrypoint runs it in the driver, its TaskRunner
    and, through Ray's `worker_process_setup_hook`, every Ray worker): each attribute is
    replaced once, and a trainer whose dependencies are absent is left alone. Returns every
    replacement in place, verl's originals with them.
    """
    _check_verl_version()
    with _PATCH_LOCK:
        _patch_teacher_managers()
        _patch_resource_pools()
        _patch_fully_async_rollouter()
        _patch_agent_loop()
        _patch_losses()
        return applied_patches()


def applied_patches() -> tuple[VerlPatch, ...]:
    """The replacements in place in this process, in the order they were applied."""
    with _PATCH_LOCK:
        return tuple(_APPLIED.values())


def unpatch_verl() -> tuple[VerlPatch, ...]:
    """Put back every verl original `patch_verl` replaced (latest first) and drop the loss modes
    it registered; a no-op when nothing is patched. Returns the patches it undid."""
    with _PATCH_LOCK:
        undone = tuple(reversed(_APPLIED.values()))
        for patch in undone:
            patch.restore()
        _APPLIED.clear()
        if _REGISTERED_MODES:
            import verl.trainer.distillation.losses as losses

            for mode in _REGISTERED_MODES:
                losses.DISTILLATION_LOSS_REGISTRY.pop(mode, None)
                losses.DISTILLATION_SETTINGS_REGISTRY.pop(mode, None)
            _REGISTERED_MODES.clear()
        return undone
