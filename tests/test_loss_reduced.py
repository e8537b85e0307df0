"""Reduced losses (gradients formed in the forward pass) against the per-token path + the same reduction.

Float64 inputs, so the two paths must agree to 1e-10 (they share every formula but
not the order of operations); the per-token path itself is checked against the
dense float64 references in test_loss_full_vocab / test_loss_topk, and the
reduced one is checked against those references here too.
"""

from __future__ import annotations

import functools

import pytest
import torch

from proctor.client.loss import (
    AGG_MODES,
    aggregate,
    aggregate_weights,
    distillation_loss,
    full_vocab_kl,
    full_vocab_kl_reduced,
    matmul_flops,
    topk_kl,
    topk_kl_reduced,
)
from proctor.client.loss import divergences as divergences_module
from proctor.client.loss.chunking import REDUCED_ROW_ELEMENTS, Chunking, DenseSource, FusedSource, for_device
from proctor.client.loss.divergences import full_rows, full_rows_sliced, make_divergence
from proctor.client.loss.full_vocab import _make_rows_function, _rows_function

from loss_reference import F64, full_vocab_ref, make_case, rel_err, topk_of

N, H, V, CT = 37, 8, 97, 8
TIGHT = 1e-10
SEQ_INDEX = torch.arange(N) // 10  # four packed sequences (the last one short)


def _mask(pattern: str) -> torch.Tensor:
    m = torch.ones(N, dtype=torch.bool)
    if pattern == "chunks":  # tokens 8..23 masked: two whole token chunks of 8 are all-masked
        m[8:24] = False
    elif pattern == "scattered":
        m = torch.rand(N, generator=torch.Generator().manual_seed(3)) > 0.4
    elif pattern == "sequence":  # a whole packed sequence masked
        m[10:20] = False
    return m


def _leaves(case, dtype=F64):
    return (case.student_hidden.detach().to(dtype).requires_grad_(),
            case.student_weight.detach().to(dtype).requires_grad_())


def _agg_kwargs(mode):
    return {"seq_index": SEQ_INDEX, "loss_scale_factor": 16.0 if mode == "seq-mean-token-sum-norm" else None}


def _both_paths(per_token_fn, reduced_fn, case, mask, mode, transform=None, dtype=F64):
    """(reduced total, per_token, grad_h, grad_w) and the same from the per-token path + aggregate."""
    kw = _agg_kwargs(mode)
    weights = aggregate_weights(mask, mode, dtype=dtype if dtype == F64 else torch.float32, **kw)
    sh, sw = _leaves(case, dtype)
    red = reduced_fn(weights, sh, sw, transform)
    got = (red.total, red.per_token, *torch.autograd.grad(red.total, [sh, sw]))
    sh, sw = _leaves(case, dtype)
    loss = per_token_fn(sh, sw)
    total = aggregate(loss if transform is None else transform(loss), mask, mode, **kw)
    want = (total, loss, *torch.autograd.grad(total, [sh, sw]))
    return got, want


def _full(case, direction="forward", beta=0.5, temperature=1.0, clamp=None, chunk_vocab=None):
    kw = dict(direction=direction, beta=beta, temperature=temperature, log_prob_min_clamp=clamp, chunk_tokens=CT)

    def per_token(sh, sw):
        return full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw, **kw)

    def reduced(weights, sh, sw, transform):
        return full_vocab_kl_reduced(
            case.teacher_hidden, case.teacher_weight, weights, student_hidden=sh, student_weight=sw,
            chunk_vocab=chunk_vocab, transform=transform, **kw,
        )

    return per_token, reduced


FULL_CASES = [
    ("forward", 0.5, 1.0, None), ("forward", 0.5, 2.5, None), ("forward", 0.5, 1.0, -3.0),
    ("forward", 0.5, 0.7, -5.0), ("reverse", 0.5, 1.0, None), ("reverse", 0.5, 2.0, None),
    ("jsd", 0.5, 1.0, None), ("jsd", 0.2, 1.5, None), ("jsd", 0.0, 1.0, None), ("jsd", 1.0, 1.0, None),
]


