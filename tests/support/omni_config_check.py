"""Run in .venv-omni: what the real vLLM-Omni makes of a config file proctor's engine could pass it.

`python omni_config_check.py MODEL_DIR KEY PATH [KEY PATH ...]` runs 0.30.0's own config front door,
as AsyncOmni does before it starts any stage (`entrypoints/utils.py:prepare_stage_config_inputs`,
then `config/resolver.py:resolve_omni_config`), for each `deploy_config=PATH` or
`stage_configs_path=PATH` (KEY), and prints one line, "RESULT " + a JSON list with one entry each:
{"error": <message>} when it refuses the file, else the stage's resolved settings the fakes model. tests/test_vllm_omni_engine.py compares tests/omni_fakes.py
with it.
"""

from __future__ import annotations

import json
import sys


def main(model: str, key: str, path: str) -> dict:
    from vllm_omni.config.resolver import resolve_omni_config
    from vllm_omni.entrypoints.utils import prepare_stage_config_inputs

    try:
        prepare_stage_config_inputs(model, {key: path}, trust_remote_code=None)
        resolved = resolve_omni_config(model, trust_remote_code=None, deploy_config_path=path, cli_overrides={},
                                       stage_overrides=None, strategy_config_path=None)
    except (ValueError, TypeError, KeyError) as exc:
        return {"error": str(exc)}
    (stage,) = resolved.stage_configs
    return {"engine_output_type": stage.engine_output_type, "max_num_seqs": stage.scheduler_config.max_num_seqs,
            "max_logprobs": stage.model_config.max_logprobs}


if __name__ == "__main__":
    model_dir, rest = sys.argv[1], sys.argv[2:]
    print("RESULT " + json.dumps([main(model_dir, key, path) for key, path in zip(rest[::2], rest[1::2], strict=True)]))
