"""The `proctor` command: serve a teacher, score from the shell, verify a deployment's replicas,
build the tiny teacher, demo.

With `trainer_side` (the trainer-side commands, `verify` and `demo`, registered here) this is
the one place that may compose the server and the trainer side: those commands import the client
and `proctor.trainer_adapter` inside their bodies only, so the server package itself never
depends on the client.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from proctor.server.cli import trainer_side
from proctor.server.front.auth import check_exposure
from proctor.server.front.settings import DEFAULTS, ServerOptions

if TYPE_CHECKING:  # the server's parts are imported by the commands that use them, not at start-up
    from proctor.server.config.plan import ServingPlan
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.fleet.routing import Router

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"max_content_width": 120},
                  help="Proctor: teacher scoring for on-policy distillation.")


class _PlainUsage(typer.core.TyperCommand):
    """A usage line naming a required argument `OUT_DIR`, not typer's `{OUT_DIR}` (an unfilled template?)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("proctor").setLevel(logging.INFO)


def _parse_pairs(items: list[str], flag: str, form: str = "KEY=VALUE") -> dict[str, str]:
    """KEY=VALUE items of a repeatable flag into a dict of strings."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{flag} expects {form}, got {item!r}")
        pairs[key] = value
    return pairs


def _parse_settings(items: list[str]) -> dict:
    """KEY=VALUE pairs into a dict; values are JSON when they parse as JSON, else strings."""
    import json

    settings: dict = {}
    for key, value in _parse_pairs(items, "--inference").items():
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def _refuse_unsupported_versions(engines: list[str]) -> None:
    """Exit 1 with one line on stderr (installed and supported release, what to install) when a
    component the engines need is outside the supported-version table (pyproject.toml), rather
    than fail later inside a replica with a third-party traceback."""
    from proctor.proto.versions import UnsupportedVersion, check_engines

    try:
        check_engines(engines)
    except UnsupportedVersion as exc:
        typer.echo(f"proctor: cannot serve: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def serve(
    model: str | None = typer.Option(None, metavar="DIR|ORG/NAME", help="A model directory or Hugging Face id (resolved as vLLM does: the hub cache, downloaded there unless HF_HUB_OFFLINE=1; default: the built-in tiny teacher)."),
    engine: str = typer.Option("torch", help="torch | vllm | vllm_omni"),
    config: Path | None = typer.Option(None, help="YAML with verl's `distillation:` block and a `server:` block."),
    host: str | None = typer.Option(None, help="Address to bind [default: 127.0.0.1; 0.0.0.0 accepts other machines]."),
    grpc_port: int | None = typer.Option(None, help=f"gRPC port [default: {DEFAULTS.grpc_port}; 0: any free port]."),
    http_port: int | None = typer.Option(None, help=f"HTTP port [default: {DEFAULTS.http_port}; 0: any free port]."),
    device: str = typer.Option("cpu", help="cpu | cuda[:N] | npu[:N]"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16"),
    max_topk: int = typer.Option(64, help="Largest top-k a request may ask for."),
    max_model_len: int | None = typer.Option(None, help="Longest sequence (default: the model's)."),
    replicas: int = typer.Option(1, help="Replicas of the teacher (each in a replica worker process of its own)."),
    health_check_interval_s: float = typer.Option(5.0, help="Seconds between health sweeps of the replicas."),
    startup_timeout_s: float = typer.Option(1800.0, help="Seconds a replica may take to start before it fails with its log tail."),
    inference: list[str] = typer.Option([], "--inference", metavar="KEY=VALUE", help="Engine setting KEY=VALUE (value parsed as JSON when it can be), e.g. gpu_memory_utilization=0.2; repeatable."),
    teacher_name: str = typer.Option("default", help="Name (and routing key) of the teacher."),
    student_tokenizer: list[str] = typer.Option([], "--student-tokenizer", metavar="KEY=DIR", help="A student tokenizer KEY=DIR that "
                                                "aligned requests may name (loaded at start); repeatable."),
    auth_token_file: Path | None = typer.Option(None, help="File holding the bearer token required on scoring calls."),
    allow_unauthenticated: bool = typer.Option(False, "--allow-unauthenticated", envvar="PROCTOR_ALLOW_UNAUTHENTICATED", help="Serve a non-loopback --host with no auth token (refused otherwise)."),
    max_queue_requests: int = typer.Option(DEFAULTS.limits.max_queue_requests,
                                           help="Requests admitted per teacher (running + waiting) before 429s."),
    max_queue_tokens: int = typer.Option(DEFAULTS.limits.max_queue_tokens, help="Tokens admitted per teacher before 429s."),
    verbose: bool = typer.Option(True, help="Log at INFO."),
    switch_interval_ms: float = typer.Option(
        0.5,
        help="Python's GIL switch interval. The event loop and the engine thread share the GIL; "
        "Python's 5 ms default leaves requests waiting behind the engine's Python (bench/serve_overhead.py).",
    ),
) -> None:
    """Serve a teacher over gRPC and HTTP until SIGTERM (then drain and exit 0)."""
    from proctor.server.common.progress_bars import quiet_bars_in_logs

    quiet_bars_in_logs()  # before a model loads here or in a replica worker (they inherit it)
    plan = None if config is None else _plan_or_exit(config)
    # Before anything is built or imported for the engines: their components' releases.
    _refuse_unsupported_versions([engine] if plan is None else [t.spec.name for t in plan.teachers.values()])

    _logging(verbose)
    students = _parse_pairs(student_tokenizer, "--student-tokenizer", "KEY=DIR")
    if plan is not None:
        router, options = _config_router(plan, host=host, grpc_port=grpc_port, http_port=http_port)
    else:
        from proctor.server.config import single_teacher_router
        from proctor.server.engines.base import EngineConfigError

        try:  # a missing --model directory, a bad --inference value (the drift check's, say)
            spec = _flag_spec(model, engine=engine, device=device, dtype=dtype, max_topk=max_topk,
                              max_model_len=max_model_len, inference=inference, startup_timeout_s=startup_timeout_s,
                              replicas=replicas)
            router = single_teacher_router(spec, name=teacher_name, replicas=replicas,
                                           health_check_interval_s=health_check_interval_s)
        except EngineConfigError as exc:
            typer.echo(f"proctor: cannot serve: {exc}", err=True)
            raise typer.Exit(1) from None
        options = _flag_options(host=host, grpc_port=grpc_port, http_port=http_port, auth_token_file=auth_token_file,
                                max_queue_requests=max_queue_requests, max_queue_tokens=max_queue_tokens)
    options.student_tokenizers.update(students)  # the flags' beside (or over) the config file's
    sys.exit(_serve_until_stopped(router, options, switch_interval_ms=switch_interval_ms, open_ok=allow_unauthenticated))


def _plan_or_exit(config: Path) -> ServingPlan:
    """The config file's plan; on a problem, the problems as `check-config` lists them (on
    stderr, no traceback) and exit 1. The model directories must exist here, not only in the
    check: the image's default command fails this way when nothing is mounted at the path.
    Teachers from Megatron checkpoints are converted (or found in the cache) here, before any
    replica starts, so a checkpoint that cannot be served fails the start in one line."""
    from proctor.server.config import ConfigError, load_plan, print_problems
    from proctor.server.config.builder import convert_checkpoints

    try:
        return convert_checkpoints(load_plan(config))
    except ConfigError as exc:
        print_problems(config, exc, out=sys.stderr)
        raise typer.Exit(1) from None


def _config_router(plan: ServingPlan, *, host: str | None, grpc_port: int | None,
                   http_port: int | None) -> tuple[Router, ServerOptions]:
    """The router and server options a config file's plan describes; ports given on the
    command line win over the config file's server block."""
    from proctor.server.config import build_router, server_options
    from proctor.server.engines.base import EngineConfigError
    from proctor.server.engines.checks import check_device

    try:
        check_device(plan.device_kind)  # here, not in check-config: a plan may be checked off its machine
        router, options = build_router(plan), server_options(plan, host=host)
    except EngineConfigError as exc:  # a teacher's settings the plan could not judge alone
        typer.echo(f"proctor: cannot serve: {exc}", err=True)
        raise typer.Exit(1) from None
    if grpc_port is not None:
        options.grpc_port = grpc_port
    if http_port is not None:
        options.http_port = http_port
    return router, options


