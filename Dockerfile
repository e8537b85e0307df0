# syntax=docker/dockerfile:1.7
#
# Proctor teacher-scoring server images. Three targets, one per kind of node, each built for the
# CPU architectures its nodes have (deploy/README.md "Images" has the whole procedure):
#
#   docker build --target cpu -t proctor:0.1.0-cpu \
#       --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> .
#   docker buildx build --platform linux/amd64 --target cuda \
#       -t <registry>/proctor:0.1.0-cuda --push .                     # vLLM, NVIDIA GPUs (x86 nodes)
#   docker buildx build --platform linux/arm64,linux/amd64 --target ascend \
#       -t <registry>/proctor:0.1.0-ascend --push .                   # Ascend NPUs: A3 / 910C hosts are arm64
#
# podman builds the same: `podman build --format docker ...` (--format docker keeps the HEALTHCHECK,
# which OCI image configs drop), and for two platforms
# `podman build --platform linux/arm64,linux/amd64 --manifest <registry>/proctor:0.1.0-ascend ...`
# then `podman manifest push`.
#
# What has run: the cpu target, built with podman and run by scripts/container_check.sh (CI runs
# it): served over gRPC and HTTP with the host's scores, healthy, read-only root, no capabilities,
# exit 0 on SIGTERM with requests in flight. Without Docker Hub, its base image is given with
# --build-arg PYTHON_IMAGE=<a Debian bookworm image with python3, python3-venv> (the script makes
# one with mmdebstrap). The cuda and ascend targets have NOT been built: no GPU, NPU or arm64
# machine, and their base images are not reachable here.
#
# The images bind 0.0.0.0 and take their bearer token from PROCTOR_AUTH_TOKEN or
# PROCTOR_AUTH_TOKEN_FILE (a mounted secret); they set no opt-out, so without a token proctor
# refuses to serve on a non-loopback address. Running without auth is an explicit choice:
# -e PROCTOR_ALLOW_UNAUTHENTICATED=1.
#
# Every image: non-root user `proctor` (uid 10001), ports 50051 (gRPC) and 8000 (HTTP),
# HEALTHCHECK on GET /health/live, ENTRYPOINT proctor, CMD serve --config /etc/proctor/config.yaml.
# Mount the config at /etc/proctor/config.yaml (see deploy/config/) and the models where the
# config's model_path points (deploy/ uses /models).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
# vLLM-Omni's Ascend image: CANN + torch + torch-npu + vLLM + vllm-ascend + vLLM-Omni, validated
# together by upstream ("-a3" = Atlas A3, i.e. 910C; drop the suffix for A2 / 910B nodes).
# quay.io/ascend/vllm-ascend:<tag>-a3 (no vLLM-Omni) also works: the vllm-omni install below
# then adds it.
ARG ASCEND_BASE_IMAGE=quay.io/ascend/vllm-omni:v0.18.0-a3

# --------------------------------------------------------------------------------------------
# cpu: torch engine only.
# --------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION=2.13.0
# The index that serves PyTorch's CPU-only wheels (PyTorch's own "whl/cpu" index, or a copy of it);
# give it with --build-arg TORCH_INDEX_URL=... (required: a plain `torch` from the default index
# is the CUDA build, with several GB of nvidia-* wheels).
ARG TORCH_INDEX_URL=""
# A CA bundle for pip behind a TLS-inspecting proxy, at a path the build mounts (podman build
# -v host.crt:/path:ro --build-arg PIP_CERT=/path). Unset by default: pip's own bundle. Only
# this build stage sees it.
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# python3, not python: a base image made from Debian packages has no `python` command.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Same two steps as scripts/install.sh and CI: the CPU torch first (a plain `torch` would pull
# the multi-GB CUDA build), then the server extra, which then finds torch already satisfied.
RUN test -n "${TORCH_INDEX_URL}" || { echo "pass --build-arg TORCH_INDEX_URL=<PyTorch CPU wheel index>" >&2; exit 1; }
# An extra index, so torch's own dependencies still come from the default one: pip takes the
# highest version, and the CPU index's `2.13.0+cpu` sorts above the default index's `2.13.0`.
# The check after it fails the build if a CUDA build came in all the same.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --extra-index-url "${TORCH_INDEX_URL}" \
    && python -W ignore -c "import sys, torch; sys.exit(f'torch {torch.__version__} is a CUDA build' if torch.version.cuda else 0)"
