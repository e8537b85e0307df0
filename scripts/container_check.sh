#!/usr/bin/env bash
# Builds the Dockerfile's `cpu` image with a daemonless engine (podman), runs it and checks it
# as a user would, on a Debian machine with root and no Docker daemon or Docker Hub: CI runs it
# as its own step (.ci/run). Prints each phase's seconds and the image size; exits 1 on the
# first failed check.
#
# What it checks, against a reference proctor served on the host from .venv (same sources):
#   1. the image's default command serves the tiny teacher (mounted at /models/teacher) with
#      a read-only root, all capabilities dropped and no-new-privileges; gRPC and HTTP answer
#      with the host's scores; a request without the bearer token is refused; the image's own
#      HEALTHCHECK (kept by --format docker) passes; writing to / fails; CapEff is 0;
#   2. SIGTERM with requests in flight: they finish with the host's scores, exit code 0;
#   3. the image without a token refuses to bind 0.0.0.0 (one line, exit != 0), where proctor
#      has that rule (`proctor serve --help` lists --allow-unauthenticated);
#   4. deploy/compose/compose.yaml, profile cpu, under podman-compose (PyPI): the teacher
#      serves the same scores, Debian's Prometheus scrapes it with deploy/compose/prometheus.yml
#      (the target pointed at the published port), the `verify` service exits 0, and
#      `podman-compose stop` drains it to exit 0. Grafana is not run (no Debian package).
#
# Needs: root, apt (podman runc mmdebstrap prometheus), PyPI, .venv (scripts/install.sh).
# Docker Hub is not needed: the base image is made from Debian packages with mmdebstrap and
# given as --build-arg PYTHON_IMAGE (the Dockerfile's default stays the official Python image).
# PyTorch's CPU wheel: TORCH_INDEX_URL when set, else the wheel this machine's pip resolves for
# torch==2.13.0, served on loopback as an index, if and only if it is a CPU build.
#
# Environment: PROCTOR_CHECK_DIR (scratch, kept; default a temp dir, removed), KEEP=1 keeps the
# image and the scratch dir, TORCH_INDEX_URL. The base image is kept (made once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
IMAGE=localhost/proctor:0.1.0-cpu
BASE=localhost/proctor-base:bookworm
OWN_WORK=0
[ -n "${PROCTOR_CHECK_DIR:-}" ] || OWN_WORK=1
WORK=${PROCTOR_CHECK_DIR:-$(mktemp -d)}
mkdir -p "$WORK"
NAME=proctor-check-$$
PIDS=()
T0=$SECONDS
phase() { echo "[container check $((SECONDS - T0))s] $*"; }

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  podman rm -f -t 0 "$NAME" "$NAME-refuse" >/dev/null 2>&1 || true
  if [ -n "${COMPOSE:-}" ]; then (cd deploy/compose && compose_env "$COMPOSE" --profile cpu down -t 5 >/dev/null 2>&1) || true; fi
  if [ "$OWN_WORK" = 1 ] && [ "${KEEP:-0}" != 1 ]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

[ -x "$PY" ] || { echo "container check: $PY missing; run scripts/install.sh first" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "container check: needs root (rootful podman, apt-get)" >&2; exit 1; }

# ---------------------------------------------------------------- engine and its settings
phase "install podman, runc, mmdebstrap, prometheus (Debian packages)"
# dnsname: compose services find each other by name (the verify service dials `teacher`) on
# podman's CNI network backend, which Debian's podman 4.3 uses.
if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v prometheus >/dev/null \
    || [ ! -x /usr/lib/cni/dnsname ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    podman runc mmdebstrap prometheus uidmap slirp4netns fuse-overlayfs ca-certificates \
    golang-github-containernetworking-plugin-dnsname >/dev/null
fi
# crun refuses this machine's hybrid cgroups (v1 + v2); runc runs there. Podman's default
# ulimits (nofile 1048576) exceed what the machine grants. Our own file, not /etc's.
cat > "$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$WORK/containers.conf

# ---------------------------------------------------------------- base image, torch wheel
phase "base image from Debian packages (mmdebstrap minbase bookworm + podman import)"
if ! podman image exists "$BASE"; then
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$WORK/base.tar"
  podman import -q "$WORK/base.tar" "$BASE" >/dev/null
  rm -f "$WORK/base.tar"
fi

torch_index=${TORCH_INDEX_URL:-}
if [ -z "$torch_index" ]; then
  mkdir -p "$WORK/torch-index/simple/torch"
  "$PY" -m pip download -q --no-deps --only-binary :all: torch==2.13.0 -d "$WORK/torch-index/simple/torch"
  wheel=$(ls "$WORK/torch-index/simple/torch")
  case "$wheel" in
    *+cpu*) ;;
    *) echo "container check: pip resolves $wheel for torch==2.13.0, not a CPU build; set TORCH_INDEX_URL" \
            "to a PyTorch CPU wheel index" >&2; exit 1 ;;
  esac
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$WORK/torch-index" >/dev/null 2>&1 &
  PIDS+=($!)
  torch_index=http://127.0.0.1:$port/simple