def _flag_spec(model: str | None, *, engine: str, device: str, dtype: str, max_topk: int,
               max_model_len: int | None, inference: list[str], startup_timeout_s: float, replicas: int) -> EngineSpec:
    """The one teacher's EngineSpec from the flags (without a config file): the built-in tiny
    teacher unless --model names one, hidden states served unless --inference turns them off.
    Checked here, each by its rule's home, so that a bad flag is one line and not a replica's
    traceback: the replica count, the engine's name, the device, the --inference keys (the config
    file's unknown-key rule) and the model."""
    from proctor.server.cli.tiny_model import ensure_default_model
    from proctor.server.config.reading import inference_flag_problems
    from proctor.server.engines.base import EngineConfigError, EngineSpec
    from proctor.server.engines.checks import check_device, check_engine_name, check_model_path

    if replicas < 1:
        raise EngineConfigError(f"--replicas is {replicas}: a teacher needs at least 1 replica")
    check_engine_name(engine)
    check_device(device)
    settings = _parse_settings(inference)
    problems = inference_flag_problems(settings)
    if problems:
        raise EngineConfigError("; ".join(problems))
    path = check_model_path(model, download=True) if model is not None else ensure_default_model()
    if max_model_len:
        settings["max_model_len"] = max_model_len
    hidden_states = settings.pop("hidden_states", True) is not False
    return EngineSpec(name=engine, model_path=str(path), device=device, dtype=dtype, max_topk=max_topk,
                      inference=settings, hidden_states=hidden_states, startup_timeout_s=startup_timeout_s)


