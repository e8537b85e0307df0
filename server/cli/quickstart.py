"""The tiny teacher served on loopback, and the quickstart printout: a few sequences scored
through gRPC and through HTTP, printed side by side, so a newcomer sees the whole path work.

`proctor quickstart` prints it and exits; `proctor demo` prints it, then trains against the
same server. It scores with `cli.score` (the wire contract, not the trainer-side client), so
the server package keeps no dependency on the client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proctor.server.cli.score import format_table, score_once, tokenize
from proctor.server.cli.tiny_model import ensure_default_model
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions

SAMPLES = [
    ("User: what is 12 times 7? Assistant:", " 12 times 7 is 84."),
    ("The quick brown fox", " jumps over the lazy dog."),
]


@contextmanager
def tiny_teacher(*, max_topk: int = 64, kind: str = "text", student_tokenizers: dict[str, str] | None = None,
                 projection_rank: int = 0) -> Iterator[tuple[ServerThread, Path]]:
    """The built-in tiny teacher (`kind` "omni": the tiny Qwen2.5-Omni Thinker) served on free
    loopback ports while the block runs, knowing `student_tokenizers`, with a hidden-state
    projection of `projection_rank` (0: none): (server, model dir)."""
    if kind == "omni":
        from proctor.server.cli.tiny_multimodal import ensure_tiny_multimodal

        model = ensure_tiny_multimodal("omni-thinker")
    else:
        model = ensure_default_model()
    spec = EngineSpec(name="torch", model_path=str(model), max_topk=max_topk,
                      inference={"hidden_projection_rank": projection_rank} if projection_rank else {})
    options = ServerOptions(grpc_port=0, http_port=0, student_tokenizers=dict(student_tokenizers or {}))
    # Named as `proctor serve` names its one teacher, so the demo's tables read as a served teacher's.
    with ServerThread(single_teacher_router(spec, name="default"), options) as server:
        yield server, model


def print_quickstart(server: ServerThread, model_dir: Path) -> None:
    """Score SAMPLES through both transports of `server`; print the gRPC table and the largest gap."""
    print(f"tiny teacher at {model_dir}\nserving gRPC {server.grpc_target}, HTTP {server.http_url}\n")
    for prompt, response in SAMPLES:
        tok, prompt_ids = tokenize(prompt, model_dir)
        ids = prompt_ids + tok(response)["input_ids"]
        by_grpc = score_once(f"grpc://{server.grpc_target}", ids, prompt_length=len(prompt_ids), topk=3)
        by_http = score_once(server.http_url, ids, prompt_length=len(prompt_ids), topk=3)
        print(f"prompt {prompt!r}  response {response!r}  (through gRPC)")
        print(format_table(ids, by_grpc, tok))
        worst = max(abs(a - b) for a, b in zip(by_grpc.logprobs, by_http.logprobs, strict=True))
        print(f"through HTTP: max |gRPC - HTTP| = {worst:.2e}\n")


def run_quickstart() -> None:
    """`proctor quickstart`: the tiny teacher served, a few sequences scored and printed (no bars in logs)."""
    from proctor.server.common.progress_bars import quiet_bars_in_logs

    quiet_bars_in_logs()
    with tiny_teacher() as (server, model_dir):
        print_quickstart(server, model_dir)
