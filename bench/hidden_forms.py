"""Hidden states that cross the network small: each wire form's bytes per token, its error, and the loss's cost.

The teacher has a trained head, not random weights (a random matrix has a flat spectrum and
nothing to project): the tiny Qwen2 architecture widened to H = 256 (2 layers, V = 512, the tiny
tokenizer; its head re-drawn at the usual std 0.02), trained here for `--train-seconds` on text this script generates (a bigram chain over
the tiny tokenizer's own corpus words, plus "a times b is c" arithmetic), saved, and served by a
real proctor server (torch engine, `inference.hidden_projection_rank` = H/8). Held-out sequences
of the same generator (another seed) are scored through gRPC ScoreStream in every form.

Part 1, per form, side by side in one run:
- bytes per token: the hidden_states tensors' data bytes on the wire over the rows (scales
  included), and the ratio to float32;
- error: the full-vocabulary forward KL(p ‖ p̃) and JSD(p, p̃) between the exact teacher
  distribution p = softmax(h·Wᵀ) and the one rebuilt from the form, p̃ = softmax(ĥ·Ŵᵀ) (ĥ the
  dequantised rows, Ŵ = W, or W·P from GetUnembedding(projected) for the projected forms), in
  float64, mean and p99 over tokens;
- the student loss's gradient cosine against the exact form: forward KL (full_vocab_kl, chunked)
  of a noisy copy of the teacher (`trainer_adapter.student.noisy_student`, noise 0.3) on the
  same rows, gradients with respect to its hidden states and lm_head, flattened together.

Part 2, the trainer-side loss cost of `projected` at r = H/8 against the full form, on synthetic
inputs at trainer scale (`--n`, `--v`; values do not change the cost): full_vocab_kl_reduced,
forward + backward. Machine-independent figures: matrix-product FLOPs (`client.loss.work.MatmulWork`,
counted at the dispatcher, in-place and out= products included)
and the bytes of teacher inputs the trainer holds; CPU seconds (process time, min of `--reps`)
beside them. Rows: a student as wide as the teacher, a teacher 8× wider than its student, and a
student given as logits (the teacher's product is then the loss's only one).

    python bench/hidden_forms.py                     # ~3 min of training, then the tables
    python bench/hidden_forms.py --train-seconds 20 --n 256 --v 8192 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from proctor.client.loss import full_vocab_kl, full_vocab_kl_reduced
from proctor.proto import decode_tensor, hidden_forms, scoring_pb2, scoring_pb2_grpc

HIDDEN = 256


# -- the teacher ------------------------------------------------------------------------------
def text_generator(seed: int):
    """Sentences of a bigram chain over the tiny corpus's words, and arithmetic facts."""
    from proctor.server.cli.tiny_model import _CORPUS

    words = re.findall(r"[A-Za-z']+|\d+|[^\sA-Za-z\d]", _CORPUS)
    follow: dict[str, list[str]] = {}
    for a, b in itertools.pairwise(words):
        follow.setdefault(a, []).append(b)
    rng = random.Random(seed)

    def sentence() -> str:
        if rng.random() < 0.3:
            a, b = rng.randint(2, 19), rng.randint(2, 19)
            return f"User: what is {a} times {b}? Assistant: {a} times {b} is {a * b}."
        word, out = rng.choice(words), []
        for _ in range(rng.randint(6, 20)):
            out.append(word)
            word = rng.choice(follow.get(word) or words)
        return " ".join(out)

    return sentence


def sequences(tokenizer, seed: int, count: int, length: int) -> list[list[int]]:
    sentence = text_generator(seed)
    out = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer(sentence() + "\n")["input_ids"]
        out.append(ids[:length])
    return out


