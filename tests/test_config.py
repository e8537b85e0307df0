"""Config: verl's distillation block as-is, proctor's server block, every problem reported."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from proctor.server.cli.main import app
from proctor.server.config import (
    ConfigError,
    check_config_command,
    load_config,
    load_plan,
    load_server_config,
)

from support.configs import cpu_config, torch_teacher, write_config

# verl's multi-teacher example (examples/on_policy_distillation_trainer/run_qwen3_8b_mopd_fsdp.sh),
# written as YAML with its Hydra `+` overrides, next to the trainer sections verl reads.
VERL_MOPD = """
actor_rollout_ref:
  rollout: {name: vllm, prompt_length: 1024, response_length: 2048, dtype: bfloat16}
trainer: {nnodes: 1, n_gpus_per_node: 8}
distillation:
  enabled: True
  n_gpus_per_node: 8
  nnodes: 1
  teacher_key: data_source
  +teacher_models.gsm8k.key: openai/gsm8k
  +teacher_models.gsm8k.model_path: Qwen/Qwen3-32B
  +teacher_models.gsm8k.num_replicas: 2
  +teacher_models.gsm8k.inference.tensor_model_parallel_size: 2
  +teacher_models.gsm8k.inference.max_model_len: 3073
  +teacher_models:
    geo3k:
      key: hiyouga/geometry3k
      model_path: Qwen/Qwen3-VL-32B-Instruct
      num_replicas: 2
      inference:
        _target_: verl.workers.config.RolloutConfig
        name: ${oc.select:actor_rollout_ref.rollout.name}
        dtype: ${oc.select:actor_rollout_ref.rollout.dtype}
        tensor_model_parallel_size: 2
        prompt_length: ${oc.select:actor_rollout_ref.rollout.prompt_length}
        response_length: ${oc.select:actor_rollout_ref.rollout.response_length}
        temperature: ${oc.select:actor_rollout_ref.rollout.temperature}
        enforce_eager: true
        max_num_seqs: 1024
        engine_kwargs: {vllm: {max_logprobs: 64, "a.b": 1}}
  distillation_loss:
    _target_: verl.workers.config.DistillationLossConfig
    loss_mode: k1
    topk: 64
    use_policy_gradient: True