fi

# ---------------------------------------------------------------- build
phase "build the cpu target"
build_start=$SECONDS
cert_args=()
# pip inside the build trusts what the host trusts (a TLS-inspecting proxy's CA, if any).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cert_args=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro --build-arg PIP_CERT=/run/host-ca.crt)
fi
podman build -q --format docker --network host --target cpu -t "$IMAGE" \
  --build-arg PYTHON_IMAGE="$BASE" --build-arg TORCH_INDEX_URL="$torch_index" "${cert_args[@]}" . >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
phase "built in $((SECONDS - build_start))s; image $IMAGE is $((size / 1000000)) MB"
# OCI image configs have no HEALTHCHECK; --format docker keeps it.
grep -q PROCTOR_HEALTH_URL <<<"$(podman image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")" \
  || { echo "container check: the image has no HEALTHCHECK" >&2; exit 1; }

# ---------------------------------------------------------------- model, token, reference
mkdir -p "$WORK/models"
"$ROOT/.venv/bin/proctor" make-tiny-model "$WORK/models/teacher" >/dev/null
chmod -R a+rX "$WORK/models"
TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(16))')
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
REF_G=$(free_port); REF_H=$(free_port)
"$ROOT/.venv/bin/proctor" serve --model "$WORK/models/teacher" --host 127.0.0.1 \
  --grpc-port "$REF_G" --http-port "$REF_H" >"$WORK/reference.log" 2>&1 &
PIDS+=($!)
"$PY" scripts/container_check.py wait "http://127.0.0.1:$REF_H" --timeout 300
check() { "$PY" scripts/container_check.py "$@"; }

# ---------------------------------------------------------------- 1. the image as built
phase "run: default command, read-only root, all capabilities dropped"
G=$(free_port); H=$(free_port)
podman run -d --name "$NAME" --read-only --cap-drop ALL --security-opt no-new-privileges \
  -p "127.0.0.1:$G:50051" -p "127.0.0.1:$H:8000" \
  -v "$WORK/models:/models:ro" -e PROCTOR_AUTH_TOKEN="$TOKEN" "$IMAGE" >/dev/null 2>>"$WORK/podman.log"
check wait "http://127.0.0.1:$H" --timeout 300 || { podman logs "$NAME" | tail -20; exit 1; }
check compare "127.0.0.1:$G" "http://127.0.0.1:$H" "127.0.0.1:$REF_G" --token "$TOKEN"
podman healthcheck run "$NAME" >/dev/null || { echo "container check: HEALTHCHECK failed" >&2; exit 1; }
echo "health: the image's HEALTHCHECK passes ($(podman inspect --format '{{.State.Health.Status}}' "$NAME"))"
if podman exec "$NAME" sh -c 'touch /opt/venv/x || touch /x' 2>/dev/null; then
  echo "container check: the root filesystem is writable" >&2; exit 1
fi
cap=$(podman exec "$NAME" sh -c "grep CapEff /proc/1/status | cut -f2")
[ "$cap" = 0000000000000000 ] || { echo "container check: CapEff $cap, expected none" >&2; exit 1; }
echo "confinement: root read-only (write refused), CapEff $cap, uid $(podman exec "$NAME" id -u)"

phase "SIGTERM with requests in flight"
check drain "127.0.0.1:$G" "127.0.0.1:$REF_G" --token "$TOKEN" --container "$NAME"
podman rm -f "$NAME" >/dev/null 2>>"$WORK/podman.log"

# ---------------------------------------------------------------- 2. no token, non-loopback
serve_help=$(podman run --rm -e COLUMNS=400 "$IMAGE" serve --help 2>>"$WORK/podman.log")  # wide: rich cuts names
if grep -q -- --allow-unauthenticated <<<"$serve_help"; then
  set +e
  podman run --rm --name "$NAME-refuse" -v "$WORK/models:/models:ro" "$IMAGE" >"$WORK/refuse.out" 2>&1
  rc=$?
  set -e
  # podman's own complaint (no systemd for healthcheck timers) is not the container's output.
  out=$(grep -v 'level=error msg=".*systemd' "$WORK/refuse.out")
  lines=$(printf '%s\n' "$out" | grep -c .)
  if [ "$rc" = 0 ] || [ "$lines" != 1 ]; then
    echo "container check: without a token the image should refuse in one line; exit $rc:" >&2
    printf '%s\n' "$out" >&2; exit 1
  fi
  echo "auth: without a token the image refuses to serve on 0.0.0.0 (exit $rc): $out"
