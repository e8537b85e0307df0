"""`proctor quickstart`: the tiny teacher served on loopback, a few sequences scored through
gRPC and through HTTP, printed side by side, so a newcomer sees the whole path work."""

from __future__ import annotations

from proctor.server.engines import EngineSpec
from proctor.server.runtime import ServerOptions, ServerThread, single_teacher_router
from proctor.server.score_cli import format_table, score_once, tokenize
from proctor.server.tiny_model import ensure_default_model

SAMPLES = [
    ("User: what is 12 times 7? Assistant:", " 12 times 7 is 84."),
    ("The quick brown fox", " jumps over the lazy dog."),
]


def run_quickstart() -> None:
    model = ensure_default_model()
    spec = EngineSpec(name="torch", model_path=str(model))
    with ServerThread(single_teacher_router(spec, name="tiny"), ServerOptions(grpc_port=0, http_port=0)) as server:
        print(f"tiny teacher at {model}\nserving gRPC {server.grpc_target}, HTTP {server.http_url}\n")
        for prompt, response in SAMPLES:
            tok, prompt_ids = tokenize(prompt, model)
            ids = prompt_ids + tok(response)["input_ids"]
            by_grpc = score_once(f"grpc://{server.grpc_target}", ids, prompt_length=len(prompt_ids), topk=3)
            by_http = score_once(server.http_url, ids, prompt_length=len(prompt_ids), topk=3)
            print(f"prompt {prompt!r}  response {response!r}  (through gRPC)")
            print(format_table(ids, by_grpc, tok))
            worst = max(abs(a - b) for a, b in zip(by_grpc.logprobs, by_http.logprobs, strict=True))
            print(f"HTTP gives the same log-probs: max |gRPC - HTTP| = {worst:.2e}\n")