server: {device: cuda}
"""


def _write(tmp_path, text: str):
    path = tmp_path / "verl.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_verl_multi_teacher_yaml_with_hydra_plus_keys_loads_unchanged(tmp_path):
    plan = load_plan(_write(tmp_path, VERL_MOPD), files_must_exist=False)
    gsm8k, geo = plan.teachers["gsm8k"], plan.teachers["geo3k"]
    assert (gsm8k.key, geo.key) == ("openai/gsm8k", "hiyouga/geometry3k")
    assert gsm8k.spec.model_path == "Qwen/Qwen3-32B" and gsm8k.per_replica == 2
    # interpolations resolved against the same file; absent ones fall back to defaults
    assert geo.spec.name == "vllm" and geo.spec.dtype == "bfloat16"
    assert (geo.spec.inference["prompt_length"], geo.spec.inference["response_length"]) == (1024, 2048)
    assert "temperature" not in geo.spec.inference  # ${oc.select:...} of nothing: left to the default
    assert geo.spec.inference["engine_kwargs"] == {"vllm": {"max_logprobs": 64, "a.b": 1}}  # user dict kept as is
    assert geo.spec.max_topk == 64
    assert [g.local_devices for g in plan.placement.groups] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert any("actor_rollout_ref, trainer" in note for note in plan.notes)


def test_verl_default_distillation_block_autofills_the_pool_with_verl_defaults(tmp_path):
    # verl's trainer/config/distillation/distillation.yaml, with a model path set.
    text = """
    distillation:
      _target_: verl.workers.config.DistillationConfig
      defaults: [_self_]
      enabled: true
      n_gpus_per_node: 8
      nnodes: 1
      teacher_models:
        teacher_model:
          _target_: verl.workers.config.DistillationTeacherModelConfig
          key: null
          model_path: /models/teacher
          num_replicas: 0
          inference:
            _target_: verl.workers.config.RolloutConfig
            name: ${oc.select:actor_rollout_ref.rollout.name}
            gpu_memory_utilization: 0.5
            enforce_eager: true
            data_parallel_size: 1
            expert_parallel_size: 1
            tensor_model_parallel_size: 2
            max_num_batched_tokens: 8192
            max_model_len: null
            enable_chunked_prefill: true
            skip_tokenizer_init: true
            prompt_length: ${oc.select:actor_rollout_ref.rollout.prompt_length}
            response_length: ${oc.select:actor_rollout_ref.rollout.response_length}
      teacher_key: data_source
    server: {device: cuda}
    """
    plan = load_plan(_write(tmp_path, text), files_must_exist=False)
    (teacher,) = plan.teachers.values()
    assert teacher.name == "teacher_model" and teacher.spec.name == "vllm"
    assert len(plan.placement.groups) == 4  # 8 devices / TP 2
    assert teacher.spec.inference["prompt_length"] == 512  # verl's RolloutConfig default


def test_default_teacher_model_entry_beside_others_is_an_error_that_says_what_to_rename(tmp_path):
    teachers = {
        "teacher_model": {**torch_teacher("/m/a", key="openai/gsm8k")},
        "teacher_model2": {**torch_teacher("/m/b", key="hiyouga/geometry3k")},
    }
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, cpu_config(teachers, devices=2)))
    (problem,) = err.value.problems
    assert "distillation.teacher_models.teacher_model:" in problem and "silently drops" in problem
    assert "rename it" in problem and "teacher_model1" in problem


def test_untouched_default_teacher_model_beside_others_is_ignored_as_verl_does(tmp_path):
    teachers = {
        "teacher_model": {"model_path": None, "num_replicas": 0},
        "a": torch_teacher("/m/a", key="ka"),
        "b": torch_teacher("/m/b", key="kb"),
    }
    plan = load_plan(write_config(tmp_path, cpu_config(teachers, devices=2)), files_must_exist=False)
    assert list(plan.teachers) == ["a", "b"]


def test_unknown_keys_are_reported_with_the_nearest_known_name(tmp_path):
    doc = cpu_config({"t": torch_teacher("/m/a")}, devices=1)
    doc["distillation"]["teacher_models"]["t"]["inference"]["tensor_model_paralel_size"] = 1
    doc["distillation"]["teacher_modles"] = {}
    doc["server"]["max_queu_requests"] = 3
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, doc))
    assert sorted(err.value.problems) == [
        "distillation.teacher_models.t.inference.tensor_model_paralel_size: unknown key "
        "(did you mean tensor_model_parallel_size?)",
        "distillation.teacher_modles: unknown key (did you mean teacher_models?)",
        "server.max_queu_requests: unknown key (did you mean max_queue_requests?)",
    ]


def test_check_config_lists_every_problem_not_just_the_first(tmp_path):
    teachers = {
        "math": {**torch_teacher("/m/a", key="math", num_replicas=3), "nmu_replicas": 1},
        "code": torch_teacher("/m/b", key="code", num_replicas=2),
    }
    teachers["math"]["inference"]["max_model_len"] = 100  # < 64 + 64 + 1
    path = write_config(tmp_path, cpu_config(teachers, devices=4))
    out = io.StringIO()
    assert check_config_command(path, out=out) == 1
    text = out.getvalue()
    assert "3 problem(s)" in text
    assert "teacher_models.math.nmu_replicas: unknown key (did you mean num_replicas?)" in text
    assert "max_model_len is 100" in text and "at least 129" in text
    assert "teachers need 5 device(s)" in text and "pool of 4" in text


def test_check_config_cli_prints_the_resolved_plan(tmp_path, tiny_model_dir):
    teachers = {"t": torch_teacher(tiny_model_dir, num_replicas=None)}
    path = write_config(tmp_path, cpu_config(teachers, devices=3))
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 0, result.output
    assert "teacher t: key 't', engine torch" in result.output
    assert "teacher t: 3 replicas of 1 device each" in result.output
    assert "t-2: t on node 0 [2]" in result.output


def test_check_config_cli_exits_1_on_problems(tmp_path):
    path = write_config(tmp_path, {"distillation": {"nnodes": 0, "teacher_models": {}}})
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 1
    assert "distillation.nnodes is 0" in result.output and "no teacher configured" in result.output


def test_several_teachers_need_distinct_keys(tmp_path):
    teachers = {"a": torch_teacher("/m/a"), "b": torch_teacher("/m/b", key="k"), "c": torch_teacher("/m/c", key="k")}
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, cpu_config(teachers, devices=3)))
    assert any(p.startswith("distillation.teacher_models.a.key: required") for p in err.value.problems)
    assert any("teacher_models.c.key: 'k' is also the key of teacher 'b'" in p for p in err.value.problems)


def test_hidden_state_loss_on_omni_needs_chunked_prefill_off_and_a_whole_sequence_per_step(tmp_path):
    teacher = torch_teacher("/m/a")
    teacher["inference"].update(name="vllm_omni", max_num_batched_tokens=100)
    doc = cpu_config({"t": teacher}, devices=1)
    doc["distillation"]["distillation_loss"] = {"loss_mode": "full_jsd", "use_policy_gradient": False}
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, doc))
    assert any(p.startswith("distillation.teacher_models.t.inference.enable_chunked_prefill is true") for p in err.value.problems)
    assert any("inference.max_num_batched_tokens is 100" in p and "at least 128" in p for p in err.value.problems)


def test_hidden_state_loss_on_vllm_takes_its_settings_as_they_are(tmp_path):
    # vLLM's scoring pooler keeps each prefill chunk's outputs: any step size serves hidden states.
    teacher = torch_teacher("/m/a")
    teacher["inference"].update(name="vllm", max_num_batched_tokens=100)
    doc = cpu_config({"t": teacher}, devices=1)
    doc["distillation"]["distillation_loss"] = {"loss_mode": "full_jsd", "use_policy_gradient": False}
    config = load_config(write_config(tmp_path, doc))
    assert config.distillation.teacher_models["t"].inference.max_num_batched_tokens == 100


def test_hidden_states_false_with_a_hidden_state_loss_is_refused(tmp_path):
    teacher = torch_teacher("/m/a")
    teacher["inference"]["hidden_states"] = False
    doc = cpu_config({"t": teacher}, devices=1)
    doc["distillation"]["distillation_loss"] = {"loss_mode": "full_jsd", "use_policy_gradient": False}
    with pytest.raises(ConfigError, match=r"teacher_models\.t\.inference\.hidden_states is false"):
        load_config(write_config(tmp_path, doc))


def test_hidden_states_setting_is_accepted_and_decided_once_in_the_plan(tmp_path, tiny_model_dir):
    from proctor.server.config import load_plan

    for value, expected in ((False, False), (True, True), (None, True)):
        teacher = torch_teacher(tiny_model_dir)
        if value is not None:
            teacher["inference"]["hidden_states"] = value
        plan = load_plan(write_config(tmp_path, cpu_config({"t": teacher}, devices=1)))
        assert plan.teachers["t"].spec.hidden_states is expected
        assert "hidden_states" not in plan.teachers["t"].spec.inference


def test_vllm_max_logprobs_below_the_loss_topk_is_refused(tmp_path):
    teacher = torch_teacher("/m/a")
    teacher["inference"].update(name="vllm", engine_kwargs={"vllm": {"max_logprobs": 4}})
    doc = cpu_config({"t": teacher}, devices=1)
    with pytest.raises(ConfigError, match=r"teacher_models\.t\.inference\.engine_kwargs\.vllm\.max_logprobs is 4, below the top-k served \(8\)"):
        load_config(write_config(tmp_path, doc))


def test_several_nodes_without_ray_are_refused(tmp_path):
    doc = cpu_config({"t": torch_teacher("/m/a", num_replicas=None)}, devices=1)
    doc["distillation"]["nnodes"] = 2
    with pytest.raises(ConfigError, match=r"server\.ray\.enabled is false"):
        load_config(write_config(tmp_path, doc))


def test_server_block_becomes_server_options(tmp_path, tiny_model_dir):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    server = {
        "host": "0.0.0.0", "grpc_port": 6000, "http_port": 6001, "auth_token_file": str(token),
        "tls": {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem"),
                "client_ca_file": str(tmp_path / "ca.pem")},
        "max_queue_requests": 7, "max_queue_tokens": 999, "drain_grace_s": 3, "max_message_bytes": 8 << 20,
        "routing_policy": "round_robin", "open_paths": ["/health/live"], "metrics_port": 9100,
    }
    doc = cpu_config({"t": torch_teacher(tiny_model_dir)}, devices=1, server=server)
    router, options = load_server_config(write_config(tmp_path, doc), host="127.0.0.1")
    assert options.host == "127.0.0.1" and (options.grpc_port, options.http_port) == (6000, 6001)
    assert options.auth_token == "s3cret"
    assert (options.tls_cert_file, options.tls_client_ca_file) == (str(tmp_path / "cert.pem"), str(tmp_path / "ca.pem"))
    assert (options.limits.max_queue_requests, options.limits.max_queue_tokens) == (7, 999)
    assert (options.drain_grace_s, options.max_message_bytes) == (3, 8 << 20)
    assert options.open_paths == ("/health/live",) and options.metrics_port == 9100
    teacher = router.route("")
    assert teacher.policy == "round_robin" and [r.replica_id for r in teacher.replicas] == ["t-0"]


def test_missing_files_stop_serve_but_are_only_listed_in_check(tmp_path):
    doc = cpu_config({"t": torch_teacher("/nope/model")}, devices=1, server={"auth_token_file": "/nope/token"})
    path = write_config(tmp_path, doc)
    missing = load_plan(path, files_must_exist=False).missing_here
    assert any("/nope/token" in n for n in missing) and any("/nope/model" in n for n in missing)
    with pytest.raises(ConfigError) as err:
        load_server_config(path)
    assert [p.split(" ")[0] for p in err.value.problems] == [
        "distillation.teacher_models.t.model_path", "server.auth_token_file:"
    ]


def test_type_errors_name_the_field(tmp_path):
    doc = cpu_config({"t": torch_teacher("/m/a", num_replicas=-1)}, devices=1, server={"grpc_port": "x"})
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, doc))
    fields = [p.split(":")[0] for p in err.value.problems]
    assert fields == ["distillation.teacher_models.t.num_replicas", "server.grpc_port"]


EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_pass_check_config(path, tmp_path, tiny_model_dir):
    document = yaml.safe_load(path.read_text())
    for teacher in document["distillation"].get("teacher_models", {}).values():
        if str(teacher.get("model_path", "")).startswith("/tmp/"):  # placeholders for local checkpoints
            teacher["model_path"] = str(tiny_model_dir)
    assert check_config_command(write_config(tmp_path, document), out=io.StringIO()) == 0


def test_config_replicas_start_together_in_a_fresh_process(tmp_path, tiny_model_dir):
    """Several torch replicas load concurrently on worker threads in a process that has not yet
    imported transformers (as `proctor serve --config` does): none may fail on a lazy import."""
    path = write_config(tmp_path, cpu_config({"t": torch_teacher(tiny_model_dir, num_replicas=None)}, devices=3))
    script = (
        "import asyncio, sys\n"
        "from proctor.server.config import load_server_config\n"
        "router, _ = load_server_config(sys.argv[1])\n"
        "teacher = router.route('')\n"
        "asyncio.run(teacher.start())\n"
        "print('healthy', len(teacher.healthy()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("healthy 3")


def _serve(*args: str) -> subprocess.CompletedProcess:
    """`proctor serve ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_serve_with_a_bad_config_prints_its_problems_not_a_traceback(tmp_path):
    broken = _write(tmp_path, "distillation:\n  teacher_models:\n    a: {model_path: /nope\n")
    done = _serve("--config", str(broken))
    assert done.returncode == 1 and "Traceback" not in done.stderr and "ConfigError" not in done.stderr, done.stderr
    # The file and the line (1-based) of the YAML error, never PyYAML's "<unicode string>".
    assert f"{broken}, line 4, column 1: not valid YAML: expected ',' or '}}'" in done.stderr, done.stderr
    assert "<unicode string>" not in done.stderr and "started at line 3" in done.stderr
    missing = write_config(tmp_path, cpu_config({"t": torch_teacher("/nope/teacher")}, devices=1))
    done = _serve("--config", str(missing))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[0] == f"{missing}: 1 problem(s):", done.stderr
    assert "model_path '/nope/teacher' does not exist" in done.stderr
    assert "`proctor make-tiny-model /nope/teacher [--seed N]`" in done.stderr


def test_serve_with_a_missing_model_directory_says_so_in_one_line(tmp_path):
    done = _serve("--model", str(tmp_path / "teacher"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"proctor: cannot serve: model_path '{tmp_path / 'teacher'}' does not exist: fix the path, or put a model "
        f"there first (a Hugging Face model: `hf download <org>/<name> --local-dir {tmp_path / 'teacher'}`, or set model_path "
        f"to the id itself; "
        f"a tiny random test teacher: `proctor make-tiny-model {tmp_path / 'teacher'} [--seed N]`)"]


def test_shared_slots_without_a_readable_architecture_say_so_plainly(tmp_path):
    teachers = {name: torch_teacher(f"/nope/{name}", key=name, num_replicas=None) for name in ("math", "code", "chat")}
    with pytest.raises(ConfigError) as err:
        load_plan(write_config(tmp_path, cpu_config(teachers, devices=2)), files_must_exist=False)
    assert err.value.problems == [
        "placement: 3 teachers (math, code, chat) but room for only 2 replicas (1 device each): the teachers can "
        "take turns on them, swapping weights, only when all have one architecture, and the architecture of math, "
        "code, chat cannot be read (no config.json at its model_path yet); fix that, or grow the pool "
        "(n_gpus_per_node × nnodes), or give each teacher num_replicas"]


def test_serve_help_shows_the_address_and_port_defaults_uncut():
    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for shown in ("--host <str> Address to bind [default: 127.0.0.1; 0.0.0.0 accepts other machines]",
                  "--grpc-port <int> gRPC port [default: 50051; 0: any free port]",
                  "--http-port <int> HTTP port [default: 8000; 0: any free port]",
                  "--health-check-interval-s <float>"):
        assert shown in text, done.stdout
    assert "…" not in done.stdout


def test_serve_on_a_port_in_use_says_so_in_one_line():
    """A taken gRPC or HTTP port is one line naming the address, the transport and the setting."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for transport, flags in (("gRPC", ["--grpc-port", str(port), "--http-port", "0"]),
                                 ("HTTP", ["--grpc-port", "0", "--http-port", str(port)])):
            done = _serve(*flags)
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            setting = "grpc_port" if transport == "gRPC" else "http_port"
            assert done.stderr.strip().splitlines()[-1].startswith(
                f"proctor: cannot serve: 127.0.0.1:{port} ({transport}) cannot be bound ("), done.stderr
            assert f"choose another port (--{setting.replace('_', '-')} / server.{setting}; 0: any free port)" \
                in done.stderr


def test_the_command_list_shows_every_summary_whole():
    done = subprocess.run([sys.executable, "-m", "proctor.server.cli.main", "--help"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    commands = done.stdout[done.stdout.index("Commands:"):]
    assert "make-tiny-model" in commands and "verify" in commands
    assert "..." not in commands and "…" not in commands, commands


def test_check_config_says_what_serving_here_would_refuse(tmp_path):
    """A whole plan naming a model directory that is not on this machine: check-config says so
    in its first line (serve refuses the same file) and still exits 0 (configs are checked elsewhere)."""
    path = write_config(tmp_path, cpu_config({"t": torch_teacher("/nope/teacher")}, devices=1))
    out = io.StringIO()
    assert check_config_command(path, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == f"{path}: OK as a plan; `proctor serve` on this machine would refuse it, 1 file(s) it names are not here:"
    assert lines[1].startswith("  - distillation.teacher_models.t.model_path '/nope/teacher' does not exist")
    assert "replicas: a worker process each, on this machine" in out.getvalue()