def _flag_options(*, host: str | None, grpc_port: int | None, http_port: int | None, auth_token_file: Path | None,
                  max_queue_requests: int, max_queue_tokens: int) -> ServerOptions:
    """The server options from the flags (without a config file): defaults for what is unset."""
    from proctor.server.front.auth import load_token
    from proctor.server.front.service import Limits

    return ServerOptions(host=host or DEFAULTS.host,
                         grpc_port=DEFAULTS.grpc_port if grpc_port is None else grpc_port,
                         http_port=DEFAULTS.http_port if http_port is None else http_port,
                         auth_token=load_token(token_file=str(auth_token_file) if auth_token_file else None),
                         limits=Limits(max_queue_requests=max_queue_requests, max_queue_tokens=max_queue_tokens))


def _serve_until_stopped(router: Router, options: ServerOptions, *, switch_interval_ms: float,
                         open_ok: bool = False) -> int:
    """Run the server on a new event loop until it stops; 1 when a replica could not start (its
    reason on stderr, the other replicas released), else the server's own exit code."""
    check_exposure(options.host, options.auth_token, allow_unauthenticated=open_ok)  # auth fails closed
    from proctor.server.alignment.students import StudentTokenizerError
    from proctor.server.engines.base import EngineError
    from proctor.server.front.grpc_app import PortUnavailable
    from proctor.server.front.runtime import ProctorServer

    async def main() -> int:
        sys.setswitchinterval(switch_interval_ms / 1000)
        try:
            server = ProctorServer(router, options)
        except PortUnavailable as exc:  # nothing started yet: the replicas start in serve_until_terminated
            print(f"proctor: cannot serve: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"proctor: gRPC on {options.host}:{server.grpc_port}, HTTP on {options.host}:{server.http_port}", flush=True)
        try:
            await server.serve_until_terminated()
        except (EngineError, StudentTokenizerError) as exc:  # a replica or student tokenizer could not start
            print(f"proctor: cannot serve: {exc}", file=sys.stderr, flush=True)
            await server.stop()
            return 1

    return asyncio.run(main())


@app.command()
def score(
    ids: str | None = typer.Option(None, help="Comma-separated token ids."),
    text: str | None = typer.Option(None, help="Text to tokenize with --tokenizer (refused unless that tokenizer's "
                                    "fingerprint is the teacher's, as the server reports it)."),
    tokenizer: Path | None = typer.Option(None, metavar="DIR", help="The teacher's tokenizer directory, for --text "
                                          "(default: the built-in tiny teacher's)."),
    target: str = typer.Option("grpc://127.0.0.1:50051", help="grpc://host:port or http://host:port"),
    teacher_key: str = typer.Option("", help="Routing key (optional with one teacher)."),
    prompt_length: int | None = typer.Option(None, help="First response position."),
    topk: int = typer.Option(5, help="Top-k per row (0: none)."),
    token: str | None = typer.Option(None, envvar="PROCTOR_AUTH_TOKEN", help="Bearer token."),
) -> None:
    """Score token ids or text against a running server and print a table."""
    from proctor.server.cli.score import (
        ScoreFailed,
        check_teacher_tokenizer,
        format_table,
        score_once,
        tokenize,
    )

    if (ids is None) == (text is None):
        raise typer.BadParameter("give exactly one of --ids or --text")
    tok = None
    try:
        if text is not None:
            check_teacher_tokenizer(target, teacher_key, tokenizer, token)
            tok, token_ids = tokenize(text, tokenizer)
        else:
            try:
                token_ids = [int(x) for x in ids.split(",") if x.strip()]
            except ValueError as exc:
                raise typer.BadParameter(f"--ids must be comma-separated integers: {exc}") from exc
        result = score_once(target, token_ids, teacher_key=teacher_key, prompt_length=prompt_length, topk=topk,
                            token=token)
    except ScoreFailed as exc:
        typer.echo(f"proctor score: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(format_table(token_ids, result, tok))


@app.command("make-tiny-model", cls=_PlainUsage, short_help="Build a tiny teacher locally: random weights from a seed, a locally built tokenizer.")
def make_tiny_model_cmd(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Directory to write the model into."),
    kind: str = typer.Option("text", help="text (a Qwen2 LM), vl (a Qwen2-VL) or omni-thinker (a Qwen2.5-Omni Thinker)."),
    vocab_size: int = typer.Option(512),
    hidden_size: int = typer.Option(64, help="text kind only"),
    num_layers: int = typer.Option(2, help="text kind only"),
    seed: int = typer.Option(0),
) -> None:
    """Build a tiny teacher (random weights from a seed, a locally built tokenizer; for the
    multimodal kinds also its image/video processors and audio feature extractor)."""
    from proctor.server.cli.tiny_multimodal import make_tiny_of_kind

    try:
        path = make_tiny_of_kind(kind, out_dir, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                                 seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"tiny {kind} teacher written to {path}")


@app.command()
def quickstart() -> None:
    """Start the tiny teacher, score a few sequences through gRPC and HTTP, print them."""
    from proctor.server.cli.quickstart import run_quickstart

    run_quickstart()


@app.command("check-config", cls=_PlainUsage)
def check_config(config: Path = typer.Argument(..., metavar="CONFIG", help="YAML config to check.")) -> None:
    """Print the resolved plan (teachers, replicas, devices) or every problem found."""
    from proctor.server.config import check_config_command

    raise typer.Exit(check_config_command(config))


# The commands that run the trainer side against a server (their module composes with the client).
app.command(short_help="Check that a running server's replicas agree on the same sequences.")(trainer_side.verify)
app.command()(trainer_side.demo)
app.command("score-dataset")(trainer_side.score_dataset)
app.command("verify-dataset")(trainer_side.verify_dataset)


def main() -> None:
    from proctor.server.front.auth import AuthSetupError

    try:
        app()
    except AuthSetupError as exc:  # auth fails closed, in one line
        print(f"proctor: cannot serve: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
