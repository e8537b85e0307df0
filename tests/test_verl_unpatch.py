"""`patch_verl()` is reversible and idempotent on verl 0.9.1's own modules: every attribute it
replaces is recorded with verl's original, `unpatch_verl()` puts each original object back, and
the per-call "no teacher pool" switch is a context of the calling thread, not a module global."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from proctor.trainer_adapter import verl as adapter
from proctor.trainer_adapter import verl_patch

pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl 0.9.1 and its trainer imports (scripts/install.sh)")


def _targets() -> list[tuple[Any, str]]:
    """Every attribute of verl that patch_verl replaces, named independently of verl_patch."""
    import verl.experimental.teacher_loop as teacher_loop
    import verl.experimental.teacher_loop.teacher_model as teacher_model
    import verl.trainer.distillation.losses as losses
    import verl.trainer.main_ppo_v0 as v0
    import verl.trainer.ppo.v1.trainer_base as v1
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
    from verl.single_controller.ray import ResourcePoolManager

    return [
        (teacher_model, "MultiTeacherModelManager"),
        (teacher_loop, "MultiTeacherModelManager"),
        (v1, "MultiTeacherModelManager"),
        (ResourcePoolManager, "get_resource_pool"),
        (v1, "is_distillation_enabled"),
        (v0, "is_distillation_enabled"),
        (v1.PPOTrainer, "_init_resource_pool_mgr"),
        (v0.BaseTaskRunner, "init_resource_pool_mgr"),
        (v0.BaseTaskRunner, "add_teacher_model_resource_pool"),
        (FullyAsyncRollouter.__ray_actor_class__, "_create_teacher_model_manager"),
        (AgentLoopWorker, "_compute_teacher_logprobs"),
        (losses, "compute_topk_loss"),
    ]


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Plain verl for the test; the process is left patched again if it was patched before."""
    was_patched = bool(adapter.applied_patches())
    adapter.unpatch_verl()
    try:
        yield
    finally:
        adapter.unpatch_verl()
        if was_patched:
            adapter.patch_verl()


def test_patch_then_unpatch_restores_every_original_object(unpatched):
    import verl.trainer.distillation.losses as losses

    targets = _targets()
    originals = [getattr(owner, name) for owner, name in targets]
    assert not any(getattr(o, "__proctor__", False) for o in originals)
    registered = set(losses.DISTILLATION_LOSS_REGISTRY), set(losses.DISTILLATION_SETTINGS_REGISTRY)

    patches = adapter.patch_verl()
    assert len(patches) == len(targets)
    assert {(id(p.owner), p.name) for p in patches} == {(id(o), n) for o, n in targets}
    for (owner, name), original in zip(targets, originals, strict=True):
        replaced = getattr(owner, name)
        assert replaced is not original and replaced.__proctor__, (owner, name)
        (patch,) = [p for p in patches if p.owner is owner and p.name == name]
        assert patch.original is original and patch.replacement is replaced
    assert {"topk_reverse_kl", "topk_jsd"} <= set(losses.DISTILLATION_LOSS_REGISTRY)

    again = adapter.patch_verl()  # idempotent: nothing is wrapped twice
    assert again == patches
    assert all(getattr(o, n) is p.replacement for p in again for o, n in [(p.owner, p.name)])
    assert adapter.applied_patches() == patches

    undone = adapter.unpatch_verl()
    assert set(undone) == set(patches)
    for (owner, name), original in zip(targets, originals, strict=True):
        assert getattr(owner, name) is original, (owner, name)
    assert (set(losses.DISTILLATION_LOSS_REGISTRY), set(losses.DISTILLATION_SETTINGS_REGISTRY)) == registered
    assert adapter.applied_patches() == () and adapter.unpatch_verl() == ()  # a second unpatch: nothing to do


def test_the_teacher_manager_is_one_class_under_every_name_and_unpatch_restores_verls(unpatched):
    import verl.experimental.teacher_loop as teacher_loop
    import verl.trainer.ppo.v1.trainer_base as v1

    verl_manager = teacher_loop.MultiTeacherModelManager
    adapter.patch_verl()
    assert v1.MultiTeacherModelManager is teacher_loop.MultiTeacherModelManager
    assert issubclass(teacher_loop.MultiTeacherModelManager, verl_manager)
    config = {"proctor": {"target": "grpc://teacher-host:50051"},
              "distillation": {"teacher_models": {"teacher_model": {}}}}
    assert isinstance(v1.MultiTeacherModelManager(config=config), adapter.ProctorTeacherModelManager)
    adapter.unpatch_verl()
    assert v1.MultiTeacherModelManager is verl_manager and teacher_loop.MultiTeacherModelManager is verl_manager


def test_no_teacher_pool_holds_only_in_the_calling_context(unpatched):
    """Inside a proctor config's pool setup verl's trainer module sees distillation off; another
    thread at the same moment, and the caller afterwards, see verl's own answer."""
    import verl.trainer.main_ppo_v0 as v0

    adapter.patch_verl()
    on = SimpleNamespace(enabled=True)
    proctor_config = {"proctor": {"target": "grpc://teacher-host:50051"}}
    seen: dict[str, bool] = {}

    def setup(config: Any) -> str:
        seen["inside"] = v0.is_distillation_enabled(on)
        other = threading.Thread(target=lambda: seen.__setitem__("other thread", v0.is_distillation_enabled(on)))
        other.start()
        other.join()
        return "done"

    wrapped = verl_patch._without_teacher_pool(setup, lambda config: config)
    assert wrapped(proctor_config) == "done"
    assert seen == {"inside": False, "other thread": True}
    assert v0.is_distillation_enabled(on) is True
    wrapped({"proctor": {}})  # not proctor's teachers: verl's answer inside too
    assert seen["inside"] is True