def trained_teacher(out: Path, seconds: float) -> tuple[Path, float, float]:
    """The H=256 tiny teacher trained for `seconds`: (its directory, first and last train loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from proctor.server.cli.tiny_model import make_tiny_model

    path = make_tiny_model(out, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=512, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # The tiny model's head is drawn wide (std 0.25) so the untrained teacher is peaked; a Gaussian
    # that wide would still dominate the head after minutes of training, and its flat spectrum with
    # it. Start from the usual small init instead (transformers' initializer_range, 0.02), so the
    # head the bench measures is what training made of it.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(2))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    torch.manual_seed(0)
    sentence_seed, first, last, started = 0, None, None, time.monotonic()
    while time.monotonic() - started < seconds:
        batch = torch.tensor(sequences(tokenizer, sentence_seed, 16, 96))
        sentence_seed += 1
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = float(loss) if first is None else first
        last = float(loss)
    model.save_pretrained(path)
    return path, float(first or 0.0), float(last or 0.0)


# -- part 1: bytes and error per form ---------------------------------------------------------
def _stream(stub, ids: list[int], form: str) -> tuple[torch.Tensor, int]:
    request = scoring_pb2.ScoreRequest(token_ids=ids, prompt_length=1, logprobs=False, hidden_states=True,
                                       hidden_form=form)
    pieces, size = [], 0
    for chunk in stub.ScoreStream(request):
        if chunk.response.HasField("hidden_states"):
            pieces.append(decode_tensor(chunk.response.hidden_states).clone())
            size += len(chunk.response.hidden_states.data)
    return torch.cat(pieces), size


def _divergences(exact: torch.Tensor, rebuilt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token forward KL(p ‖ p̃) and JSD(p, p̃), float64."""
    lp, lq = torch.log_softmax(exact, -1), torch.log_softmax(rebuilt, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    lm = torch.logaddexp(lp, lq) - torch.log(torch.tensor(2.0, dtype=lp.dtype))
    jsd = 0.5 * (lp.exp() * (lp - lm)).sum(-1) + 0.5 * (lq.exp() * (lq - lm)).sum(-1)
    return kl.clamp_min(0), jsd.clamp_min(0)


def _student_grad(student, rows: list[tuple[list[int], int]], teacher_hidden, teacher_weight) -> torch.Tensor:
    from proctor.trainer_adapter.student import response_hidden

    student.zero_grad()
    hidden, _ = response_hidden(student, rows)
    hidden.retain_grad()
    weight = student.get_output_embeddings().weight
    loss = full_vocab_kl(teacher_hidden, teacher_weight, student_hidden=hidden, student_weight=weight).mean()
    loss.backward()
    return torch.cat([hidden.grad.reshape(-1), weight.grad.reshape(-1)]).double()


def part_one(path: Path, rank: int, count: int, length: int) -> None:
    import grpc
    from transformers import AutoTokenizer

    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions
    from proctor.trainer_adapter.student import noisy_student

    tokenizer = AutoTokenizer.from_pretrained(path)
    held_out = sequences(tokenizer, 10_000, count, length)
    spec = EngineSpec(name="torch", model_path=str(path), dtype="float32",
                      inference={"hidden_projection_rank": rank})
    with ServerThread(single_teacher_router(spec, name="trained"), ServerOptions(grpc_port=0, http_port=0)) as server:
        stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(server.grpc_target))
        (info,) = stub.ListTeachers(scoring_pb2.TeachersRequest()).teachers
        weights = {}
        for projected in (False, True):
            chunks = stub.GetUnembedding(scoring_pb2.UnembeddingRequest(projected=projected))
            weights[projected] = torch.cat([decode_tensor(c.tensor).clone() for c in chunks])
        answers = {}
        for form in ("", *hidden_forms.FORMS):
            got = [_stream(stub, ids, form) for ids in held_out]
            answers[form] = (torch.cat([g[0] for g in got]), sum(g[1] for g in got))
    tokens = answers[""][0].shape[0]
    w = weights[False].double()
    exact_logits = answers[""][0].double() @ w.T
    student = noisy_student(path, noise=0.3, seed=0)
    rows = [(ids, 1) for ids in held_out]
    exact_grad = _student_grad(student, rows, answers[""][0], weights[False])
    print(f"teacher: H={HIDDEN}, V={w.shape[0]}, projection r={rank} (H/{HIDDEN // rank}) keeps "
          f"{info.projection_energy:.4f} of the unembedding's energy (ListTeachers); {tokens} held-out tokens\n")
    print(f"{'form':<14} {'bytes/token':>11} {'x float32':>9} {'KL mean':>10} {'KL p99':>10} {'JSD mean':>10} "
          f"{'JSD p99':>10} {'grad cos':>9}")
    float32_bytes = answers["float32"][1] / tokens
    for form in hidden_forms.FORMS:
        hidden, size = answers[form]
        weight = weights[form in hidden_forms.PROJECTED_FORMS]
        rebuilt = hidden_forms.rebuilt(hidden, torch.float64) @ weight.double().T
        kl, jsd = _divergences(exact_logits, rebuilt)
        grad = _student_grad(student, rows, hidden, weight)
        cosine = float(torch.nn.functional.cosine_similarity(grad, exact_grad, dim=0))
        print(f"{form:<14} {size / tokens:>11.1f} {size / tokens / float32_bytes:>9.4f} {float(kl.mean()):>10.2e} "
              f"{float(kl.quantile(0.99)):>10.2e} {float(jsd.mean()):>10.2e} {float(jsd.quantile(0.99)):>10.2e} "
              f"{cosine:>9.6f}")
    # Other ranks, by the server's own rule applied here to the exact rows (a teacher has one rank).
    from proctor.server.engines.hidden_forms import compress, projection_of

    for other in (HIDDEN // 4, HIDDEN // 2):
        projection = projection_of(weights[False], other)
        hidden = compress(answers[""][0], "projected_fp8", projection.matrix)
        weight = weights[False] @ projection.matrix
        kl, jsd = _divergences(exact_logits, hidden_forms.rebuilt(hidden, torch.float64) @ weight.double().T)
        cosine = float(torch.nn.functional.cosine_similarity(_student_grad(student, rows, hidden, weight), exact_grad, dim=0))
        size = hidden_forms.row_bytes("projected_fp8", HIDDEN, other, 4)
        print(f"{f'proj_fp8 r={other}':<14} {size:>11.1f} {size / float32_bytes:>9.4f} {float(kl.mean()):>10.2e} "
              f"{float(kl.quantile(0.99)):>10.2e} {float(jsd.mean()):>10.2e} {float(jsd.quantile(0.99)):>10.2e} "
              f"{cosine:>9.6f}  (energy {projection.energy:.4f}, computed here)")
    print(f"\nat H=4096 (formula, hidden_forms.row_bytes): fp8 {hidden_forms.row_bytes('fp8', 4096, 512, 4) / 16384:.4f}x, "
          f"projected_fp8 r=512 {hidden_forms.row_bytes('projected_fp8', 4096, 512, 4) / 16384:.4f}x float32")


# -- part 2: the loss's cost ------------------------------------------------------------------
def _run_loss(teacher_hidden, teacher_weight, student: dict, weights) -> float:
    grads = [t for t in student.values() if t.requires_grad]
    started = time.process_time()
    out = full_vocab_kl_reduced(teacher_hidden, teacher_weight, weights, **student)
    torch.autograd.grad(out.total, grads)
    return time.process_time() - started


def _cost(teacher_hidden, teacher_weight, student: dict, weights, reps: int) -> tuple[float, float, int]:
    from proctor.client.loss.work import MatmulWork

    with MatmulWork() as counter:
        _run_loss(teacher_hidden, teacher_weight, student, weights)
    seconds = min(_run_loss(teacher_hidden, teacher_weight, student, weights) for _ in range(reps))
    held = teacher_hidden.numel() * teacher_hidden.element_size() + teacher_weight.numel() * teacher_weight.element_size()
    return counter.flops, seconds, held


def part_two(n: int, v: int, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    weights = torch.full((n,), 1.0 / n)
    print(f"\nloss cost, full_vocab_kl_reduced forward + backward, N={n} V={v}, projected r = H_t/8 "
          f"(ratios to the full float32 form)")
    print(f"{'case':<38} {'form':<14} {'GFLOP':>8} {'x':>6} {'CPU s':>7} {'x':>6} {'teacher MiB':>11} {'x':>6}")
    for label, hs, ht, logits in (("student H_s = teacher H_t = 1024", 1024, 1024, False),
                                  ("student H_s = 512, teacher H_t = 4096", 512, 4096, False),
                                  ("student logits given, H_t = 4096", 512, 4096, True)):
        r = ht // 8
        sh = (torch.randn(n, hs, generator=g) * 0.5).requires_grad_()
        sw = (torch.randn(v, hs, generator=g) * hs**-0.5).requires_grad_()
        student = {"student_logits": (sh.detach() @ sw.detach().T).requires_grad_()} if logits else {
            "student_hidden": sh, "student_weight": sw}
        th = torch.randn(n, ht, generator=g)
        tw = torch.randn(v, ht, generator=g) * ht**-0.5
        p = torch.linalg.qr(torch.randn(ht, r, generator=g))[0]
        forms = {"float32": (th, tw), "fp8": (hidden_forms.quantize_rows(th), tw),
                 "projected": (th @ p, tw @ p), "projected_fp8": (hidden_forms.quantize_rows(th @ p), tw @ p)}
        base = None
        for form, (hidden, weight) in forms.items():
            flops, seconds, held = _cost(hidden, weight, student, weights, reps)
            base = base or (flops, seconds, held)
            print(f"{label:<38} {form:<14} {flops / 1e9:>8.1f} {flops / base[0]:>6.3f} {seconds:>7.2f} "
                  f"{seconds / base[1]:>6.3f} {held / 2**20:>11.1f} {held / base[2]:>6.3f}")
        del student, sh, sw, th, tw


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-seconds", type=float, default=180.0)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-forms", action="store_true", help="part 2 only (no training)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if not args.skip_forms:
        with tempfile.TemporaryDirectory(prefix="proctor-hidden-forms-") as tmp:
            path, first, last = trained_teacher(Path(tmp) / "teacher", args.train_seconds)
            print(f"trained the H={HIDDEN} tiny teacher for {args.train_seconds:.0f}s on generated text: "
                  f"train loss {first:.3f} -> {last:.3f}")
            part_one(path, HIDDEN // 8, args.sequences, args.length)
    if not args.skip_cost:
        part_two(args.n, args.v, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