WORKDIR /src
COPY . /src
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[server]" \
    && proctor --help > /dev/null

FROM ${PYTHON_IMAGE} AS cpu
LABEL org.opencontainers.image.title="proctor (cpu)" \
      org.opencontainers.image.description="Proctor teacher-scoring server, torch engine on CPU" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 proctor \
    && useradd --system --uid 10001 --gid proctor --create-home --home-dir /home/proctor \
       --shell /usr/sbin/nologin proctor \
    && mkdir -p /etc/proctor /models \
    && chown proctor:proctor /models
COPY --from=cpu-build /opt/venv /opt/venv
COPY deploy/config/cpu.yaml /etc/proctor/config.yaml
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/proctor \
    HF_HOME=/home/proctor/.cache/huggingface \
    PROCTOR_HEALTH_URL=http://127.0.0.1:8000/health/live
# Numeric, so that Kubernetes runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
WORKDIR /home/proctor
EXPOSE 50051 8000
# /health/live answers as soon as the process serves HTTP (models may still be loading; that
# is /health/ready's job), so a short start period is enough.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PROCTOR_HEALTH_URL'], timeout=4)"]
# SIGTERM starts proctor's graceful drain; give `docker stop` a long --time / stop_grace_period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["proctor"]
CMD ["serve", "--config", "/etc/proctor/config.yaml", "--host", "0.0.0.0"]

# --------------------------------------------------------------------------------------------
# cuda: vLLM + vLLM-Omni on an NVIDIA CUDA base (torch comes with vLLM's wheel, CUDA libraries
# with torch's; the base image brings the CUDA runtime layout the NVIDIA container toolkit expects).
# --------------------------------------------------------------------------------------------
FROM ${CUDA_BASE_IMAGE} AS cuda-base
ENV DEBIAN_FRONTEND=noninteractive
# gcc and python3-dev: Triton compiles small C launchers at run time. Unpinned apt versions on
# purpose: the distribution archive drops superseded versions; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev gcc libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# vLLM 0.32.0: the release proctor's vLLM adapter supports (its scoring pooler). vLLM-Omni's newest
# release (0.30.0) pins vLLM 0.30, which that adapter refuses: an Omni node builds with
# --build-arg VLLM_VERSION=0.30.0 --build-arg VLLM_OMNI_VERSION=0.30.0 (inference.name=vllm_omni;
# inference.name=vllm then refuses to start, naming the versions).
ARG VLLM_VERSION=0.32.0
ARG VLLM_OMNI_VERSION=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# vLLM-Omni's minor version tracks vLLM's: bump both together.
RUN pip install --no-cache-dir "vllm==${VLLM_VERSION}" ${VLLM_OMNI_VERSION:+"vllm-omni==${VLLM_OMNI_VERSION}"} \
    && pip freeze | grep -iE '^(torch|vllm|vllm-omni|vllm_omni|triton|xformers|flashinfer-python)==' \
       > /opt/engine-constraints.txt
WORKDIR /src
COPY . /src
# The constraints keep pip from swapping the engine stack while it resolves proctor's extras.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c /opt/engine-constraints.txt ".[server]" \
    && proctor --help > /dev/null

FROM cuda-base AS cuda
LABEL org.opencontainers.image.title="proctor (cuda)" \
      org.opencontainers.image.description="Proctor teacher-scoring server, vLLM / vLLM-Omni engines on NVIDIA GPUs" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 proctor \
    && useradd --system --uid 10001 --gid proctor --create-home --home-dir /home/proctor \
       --shell /usr/sbin/nologin proctor \
    && mkdir -p /etc/proctor /models \
    && chown proctor:proctor /models