@pytest.mark.parametrize("direction,beta,tau,clamp", FULL_CASES)
@pytest.mark.parametrize("chunk_vocab", [None, 40])
def test_reduced_full_vocab_equals_per_token_then_reduced(direction, beta, tau, clamp, chunk_vocab):
    case = make_case(n=N, h=H, v=V, seed=1, dtype=F64, scale=3.0)
    got, want = _both_paths(*_full(case, direction, beta, tau, clamp, chunk_vocab), case, _mask("chunks"), "token-mean")
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TIGHT
    assert got[0].dtype == F64 and got[0].shape == ()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("pattern", ["all", "chunks", "scattered", "sequence"])
def test_reduced_full_vocab_every_aggregation_and_mask(mode, pattern):
    case = make_case(n=N, h=H, v=V, seed=2, dtype=F64, scale=2.0)
    got, want = _both_paths(*_full(case, "jsd", 0.3), case, _mask(pattern), mode)
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TIGHT


def test_reduced_full_vocab_matches_the_float64_dense_reference():
    case = make_case(n=N, h=H, v=V, seed=3, dtype=F64, scale=3.0)
    mask = _mask("scattered")
    weights = aggregate_weights(mask, "seq-mean-token-mean", seq_index=SEQ_INDEX, dtype=F64)
    for direction, clamp in (("forward", -4.0), ("reverse", None), ("jsd", None)):
        sh, sw = _leaves(case)
        red = full_vocab_kl_reduced(case.teacher_hidden, case.teacher_weight, weights, student_hidden=sh,
                                    student_weight=sw, direction=direction, log_prob_min_clamp=clamp,
                                    temperature=1.3, chunk_tokens=CT)
        gh, gw = torch.autograd.grad(red.total, [sh, sw])
        rh, rw = _leaves(case)
        ref = full_vocab_ref(rh @ rw.T, case.teacher_logits64, direction, temperature=1.3, clamp=clamp)
        ref_total = (ref * weights).sum()
        rgh, rgw = torch.autograd.grad(ref_total, [rh, rw])
        for x, y in ((red.total, ref_total), (red.per_token, ref), (gh, rgh), (gw, rgw)):
            assert rel_err(x, y) <= TIGHT


def test_transform_clamp_is_differentiated_as_torch_clamp():
    case = make_case(n=N, h=H, v=V, seed=4, dtype=F64, scale=3.0)
    per_token, reduced = _full(case, "forward")
    with torch.no_grad():
        med = float(per_token(*_leaves(case)).median())
    transform = functools.partial(torch.clamp, min=-med, max=med)  # binds on about half the tokens
    got, want = _both_paths(per_token, reduced, case, _mask("scattered"), "token-sum", transform=transform)
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TIGHT
    assert rel_err(got[2], _both_paths(per_token, reduced, case, _mask("scattered"), "token-sum")[0][2]) > 1e-3


def test_cache_sliced_eager_rows_equal_unsliced(monkeypatch):
    # Slices of 3 rows: several slices per token chunk, the last one short.
    monkeypatch.setattr(divergences_module, "CACHE_SLICE_ELEMENTS", 3 * V)
    case = make_case(n=N, h=H, v=V, seed=5, dtype=F64, scale=2.0)
    for direction in ("forward", "reverse", "jsd"):
        got, want = _both_paths(*_full(case, direction), case, _mask("scattered"), "token-mean")
        for x, y in zip(got, want, strict=True):
            assert rel_err(x, y) <= TIGHT


def test_tiles_fill_a_reused_row_major_buffer():
    # The reduced path writes every token chunk's whole-vocabulary rows into one buffer per side.
    case = make_case(n=N, h=H, v=V, seed=17, dtype=F64, scale=2.0)
    buf = torch.full((CT, V), float("nan"), dtype=F64)
    for src in (FusedSource(case.student_hidden, case.student_weight, 1 / 1.5, dtype=F64),
                DenseSource(case.student_logits64, 1 / 1.5, dtype=F64)):
        for t0, t1 in ((0, CT), (32, N)):  # a full chunk, then the short last one in the same buffer
            block = src.rows(t0, t1)
            fresh = block.tile(0, V)
            got = block.tile(0, V, out=buf[: t1 - t0])
            assert got.data_ptr() == buf.data_ptr() and got.is_contiguous() and fresh.is_contiguous()
            assert rel_err(got, fresh) <= 1e-15


