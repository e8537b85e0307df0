"""`patch_verl()` on verl 0.9.1's own code: no teacher pool for proctor-served teachers (v1 and v0
trainers, the fully-async rollouter), proctor clients from verl's teacher manager, and
`topk_reverse_kl` / `topk_jsd` computed in verl's distillation loss path."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from proctor.client.loss import topk_kl
from proctor.trainer_adapter.verl import ProctorTeacherClient, ProctorTeacherModelManager, patch_verl

pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl 0.9.1 and its trainer imports (scripts/install.sh)")


def verl_config(target: str, *overrides: str):
    """verl's own `ppo_trainer` config, composed by Hydra as `main_ppo` composes it."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=[
            "distillation.enabled=true", "distillation.n_gpus_per_node=0", "distillation.nnodes=0",
            "distillation.teacher_models.teacher_model.model_path=served-by-proctor",
            "distillation.distillation_loss.loss_mode=topk_reverse_kl", "distillation.distillation_loss.topk=4",
            "actor_rollout_ref.rollout.name=vllm", f"+proctor.target={target}", *overrides])


@pytest.fixture(scope="module")
def config(torch_server):
    patch_verl()
    patch_verl()  # idempotent
    return verl_config(f"grpc://{torch_server.grpc_target}")


async def _scores_through(clients: dict) -> None:
    assert set(clients) == {"default"} and isinstance(clients["default"], ProctorTeacherClient)
    out = await clients["default"].generate("r", prompt_ids=[3, 4, 5, 6], sampling_params={"prompt_logprobs": 4})
    assert len(out.extra_fields["prompt_ids"]) == 4
    await clients["default"].close()


def test_v1_trainer_requests_no_teacher_pool_and_hands_out_proctor_clients(config):
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base
    from verl.utils.config import omega_conf_to_dataclass

    trainer = object.__new__(get_trainer_cls(config.trainer.v1.trainer_mode))
    trainer.config = config
    with pytest.raises(ValueError, match="n_gpus_per_node must be greater than 0"):  # verl's own, unpatched
        type(trainer)._init_resource_pool_mgr.__wrapped__(trainer)
    trainer._init_resource_pool_mgr()
    pools = trainer.resource_pool_manager
    assert "teacher_pool" not in pools.resource_pool_spec and Role.TeacherModel not in pools.mapping
    assert "global_pool" in pools.resource_pool_spec
    # what trainer_base's _setup does next, with verl's own names
    distillation = omega_conf_to_dataclass(config.distillation)
    assert distillation.n_gpus_per_node == 0 and distillation.distillation_loss.loss_settings.use_topk
    trainer.teacher_model_manager = trainer_base.MultiTeacherModelManager(
        config=config, resource_pool=pools.get_resource_pool(Role.TeacherModel))
    assert isinstance(trainer.teacher_model_manager, ProctorTeacherModelManager)
    trainer.use_teacher_policy = True
    asyncio.run(_scores_through(trainer.get_teacher_client()))


def test_v0_trainer_requests_no_teacher_pool_and_hands_out_proctor_clients(config):
    from verl.experimental.teacher_loop import MultiTeacherModelManager
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.utils import Role

    runner = BaseTaskRunner()
    runner.add_actor_rollout_worker(config)
    runner.add_teacher_model_resource_pool(config)
    pools = runner.init_resource_pool_mgr(config)
    assert "teacher_pool" not in pools.resource_pool_spec and Role.TeacherModel not in runner.mapping
    # RayPPOTrainer.init_workers: `from verl.experimental.teacher_loop import MultiTeacherModelManager`
    manager = MultiTeacherModelManager(config=config, resource_pool=pools.get_resource_pool(Role.TeacherModel))
    asyncio.run(_scores_through(manager.get_client()))


def test_fully_async_rollouter_builds_proctor_clients_without_a_pool(config):
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

    rollouter = object.__new__(FullyAsyncRollouter.__ray_actor_class__)  # the class Ray's actor runs
    rollouter.config = config
    asyncio.run(rollouter._create_teacher_model_manager())
    assert isinstance(rollouter.teacher_model_manager, ProctorTeacherModelManager)


def test_configs_without_proctor_keep_verls_behaviour(config):
    from verl.trainer.main_ppo_v0 import BaseTaskRunner

    plain = verl_config("x")
    del plain.proctor
    with pytest.raises(ValueError, match="n_gpus_per_node must be greater than 0"):
        BaseTaskRunner().init_resource_pool_mgr(plain)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


@pytest.mark.parametrize(("mode", "direction"), [("topk_reverse_kl", "reverse"), ("topk_jsd", "jsd")])
def test_verls_distillation_loss_path_computes_proctors_topk_losses(config, mode, direction):
    from verl.trainer.distillation import losses
    from verl.workers.config import DistillationLossConfig

    loss_config = DistillationLossConfig(loss_mode=mode, topk=4, use_policy_gradient=False)
    assert loss_config.loss_settings.use_topk
    assert losses.get_distillation_loss_fn(mode) is losses.compute_forward_kl_topk  # verl's metrics
    generator = torch.Generator().manual_seed(0)
    lengths, vocab, k = [5, 3], 50, 4
    logits = torch.randn(1, sum(lengths), vocab, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(sum(lengths), vocab, dtype=torch.float64, generator=generator), -1)
    top_lps, top_ids = teacher.topk(k, dim=-1)
    data = {"teacher_logprobs": _nested(list(top_lps.split(lengths))),
            "teacher_ids": _nested(list(top_ids.to(torch.int32).split(lengths)))}
    # verl's logits-processor call, exactly as its actor makes it
    out = losses.distillation_ppo_loss(SimpleNamespace(strategy="fsdp"), SimpleNamespace(distillation_loss=loss_config),
                                       data=data, student_logits=logits, data_format="thd")
    want = topk_kl(top_ids, top_lps, student_logits=logits[0], direction=direction)
    assert out["distillation_losses"].shape == (1, sum(lengths))
    torch.testing.assert_close(out["distillation_losses"][0], want, rtol=0, atol=1e-6)
    student = torch.log_softmax(logits[0].detach(), -1).gather(1, top_ids).exp().sum(-1)
    torch.testing.assert_close(out["student_mass"][0], student, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["teacher_mass"][0], top_lps.exp().sum(-1), rtol=0, atol=1e-6, check_dtype=False)
    if mode == "topk_reverse_kl":  # LoongSage's formula, written out: KL(q_S || q_T) renormalised on the k ids
        log_qs = torch.log_softmax(logits[0].detach().gather(1, top_ids), -1)
        log_qt = torch.log_softmax(top_lps, -1)
        torch.testing.assert_close(out["distillation_losses"][0].detach(), (log_qs.exp() * (log_qs - log_qt)).sum(-1),
                                   rtol=0, atol=1e-6)
    out["distillation_losses"].sum().backward()  # differentiable in the student, as verl backpropagates it
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with pytest.raises(NotImplementedError, match="forward_kl_topk"):
        losses.compute_topk_loss(SimpleNamespace(strategy="megatron"), SimpleNamespace(distillation_loss=loss_config),
                                 data, logits, "thd")


def test_entrypoint_help_and_the_worker_setup_hook(config):
    from proctor.trainer_adapter.verl_main import SETUP_HOOK, with_setup_hook

    with_setup_hook(config)
    assert config.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == SETUP_HOOK
    done = subprocess.run([sys.executable, "-m", "proctor.trainer_adapter.verl_main", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "distillation: distillation" in done.stdout
