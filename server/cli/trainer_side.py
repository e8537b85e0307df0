"""The `proctor` commands that run the trainer side: `verify` (a client of a running server: do its
replicas agree), `demo` (serves the tiny teacher and distils a student from it), and the offline
job's `score-dataset` and `verify-dataset` (clients of a running teacher: `proctor.client.offline`).

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


def score_dataset(
    source: str = typer.Argument(..., help="JSONL or Parquet file, a `datasets` directory, or a dataset name."),
    out: Path = typer.Option(..., help="Directory of the stored dataset (shards and manifest.json)."),
    target: str = typer.Option("grpc://127.0.0.1:50051", help="grpc://host:port or http://host:port of the teacher."),
    teacher: str | None = typer.Option(None, help="Teacher routing key (optional with one teacher)."),
    topk: int = typer.Option(64, help="K: top-k ids and log-probs per row (0: none)."),
    topk_form: str = typer.Option("u8", help="Top-k log-prob form: u8 (8 bits, per-row scale and offset) | f16 | f32."),
    temperature: float | None = typer.Option(None, help="Teacher temperature (default 1)."),
    logprobs: bool = typer.Option(True, help="Store the sampled token's log-prob (float32)."),
    score_ids_column: str = typer.Option("", help="Input column of ids to score per row (R lists); stored as score_logprobs."),
    hidden_form: str | None = typer.Option(None, help="Store hidden states in this wire form (exact | float32 | bfloat16 "
                                           "| fp8 | projected | projected_fp8); default: none."),
    tokenizer: Path | None = typer.Option(None, help="The teacher's tokenizer directory, for text or messages rows."),
    split: str = typer.Option("train", help="Split of a dataset given by name."),
    block_rows: int = typer.Option(256, help="Sequences per block (one shard each); fixed for a dataset's life."),
    max_concurrency: int = typer.Option(64, help="Requests in flight."),
    ray: bool = typer.Option(False, "--ray", help="Run as a Ray Data pipeline (joins --ray-address, else starts Ray)."),
    ray_address: str | None = typer.Option(None, help="Ray cluster address for --ray."),
    ray_actors: int = typer.Option(2, help="Scoring actors for --ray."),
    token: str | None = typer.Option(None, envvar="PROCTOR_AUTH_TOKEN", help="Bearer token."),
) -> None:
    """Score a dataset once through a running teacher into small Parquet shards; run again to resume."""
    from proctor.client import TeacherError
    from proctor.client.offline import IdentityMismatch, JobSettings, run_job
    from proctor.client.offline.inputs import InputError
    from proctor.client.offline.progress import JobProgress
    from proctor.client.offline.ray_job import run_ray_job

    progress = JobProgress()
    try:
        settings = JobSettings(source=source, out=str(out), target=target, teacher_key=teacher, topk=topk,
                               temperature=temperature, topk_form=topk_form, logprobs=logprobs,
                               score_ids_column=score_ids_column,
                               hidden_form=None if hidden_form is None else hidden_form.replace("exact", ""),
                               block_rows=block_rows, max_concurrency=max_concurrency,
                               tokenizer=str(tokenizer) if tokenizer else None, split=split, token=token)
        if ray:
            report = run_ray_job(settings, actors=ray_actors, address=ray_address, on_shard=progress.on_shard,
                                 on_start=progress.on_start)
        else:
            report = asyncio.run(run_job(settings, on_shard=progress.on_shard, on_start=progress.on_start))
    except (IdentityMismatch, InputError, TeacherError, ValueError, OSError) as exc:
        typer.echo(f"proctor score-dataset: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        progress.close()
    typer.echo(f"score-dataset: {report.rows} rows ({report.positions} positions) in {len(report.written)} new "
               f"shards, {report.skipped} blocks already stored, {report.seconds:.1f}s; {out / 'manifest.json'}")


def verify_dataset(
    directory: Path = typer.Argument(..., help="A stored dataset's directory."),
    target: str = typer.Option(..., help="grpc://host:port or http://host:port of the teacher."),
    teacher: str | None = typer.Option(None, help="Teacher routing key (default: the stored teacher's name)."),
    sample: int = typer.Option(64, help="Sequences re-scored."),
    seed: int = typer.Option(0),
    token: str | None = typer.Option(None, envvar="PROCTOR_AUTH_TOKEN", help="Bearer token."),
) -> None:
    """Re-score a random sample of stored sequences against a live teacher; exit 1 on a mismatch."""
    from proctor.client import TeacherError
    from proctor.client.offline.verify import verify_dataset as verify_stored

    try:
        report = asyncio.run(verify_stored(directory, target, sample=sample, seed=seed, teacher_key=teacher,
                                           token=token))
    except (TeacherError, ValueError, OSError) as exc:
        typer.echo(f"proctor verify-dataset: {exc}", err=True)
        raise typer.Exit(1) from None
    for line in report.lines():
        typer.echo(line)
    raise typer.Exit(0 if report.ok else 1)