def test_reduced_row_chunk_follows_the_vocabulary_not_the_token_count():
    cpu = torch.device("cpu")
    for n in (4096, 65536):
        assert Chunking.resolve_rows(n, 32768, None, None, cpu).chunk_tokens == REDUCED_ROW_ELEMENTS // 32768
    assert Chunking.resolve_rows(100, 32768, None, None, cpu).chunk_tokens == 100


def test_eager_tile_math_runs_on_one_thread_and_restores_the_count(monkeypatch):
    seen = []
    real = divergences_module.full_rows

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(divergences_module, "full_rows", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        div = make_divergence("jsd", 0.3, None)
        g = torch.Generator().manual_seed(18)
        a, b = (torch.randn(5, 53, generator=g, dtype=F64) for _ in range(2))
        monkeypatch.setattr(divergences_module, "_load_average", lambda: 0.2)  # idle: every thread
        full_rows_sliced(div, a.clone(), b.clone(), True)
        assert seen == [2]
        monkeypatch.setattr(divergences_module, "_load_average", lambda: 3.5)  # oversubscribed: one
        full_rows_sliced(div, a, b, True)
        assert seen == [2, 1] and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            full_rows_sliced(div, a, b[:3], True)  # mismatched rows fail inside: the count comes back
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_student_logits_form_and_multi_teacher():
    case = make_case(n=N, h=H, v=V, seed=6, dtype=F64, scale=2.0)
    weights = aggregate_weights(_mask("chunks"), "token-mean", dtype=F64)
    logits = case.student_logits64.detach().requires_grad_()
    red = full_vocab_kl_reduced(case.teacher_hidden, case.teacher_weight, weights, student_logits=logits,
                                direction="jsd", chunk_tokens=CT)
    (g,) = torch.autograd.grad(red.total, [logits])
    ref_logits = case.student_logits64.detach().requires_grad_()
    ref = (full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_logits=ref_logits, direction="jsd")
           * weights).sum()
    (rg,) = torch.autograd.grad(ref, [ref_logits])
    assert rel_err(red.total, ref) <= TIGHT and rel_err(g, rg) <= TIGHT
    # Two teachers, the second with a narrower hidden state.
    other = make_case(n=N, h=H, v=V, seed=7, dtype=F64, h_teacher=5)
    index = (torch.arange(N) % 3 == 0).long()
    tw = [case.teacher_weight, other.teacher_weight]
    kw = dict(teacher_index=index, direction="forward", chunk_tokens=CT)
    sh, sw = _leaves(case)
    red = full_vocab_kl_reduced(case.teacher_hidden, tw, weights, student_hidden=sh, student_weight=sw, **kw)
    got = (red.total, red.per_token, *torch.autograd.grad(red.total, [sh, sw]))
    sh, sw = _leaves(case)
    loss = full_vocab_kl(case.teacher_hidden, tw, student_hidden=sh, student_weight=sw, **kw)
    want = ((loss * weights).sum(), loss, *torch.autograd.grad((loss * weights).sum(), [sh, sw]))
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TIGHT


def test_per_token_output_stays_differentiable_and_total_backpropagates_once():
    case = make_case(n=N, h=H, v=V, seed=8, dtype=F64)
    r = torch.rand(N, generator=torch.Generator().manual_seed(1), dtype=F64)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(2), dtype=F64)
    sh, sw = _leaves(case)
    red = full_vocab_kl_reduced(case.teacher_hidden, case.teacher_weight, weights, student_hidden=sh,
                                student_weight=sw, direction="reverse", chunk_tokens=CT)
    gh, gw = torch.autograd.grad(red.total * 0.5 + (red.per_token * r).sum(), [sh, sw], retain_graph=True)
    rh, rw = _leaves(case)
    loss = full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_hidden=rh, student_weight=rw,
                         direction="reverse")
    egh, egw = torch.autograd.grad(((loss * weights).sum() * 0.5 + (loss * r).sum()), [rh, rw])
    assert rel_err(gh, egh) <= TIGHT and rel_err(gw, egw) <= TIGHT
    with pytest.raises(RuntimeError, match="once"):
        torch.autograd.grad(red.total, [sh, sw])