else
  echo "auth: not checked: this proctor has no non-loopback token rule yet (serve --allow-unauthenticated)"
fi

# ---------------------------------------------------------------- 3. compose + Prometheus
phase "compose (podman-compose) + Prometheus"
if [ ! -x "$WORK/compose-venv/bin/podman-compose" ]; then
  python3 -m venv "$WORK/compose-venv"
  "$WORK/compose-venv/bin/python" -m pip install -q "podman-compose==1.6.0"
fi
COMPOSE=$WORK/compose-venv/bin/podman-compose
install -m 0640 -g 10001 /dev/stdin "$WORK/token" <<<"$TOKEN"
CG=$(free_port); CH=$(free_port)
# The compose file asks for nofile 65536 and unlimited memlock (what a GPU node wants); a machine
# may grant less (this CI machine: nofile 20000, memlock 8 MiB), and runc then refuses to start.
# The one change made to the project's file: those limits lowered to the machine's, and nproc
# given (podman sets 1048576 once any ulimit is given, over containers.conf's default).
hard_l=$(ulimit -Hl)
if [ "$hard_l" = unlimited ]; then memlock=-1; else memlock=$((hard_l * 1024)); fi
cat > "$WORK/compose.limits.yaml" <<EOF
services:
  teacher-cpu:
    ulimits:
      nofile: {soft: $(ulimit -Hn), hard: $(ulimit -Hn)}
      memlock: $memlock
      nproc: {soft: 32768, hard: 32768}
EOF
compose_env() {
  env PROCTOR_MODELS_DIR="$WORK/models" PROCTOR_TOKEN_FILE="$WORK/token" PROCTOR_IMAGE_CPU="$IMAGE" \
    PROCTOR_GRPC_PORT="127.0.0.1:$CG" PROCTOR_HTTP_PORT="127.0.0.1:$CH" "$1" -f compose.yaml -f "$WORK/compose.limits.yaml" "${@:2}"
}
(cd deploy/compose && compose_env "$COMPOSE" --profile cpu up -d --no-deps teacher-cpu >"$WORK/compose-up.log" 2>&1) \
  || { cat "$WORK/compose-up.log"; exit 1; }
teacher=$(podman ps --filter label=com.docker.compose.service=teacher-cpu --format '{{.Names}}' | head -1)
check wait "http://127.0.0.1:$CH" --timeout 300 || { podman logs "$teacher" | tail -20; exit 1; }
check compare "127.0.0.1:$CG" "http://127.0.0.1:$CH" "127.0.0.1:$REF_G" --token "$TOKEN"

P=$(free_port)
sed "s/teacher:8000/127.0.0.1:$CH/; s/localhost:9090/127.0.0.1:$P/; s/scrape_interval: 15s/scrape_interval: 2s/" \
  deploy/compose/prometheus.yml >"$WORK/prometheus.yml"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prometheus-data" \
  --web.listen-address="127.0.0.1:$P" >"$WORK/prometheus.log" 2>&1 &
PIDS+=($!)
check prom "http://127.0.0.1:$P" --timeout 120

(cd deploy/compose && compose_env "$COMPOSE" --profile cpu run --rm --no-deps verify) >"$WORK/verify.log" 2>&1 \
  || { echo "container check: compose's verify service failed:" >&2; cat "$WORK/verify.log" >&2; exit 1; }
echo "verify: compose's verify service (proctor verify --target grpc://teacher:50051) exits 0:"
grep -v -e 'level=' -e 'TTY' "$WORK/verify.log" | sed 's/^/    /'

(cd deploy/compose && compose_env "$COMPOSE" --profile cpu stop teacher-cpu >/dev/null 2>&1)
code=$(podman inspect --format '{{.State.ExitCode}}' "$teacher")
[ "$code" = 0 ] || { echo "container check: compose stop: teacher exited $code" >&2; exit 1; }
echo "compose: stop (SIGTERM) drains the teacher to exit code 0"
(cd deploy/compose && compose_env "$COMPOSE" --profile cpu down -t 5 >/dev/null 2>&1) || true
COMPOSE=

[ "${KEEP:-0}" = 1 ] || podman rmi -f "$IMAGE" >/dev/null 2>&1 || true
phase "all container checks passed"
