"""The `proctor` commands that run the trainer side: `verify` (a client of a running server: do its
replicas agree) and `demo` (serves the tiny teacher and distils a student from it).

With `server/cli/main.py`, which registers them, this is the one place where the server and the
client are composed (DESIGN §2); every import of the client stays inside these commands.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

# The demo teacher's hidden-state projection for --hidden-form projected*: H/8 of the tiny teacher (H = 64).
DEMO_PROJECTION_RANK = 8


def verify(
    target: str = typer.Option(..., help="grpc://host:port or http://host:port of a running server."),
    threshold: float | None = typer.Option(None, help="Largest max |delta log-prob| a replica may show [default: "
                                           "0 for a batch-invariant teacher, else its max_drift]."),
    sequences: Path | None = typer.Option(None, help="JSON file of token-id sequences [default: built in]."),
    token: str | None = typer.Option(None, envvar="PROCTOR_AUTH_TOKEN", help="Bearer token."),
    token_file: Path | None = typer.Option(None, envvar="PROCTOR_AUTH_TOKEN_FILE", help="File holding the bearer token."),
) -> None:
    """Score the same sequences on every replica of a running server, alone and in mixed batches;
    print max |delta log-prob| per replica and batch size; exit 1 naming a replica above the threshold."""
    from proctor.client import TeacherError
    from proctor.client.verify import read_sequences
    from proctor.client.verify import verify as verify_server
    from proctor.server.front.auth import load_token

    try:
        token = load_token(token, str(token_file) if token_file else None)
        reports = asyncio.run(verify_server(target, threshold=threshold, token=token,
                                            sequences=read_sequences(sequences) if sequences else None))
    except (TeacherError, ValueError, OSError) as exc:
        typer.echo(f"proctor verify: {exc}", err=True)
        raise typer.Exit(1) from None
    for report in reports:
        typer.echo(report.table() + "\n")
    failures = [line for report in reports for line in report.failures()]
    for line in failures:
        typer.echo(f"proctor verify: {line}", err=True)
    raise typer.Exit(1 if failures else 0)


def demo(
    steps: int = typer.Option(30, help="Training steps."),
    loss: str | None = typer.Option(None, help="k1 | k3 | forward_kl_topk | full_forward_kl (the default) | full_reverse_kl | "
                                    "full_jsd | student_topk_reverse_kl; with --cross-tokenizer: gold_hybrid (the "
                                    "default) | chunk_likelihood"),
    transport: str = typer.Option("grpc", help="grpc | http"),
    out: Path = typer.Option(Path("out"), help="Folder for the loss plot and log."),
    seed: int = typer.Option(0),
    teacher: str = typer.Option("text", help="text (the tiny teacher) | omni (a tiny Qwen2.5-Omni Thinker: "
                                "prompts with an image and an audio clip)"),
    cross_tokenizer: bool = typer.Option(False, help="Distil a tiny student with another tokenizer (other merges "
                                         "and vocabulary) through aligned requests."),
    hidden_form: str = typer.Option("", help="The teacher's hidden states' wire form for the full-vocabulary "
                                    "losses: float32 | bfloat16 | fp8 | projected | projected_fp8 (empty: exact)."),
) -> None:
    """On-policy distillation on the CPU: a noisy student learns from the tiny teacher.

    The composition lives here: this command serves the tiny teacher and hands the trainer
    loop (which knows only the client) the server's targets and the model for the tokenizer.
    """
    from proctor.server.cli.quickstart import print_quickstart, tiny_teacher
    from proctor.server.common.progress_bars import quiet_bars_in_logs
    from proctor.trainer_adapter.demo import loss_line, option_error, run_demo

    quiet_bars_in_logs()  # before the teacher's replica starts: it inherits the setting
    if cross_tokenizer:
        _cross_tokenizer_demo(steps=steps, loss=loss, transport=transport, out=out, seed=seed, teacher=teacher)
    loss = loss or "full_forward_kl"
    problem = option_error(steps=steps, loss=loss, transport=transport, teacher=teacher, hidden_form=hidden_form)
    if problem:  # before a server is started for nothing
        typer.echo(f"proctor demo: {problem}", err=True)
        raise typer.Exit(2)
    rank = DEMO_PROJECTION_RANK if hidden_form in ("projected", "projected_fp8") else 0
    print(f"proctor demo: serves the tiny {teacher} teacher (as `proctor serve` does: teacher 'default'), "
          + ("scores two sequences through gRPC and HTTP (the tables), " if teacher == "text" else "")
          + f"then distils a noisy student with {loss_line(loss)}\n", flush=True)
    with tiny_teacher(kind=teacher, projection_rank=rank) as (server, model_dir):
        if teacher == "text":
            print_quickstart(server, model_dir)
        targets = {"grpc": f"grpc://{server.grpc_target}", "http": server.http_url}
        code = run_demo(targets, model_dir, steps=steps, loss=loss, transport=transport, out=out, seed=seed,
                        teacher=teacher, hidden_form=hidden_form)
    raise typer.Exit(code)


def _cross_tokenizer_demo(*, steps: int, loss: str | None, transport: str, out: Path, seed: int, teacher: str) -> None:
    """`proctor demo --cross-tokenizer`: the tiny teacher serves aligned requests for the tiny
    student's tokenizer; the student (client side only) distils through them. Exits."""
    from proctor.server.cli.quickstart import tiny_teacher
    from proctor.server.cli.tiny_model import ensure_tiny_student
    from proctor.trainer_adapter.cross_tokenizer_demo import cross_option_error, run_cross_tokenizer_demo

    loss = loss or "gold_hybrid"
    problem = cross_option_error(steps=steps, loss=loss, transport=transport, teacher=teacher)
    if problem:
        typer.echo(f"proctor demo: {problem}", err=True)
        raise typer.Exit(2)
    student = ensure_tiny_student()
    with tiny_teacher(student_tokenizers={"tiny-student": str(student)}) as (server, _):
        target = f"grpc://{server.grpc_target}" if transport == "grpc" else server.http_url
        code = run_cross_tokenizer_demo(target, student, "tiny-student", steps=steps, loss=loss, out=out, seed=seed)
    raise typer.Exit(code)