@pytest.mark.parametrize("clamp", [None, -4.0])
@pytest.mark.parametrize("form", ["fused", "logits"])
def test_reduced_topk_per_token_output_stays_differentiable(clamp, form):
    # The per-token output's backward recomputes each chunk's rows (the base's recomputing path).
    case = make_case(n=N, h=H, v=V, seed=19, dtype=F64, scale=3.0)
    ids, t = topk_of(case.teacher_logits64, 5)
    r = torch.rand(N, generator=torch.Generator().manual_seed(4), dtype=F64)
    weights = aggregate_weights(_mask("chunks"), "token-mean", dtype=F64)
    kw = dict(temperature=1.5, log_prob_min_clamp=clamp, chunk_tokens=CT)

    def student(sh, sw):
        return {"student_hidden": sh, "student_weight": sw} if form == "fused" else {"student_logits": sh @ sw.T}

    sh, sw = _leaves(case)
    red = topk_kl_reduced(ids, t, weights, **student(sh, sw), **kw)
    got = torch.autograd.grad(red.total * 0.5 + (red.per_token * r).sum(), [sh, sw])
    rh, rw = _leaves(case)
    loss = topk_kl(ids, t, **student(rh, rw), **kw)
    want = torch.autograd.grad((loss * weights).sum() * 0.5 + (loss * r).sum(), [rh, rw])
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= TIGHT


def test_bf16_inputs_accumulate_in_float32():
    case = make_case(n=N, h=32, v=V, seed=9, dtype=torch.bfloat16)
    weights = aggregate_weights(_mask("scattered"), "token-mean")
    for direction in ("forward", "reverse", "jsd"):
        per_token, reduced = _full(case, direction)
        got, want = _both_paths(per_token, reduced, case, _mask("scattered"), "token-mean", dtype=torch.bfloat16)
        assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
        assert rel_err(got[0], want[0]) <= 1e-6 and rel_err(got[1], want[1]) <= 1e-6  # float32 accumulation
        rh, rw = _leaves(case)  # the float64 reference on the same bf16-rounded inputs
        ref = (full_vocab_ref(rh @ rw.T, case.teacher_logits64, direction) * weights.to(F64)).sum()
        rgh, rgw = torch.autograd.grad(ref, [rh, rw])
        assert rel_err(got[0], ref) <= 1e-5
        for g, w_, r_ in ((got[2], want[2], rgh), (got[3], want[3], rgw)):
            assert rel_err(g, r_) <= 1e-2 and rel_err(g, w_) <= 1e-2  # rounded to bf16 on return


def _count(fn) -> float:
    return matmul_flops(fn) / (2.0 * 64 * 8 * 500)


@pytest.mark.parametrize("direction,clamp,per_token_work", [
    ("forward", None, 6.0), ("forward", -3.0, 8.0), ("reverse", None, 6.0), ("jsd", None, 8.0),
])
def test_reduced_full_vocab_does_four_matmuls_per_token_path_six_or_eight(direction, clamp, per_token_work):
    n, h, v = 64, 8, 500
    case = make_case(n=n, h=h, v=v, seed=10)
    kw = dict(direction=direction, log_prob_min_clamp=clamp)

    def reduced(weights):
        def run():
            sh, sw = _leaves(case, torch.float32)
            full_vocab_kl_reduced(case.teacher_hidden, case.teacher_weight, weights, student_hidden=sh,
                                  student_weight=sw, chunk_tokens=16, **kw).total.backward()
        return run

    def per_token():
        sh, sw = _leaves(case, torch.float32)
        full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_hidden=sh, student_weight=sw,
                      chunk_tokens=16, chunk_vocab=100, **kw).sum().backward()

    assert _count(reduced(torch.ones(n))) == 4.0
    assert _count(per_token) == per_token_work
    # A zero-weight token chunk (rows 16..31) skips its two gradient matmuls: 4 - 2 x 16/64.
    w = torch.ones(n)
    w[16:32] = 0.0
    assert _count(reduced(w)) == 3.5