COPY --from=cuda-build /opt/venv /opt/venv
COPY deploy/config/proctor.yaml /etc/proctor/config.yaml
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/proctor \
    HF_HOME=/home/proctor/.cache/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PROCTOR_HEALTH_URL=http://127.0.0.1:8000/health/live
# Numeric, so that Kubernetes runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
WORKDIR /home/proctor
EXPOSE 50051 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PROCTOR_HEALTH_URL'], timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["proctor"]
CMD ["serve", "--config", "/etc/proctor/config.yaml", "--host", "0.0.0.0", "--device", "cuda"]

# --------------------------------------------------------------------------------------------
# ascend: CANN + torch-npu + vLLM + vllm-ascend (+ vLLM-Omni) from the base image; proctor is
# installed into the base image's Python with that stack held fixed.
# --------------------------------------------------------------------------------------------
FROM ${ASCEND_BASE_IMAGE} AS ascend
LABEL org.opencontainers.image.title="proctor (ascend)" \
      org.opencontainers.image.description="Proctor teacher-scoring server, vLLM-Omni / vllm-ascend engines on Ascend NPUs" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG VLLM_OMNI_VERSION=0.18.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Hold the validated stack (torch, torch-npu, vLLM, vllm-ascend, Triton-Ascend) fixed; add
# vLLM-Omni only where the base image lacks it.
RUN python3 -m pip freeze \
    | grep -iE '^(torch|torch-npu|torch_npu|torchvision|torchaudio|vllm|vllm-ascend|vllm_ascend|vllm-omni|vllm_omni|triton-ascend|triton_ascend)==' \
    > /opt/engine-constraints.txt \
    && if ! grep -qiE '^vllm[-_]omni==' /opt/engine-constraints.txt; then \
         python3 -m pip install --no-cache-dir -c /opt/engine-constraints.txt "vllm-omni==${VLLM_OMNI_VERSION}"; \
       fi
COPY . /tmp/proctor-src
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir -c /opt/engine-constraints.txt "/tmp/proctor-src[server,npu]" \
    && rm -rf /tmp/proctor-src \
    && groupadd --system --gid 10001 proctor \
    && useradd --system --uid 10001 --gid proctor --create-home --home-dir /home/proctor \
       --shell /usr/sbin/nologin proctor \
    && if getent group HwHiAiUser > /dev/null; then usermod -aG HwHiAiUser proctor; fi \
    && mkdir -p /etc/proctor /models \
    && chown proctor:proctor /models \
    && command -v proctor
COPY --chmod=0755 deploy/docker/ascend-entrypoint.sh /usr/local/bin/ascend-entrypoint.sh
COPY deploy/config/proctor.yaml /etc/proctor/config.yaml
# The device nodes are group-owned by the host's HwHiAiUser group: give the container that
# gid as a supplementary group (compose group_add / k8s supplementalGroups; 1000 by default).
# Runtime caches and plog go under $HOME, which must be writable.
ENV PYTHONUNBUFFERED=1 \
    HOME=/home/proctor \
    HF_HOME=/home/proctor/.cache/huggingface \
    ASCEND_PROCESS_LOG_PATH=/home/proctor/ascend/log \
    ASCEND_CACHE_PATH=/home/proctor/ascend/cache \
    ASCEND_WORK_PATH=/home/proctor/ascend/work \
    VLLM_NO_USAGE_STATS=1 \
    PROCTOR_HEALTH_URL=http://127.0.0.1:8000/health/live
# Numeric, so that Kubernetes runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
WORKDIR /home/proctor
EXPOSE 50051 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PROCTOR_HEALTH_URL'], timeout=4)"]
STOPSIGNAL SIGTERM
# CANN's set_env.sh scripts must be sourced before Python starts; the wrapper does that and
# then execs `proctor "$@"`.
ENTRYPOINT ["/usr/local/bin/ascend-entrypoint.sh", "proctor"]
CMD ["serve", "--config", "/etc/proctor/config.yaml", "--host", "0.0.0.0", "--device", "npu"]
