"""`python -m proctor.trainer_adapter.verl_main <verl's Hydra overrides>`: verl's PPO trainer with
proctor teachers and no teacher resource pool.

It is verl's own `main_ppo` (same `ppo_trainer` config and overrides, v1 trainer or the legacy
v0 one by `trainer.use_v1`), with three differences, all from `patch_verl()`: teachers come from
the `+proctor.*` block (`+proctor.target=grpc://teacher-host:50051`, optional `token_env`,
`max_concurrency`, `timeout`, `hidden_states`, `teachers.<verl key>`), no teacher pool is
requested (`distillation.n_gpus_per_node=0 distillation.nnodes=0` are accepted), and
`distillation.distillation_loss.loss_mode` also takes `topk_reverse_kl` and `topk_jsd`.

The patch is applied here, in the TaskRunner actor (its `run` applies it before verl's), and in
every Ray worker of the job through Ray's `worker_process_setup_hook` (the actor workers compute
the losses and parse the loss config), so no process of the job runs unpatched verl.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import hydra
    import ray
    from omegaconf import open_dict
except ImportError as missing:  # `make demo`'s .venv has no verl stack: say so in one line when run
    if __name__ == "__main__":
        raise SystemExit(f"verl_main needs verl and its stack ({missing.name} is not installed): `make setup` "
                         "builds the full .venv; elsewhere install proctor[verl] in verl's environment") from None
    raise

from proctor.trainer_adapter.verl import patch_verl, proctor_serves_teachers

SETUP_HOOK = "proctor.trainer_adapter.verl.patch_verl"


def _config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _patched_runner(verl_runner: Any) -> Any:
    """verl's TaskRunner Ray actor class whose `run` applies `patch_verl()` in the actor first."""
    base = verl_runner.__ray_actor_class__

    class Runner(base):
        def run(self, config):
            patch_verl()
            return super().run(config)

    Runner.__name__ = Runner.__qualname__ = f"Proctor{base.__name__}"
    return ray.remote(Runner)


def with_setup_hook(config: Any) -> None:
    """Have Ray run `patch_verl` in every worker process of the job (ray_kwargs.ray_init.runtime_env)."""
    with open_dict(config):
        runtime_env = config.ray_kwargs.ray_init.setdefault("runtime_env", {})
        runtime_env["worker_process_setup_hook"] = SETUP_HOOK


def run(config: Any) -> None:
    """verl's `main_ppo.main` body, on proctor's TaskRunners."""
    patch_verl()
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    if config.distillation.enabled and not proctor_serves_teachers(config):
        raise SystemExit("distillation is on but no +proctor.target is set: point it at the proctor server "
                         "(e.g. +proctor.target=grpc://teacher-host:50051), or run verl's own main_ppo")
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    with_setup_hook(config)
    if config.trainer.use_v1:
        run_ppo(config, task_runner_class=_patched_runner(TaskRunnerV1))
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=_patched_runner(TaskRunner))


@hydra.main(config_path=_config_dir(), config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    run(config)


# Printed above Hydra's help of verl's config, which never names proctor.
PROCTOR_HELP = """proctor's verl entrypoint: verl's main_ppo with proctor teachers and no teacher resource pool.
proctor's keys (verl's own config and overrides follow, unchanged):
  +proctor.target=grpc://HOST:50051    the proctor server (or http://HOST:8000); required
  +proctor.token_env=NAME              environment variable holding the server's bearer token
  +proctor.max_concurrency=N           scoring calls in flight
  +proctor.timeout=SECONDS             deadline of one scoring call
  +proctor.hidden_states=true          also fetch teacher_hidden_states (verl 0.9.1's actor does not use them)
  +proctor.teachers.<verl key>=NAME    the proctor teacher a verl teacher key maps to (trainer_adapter/README.md)
  distillation.n_gpus_per_node=0 distillation.nnodes=0    accepted: no teacher pool
  distillation.distillation_loss.loss_mode=topk_reverse_kl|topk_jsd    proctor's renormalised top-k losses
"""

if __name__ == "__main__":
    import sys

    if {"--help", "-h"} & set(sys.argv[1:]):
        print(PROCTOR_HELP, flush=True)
    main()