def test_reduced_topk_forward_does_three_matmuls():
    case = make_case(n=64, h=8, v=500, seed=11)
    ids, t = topk_of(case.teacher_logits64, 4)

    def run(reduced):
        sh, sw = _leaves(case, torch.float32)
        if reduced:
            topk_kl_reduced(ids, t.float(), torch.ones(64), student_hidden=sh, student_weight=sw,
                            chunk_tokens=16).total.backward()
        else:
            topk_kl(ids, t.float(), student_hidden=sh, student_weight=sw, chunk_tokens=16).sum().backward()

    assert _count(lambda: run(True)) == 3.0
    assert _count(lambda: run(False)) >= 4.0


TOPK_CASES = [("forward", None, 1.0), ("forward", -4.0, 1.0), ("forward", None, 2.0), ("reverse", None, 1.5),
              ("jsd", None, 1.0)]


@pytest.mark.parametrize("direction,clamp,tau", TOPK_CASES)
@pytest.mark.parametrize("form", ["fused", "logits"])
def test_reduced_topk_equals_per_token_then_reduced(direction, clamp, tau, form):
    case = make_case(n=N, h=H, v=V, seed=12, dtype=F64, scale=3.0)
    ids, t = topk_of(case.teacher_logits64, 5)
    kw = dict(direction=direction, beta=0.3, temperature=tau, log_prob_min_clamp=clamp, chunk_tokens=CT)

    def student(sh, sw):
        return {"student_hidden": sh, "student_weight": sw} if form == "fused" else {"student_logits": sh @ sw.T}

    def per_token(sh, sw):
        return topk_kl(ids, t, **student(sh, sw), **kw)

    def reduced(weights, sh, sw, transform):
        return topk_kl_reduced(ids, t, weights, **student(sh, sw), transform=transform, **kw)

    floor = functools.partial(torch.clamp_min, min=0.0)
    for transform in (None, floor):
        got, want = _both_paths(per_token, reduced, case, _mask("chunks"), "seq-mean-token-sum", transform)
        for x, y in zip(got, want, strict=True):
            assert rel_err(x, y) <= TIGHT


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_is_the_weighted_sum_of_its_weights(mode):
    g = torch.Generator().manual_seed(13)
    for loss, mask, kw in (
        (torch.rand(3, 5, generator=g, dtype=F64), torch.rand(3, 5, generator=g) > 0.3, {}),
        (torch.rand(N, generator=g, dtype=F64), _mask("sequence"), _agg_kwargs(mode)),
    ):
        loss = loss.requires_grad_()
        out = aggregate(loss, mask, mode, **kw)
        (grad,) = torch.autograd.grad(out, [loss])
        w = aggregate_weights(mask, mode, dtype=F64, **kw)
        assert rel_err(out, (w * loss).sum()) <= TIGHT
        assert torch.equal(grad, w)


DISTILL = [
    ({"loss_mode": "nitrobrew", "kd_temperature": 2.0, "log_prob_min_clamp": -4.0}, "hidden"),
    ({"loss_mode": "nitrobrew_reverse_kl", "loss_max_clamp": 0.4}, "hidden"),
    ({"loss_mode": "full_jsd", "jsd_beta": 0.3}, "hidden"),
    ({"loss_mode": "forward_kl_topk", "topk": 5, "log_prob_min_clamp": -10.0, "loss_max_clamp": 0.5}, "topk"),
]


@pytest.mark.parametrize("cfg,kind", DISTILL)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_distillation_loss_uses_the_reduced_path_with_per_token_values_and_gradients(cfg, kind, mode):
    case = make_case(n=N, h=H, v=V, seed=14, dtype=F64, scale=2.0)
    cfg = {"use_policy_gradient": False, "loss_agg_mode": mode, "loss_max_clamp": None, **cfg, "chunk_tokens": CT}
    mask = _mask("chunks")
    ids, t = topk_of(case.teacher_logits64, 5)
    teacher = ({"teacher_hidden": case.teacher_hidden, "teacher_weight": case.teacher_weight} if kind == "hidden"
               else {"teacher_topk_ids": ids, "teacher_topk_logprobs": t})
    extra = {"seq_index": SEQ_INDEX, "loss_scale_factor": 16.0}
    sh, sw = _leaves(case)
    out = None

    def run():
        nonlocal out
        out = distillation_loss(cfg, mask=mask, student_hidden=sh, student_weight=sw, **teacher, **extra)
        out.loss.backward()

    work = matmul_flops(run) / (2.0 * N * H * V)
    # The reduced path ran: 4 matmuls (3 for top-k), less the two gradient matmuls of the two
    # all-masked token chunks (16 of the 37 tokens).
    # For top-k, the top-k mass metric (no gradient) streams the student normaliser once more (1) and
    # gathers the K logits at the ids (K / V).
    expected = 4.0 if kind == "hidden" else 3.0 + 1.0 + 5 / V
    assert work == pytest.approx(expected - 2.0 * 16 / N, rel=1e-12)
    # The per-token path, by hand: the loss, verl's floor and clamp, then aggregate.
    rh, rw = _leaves(case)
    if kind == "hidden":
        direction = {"nitrobrew": "forward", "nitrobrew_reverse_kl": "reverse", "full_jsd": "jsd"}[cfg["loss_mode"]]
        loss = full_vocab_kl(case.teacher_hidden, case.teacher_weight, student_hidden=rh, student_weight=rw,
                             direction=direction, beta=cfg.get("jsd_beta", 0.5),
                             temperature=cfg.get("kd_temperature", 1.0),
                             log_prob_min_clamp=cfg.get("log_prob_min_clamp"))
    else:
        loss = topk_kl(ids, t, student_hidden=rh, student_weight=rw, log_prob_min_clamp=-10.0).clamp_min(0.0)
    clamp = cfg["loss_max_clamp"]
    clamped = loss if clamp is None else loss.clamp(-clamp, clamp)
    total = aggregate(clamped, mask, mode, seq_index=SEQ_INDEX, loss_scale_factor=16.0)
    rgh, rgw = torch.autograd.grad(total, [rh, rw])
    assert rel_err(out.loss, total) <= TIGHT
    assert rel_err(out.per_token_loss, clamped) <= TIGHT
    assert out.per_token_loss.requires_grad
    assert rel_err(sh.grad, rgh) <= TIGHT and rel_err(sw.grad, rgw) <= TIGHT
    assert out.metrics["loss_max"] == pytest.approx(float(loss.detach()[mask].max()), rel=1e-6)  # logged as float32


def test_distillation_loss_keeps_the_per_token_path_where_aggregate_divides_by_zero():
    case = make_case(n=N, h=H, v=V, seed=15)
    cfg = {"loss_mode": "full_jsd", "use_policy_gradient": False, "loss_max_clamp": None}
    sh, sw = _leaves(case, torch.float32)
    mask = torch.zeros(N, dtype=torch.bool)
    out = distillation_loss(cfg, mask=mask, teacher_hidden=case.teacher_hidden,
                            teacher_weight=case.teacher_weight, student_hidden=sh, student_weight=sw)
    assert torch.isnan(out.loss)  # as aggregate (and verl) give for a fully masked token-mean
    out.loss.backward()
    assert torch.count_nonzero(sh.grad) == 0


def test_tile_function_is_eager_on_cpu_and_compiled_on_cuda():
    div = make_divergence("jsd", 0.3, None)
    fn = _rows_function(div, torch.device("cpu"))
    assert isinstance(fn, functools.partial) and fn.func is full_rows_sliced
    pure = _make_rows_function(div)
    assert for_device(pure, torch.device("cpu"), ("test", div)) is pure
    # On a CUDA device the tile function goes through torch.compile (compilation is lazy: no GPU needed here).
    compiled = for_device(pure, torch.device("cuda"), ("test", div))
    assert compiled is not pure and callable(compiled)
    assert _rows_function(div, torch.device("cuda")) is not fn


@pytest.mark.parametrize("direction,clamp", [("forward", None), ("forward", -3.0), ("reverse", None), ("jsd", None)])
def test_compiled_tile_function_matches_eager(direction, clamp):
    # What CUDA runs, traced by dynamo and functionalised by AOT autograd; aot_eager skips only the
    # code generation, so this runs on CPU in seconds.
    div = make_divergence(direction, 0.4, clamp)
    g = torch.Generator().manual_seed(16)
    a, b = (torch.randn(9, 53, generator=g, dtype=F64) * 3 for _ in range(2))
    compiled = torch.compile(_make_rows_function(div), backend="aot_eager")
    got = compiled(a.clone(), b.clone(), True)
    want = full_rows(div, a.clone(), b.clone(), True)
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) <= 1e-13
