"""The verl adapter, driven by verl's own teacher code (verl 0.9.1 where it imports).

verl's `AsyncTeacherLLMServerManager` is built without its config parsing (verl's
`DistillationLossConfig` pulls in `datasets`, absent here) but every method called is verl's:
`compute_teacher_logprobs_single`, `_resolve_teacher_key`, `_get_teacher_sampling_params`,
`_pad_teacher_outputs`. verl's vLLM row extraction (`extract_prompt_logprobs`) is read
from verl's source and run on vLLM-shaped log-probs of the reference teacher.
"""

from __future__ import annotations

import ast
import asyncio
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch

from proctor.client import TeacherClient
from proctor.trainer_adapter.verl import (
    ProctorTeacherClient,
    ProctorTeacherModelManager,
    make_teacher_clients,
    media_item,
    teacher_unembeddings,
    verl_teacher_batch,
    verl_teacher_keys,
)

from support.reference import assert_matches_reference, reference_model, reference_rows

teacher_manager = pytest.importorskip("verl.experimental.teacher_loop.teacher_manager")
PAD = 0


def verl_config(target: str, teacher_models: dict, **proctor: Any) -> dict:
    return {"distillation": {"enabled": True, "teacher_key": "data_source", "teacher_models": teacher_models},
            "proctor": {"target": target, **proctor}}


def verl_manager(clients: dict, *, topk: int):
    """verl's AsyncTeacherLLMServerManager over our clients (its own methods, our transport)."""
    manager = object.__new__(teacher_manager.AsyncTeacherLLMServerManager)
    manager.teacher_key = "data_source"
    manager.teacher_model_configs = {k: SimpleNamespace(inference=SimpleNamespace(temperature=1.0)) for k in clients}
    manager.distillation_loss_config = SimpleNamespace(topk=topk, loss_settings=SimpleNamespace(use_topk=topk > 0))
    manager.teacher_client = clients
    return manager


def verl_extract_prompt_logprobs():
    """verl's `extract_prompt_logprobs`, compiled from verl's source (its module imports vLLM)."""
    import verl

    path = Path(verl.__file__).parent / "workers/rollout/vllm_rollout/utils.py"
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "extract_prompt_logprobs")
    namespace = {"Optional": Optional, "RequestOutput": Any}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["extract_prompt_logprobs"]


def vllm_prompt_logprobs(model_dir: Path, ids: list[int], k: int):
    """What vLLM returns as `prompt_logprobs`: None, then per token {id: Logprob(logprob, rank)}
    with the top-k plus the actual token (rank 1-based)."""
    logp = reference_rows(model_dir, ids).distributions  # row j predicts token j
    out = [None]
    for j, row in enumerate(logp, start=1):
        order = torch.argsort(row, descending=True)
        ranks = {int(t): r + 1 for r, t in enumerate(order.tolist())}
        actual = ids[j]
        chosen = [actual] + [int(t) for t in order[:k] if int(t) != actual]
        out.append({t: SimpleNamespace(logprob=float(row[t]), rank=ranks[t]) for t in chosen})
    return out


@pytest.mark.parametrize("topk", [0, 5])
async def test_verls_teacher_manager_gets_what_vllm_would_give_it(torch_server, tiny_model_dir, topk):
    ids = [(11 * j + 3) % 512 for j in range(14)]
    clients = make_teacher_clients(verl_config(f"grpc://{torch_server.grpc_target}", {"teacher_model": {}}))
    manager = verl_manager(clients, topk=topk)
    teacher_ids, teacher_logprobs = await manager.compute_teacher_logprobs_single(sequence_ids=ids)
    expected: dict = {}
    verl_extract_prompt_logprobs()(SimpleNamespace(prompt_logprobs=vllm_prompt_logprobs(tiny_model_dir, ids, topk)),
                                   topk, expected)
    want_ids = torch.tensor(expected["prompt_ids"], dtype=torch.int32)
    want_lps = torch.tensor(expected["prompt_logprobs"])
    assert teacher_ids.shape == want_ids.shape == (14, max(topk, 1))
    assert torch.equal(teacher_ids, want_ids)
    torch.testing.assert_close(teacher_logprobs, want_lps, atol=1e-4, rtol=0)


async def test_verls_padding_and_concatenation_equal_verl_teacher_batch(torch_server):
    sequences = [([5, 6, 7], [8, 9, 10, 11]), ([1, 2, 3, 4, 5], [6])]
    prompt_width, response_width, topk = 6, 5, 3
    clients = make_teacher_clients(verl_config(f"grpc://{torch_server.grpc_target}", {"teacher_model": {}}))
    manager = verl_manager(clients, topk=topk)
    rows = []
    for prompt, response in sequences:  # what verl's agent loop does per sequence, then cat
        ids, lps = await manager.compute_teacher_logprobs_single(sequence_ids=prompt + response)
        rows.append(teacher_manager._pad_teacher_outputs(
            ids, lps, prompt_width=prompt_width, response_width=response_width, prompt_length=len(prompt),
            response_length=len(response), pad_token_id=PAD))
    want_ids = torch.cat([r[0] for r in rows])
    want_lps = torch.cat([r[1] for r in rows])
    async with TeacherClient(f"grpc://{torch_server.grpc_target}") as client:
        # One at a time, as verl's loop above scored them: the same forward passes, so the same
        # float rounding, and the comparison is exact about the layout (score_many would batch).
        scores = [await client.score(p + r, topk=topk) for p, r in sequences]
    got = verl_teacher_batch(scores, [p + r for p, r in sequences], [len(p) for p, _ in sequences],
                             prompt_width=prompt_width, response_width=response_width, topk=topk, pad_token_id=PAD)
    assert torch.equal(got["teacher_ids"], want_ids)
    assert torch.equal(got["teacher_logprobs"], want_lps)


async def test_multi_teacher_routing_goes_through_verls_resolver(two_teachers, tiny_model_dir, other_model_dir):
    config = verl_config(f"grpc://{two_teachers.grpc_target}", {
        "teacher_model": {},
        "gsm": {"key": "openai/gsm8k", "model_path": "unused"},
        "geometry": {"key": "hiyouga/geometry3k", "model_path": "unused"},
    })
    clients = ProctorTeacherModelManager(config).get_client()
    assert sorted(clients) == ["hiyouga/geometry3k", "openai/gsm8k"]
    manager = verl_manager(clients, topk=0)
    ids = [4, 8, 15, 16, 23, 42]
    _, geo = await manager.compute_teacher_logprobs_single(sequence_ids=ids, routing_key="hiyouga/geometry3k")
    _, math = await manager.compute_teacher_logprobs_single(sequence_ids=ids, routing_key="openai/gsm8k")
    assert_matches_reference(geo[:-1, 0], other_model_dir, ids, atol=1e-4)
    assert_matches_reference(math[:-1, 0], tiny_model_dir, ids, atol=1e-4)
    with pytest.raises(ValueError, match="No teacher configured for routing key"):
        await manager.compute_teacher_logprobs_single(sequence_ids=ids, routing_key="lmsys/chat")


async def test_hidden_states_variant_carries_verl_rows_and_the_unembedding(torch_server, tiny_model_dir):
    config = verl_config(f"grpc://{torch_server.grpc_target}", {"teacher_model": {}}, hidden_states=True)
    clients = make_teacher_clients(config)
    ids = [9, 8, 7, 6, 5, 4, 3]
    out = await clients["default"].generate("r1", prompt_ids=ids, sampling_params={"prompt_logprobs": 0})
    hidden = out.extra_fields["teacher_hidden_states"]
    assert hidden.shape == (7, 64) and out.extra_fields["teacher_key"] == "tiny"
    want = reference_rows(tiny_model_dir, ids).hidden_states
    torch.testing.assert_close(hidden[:-1].double(), want.double(), atol=1e-4, rtol=1e-4)
    weights = await teacher_unembeddings(clients)
    assert torch.equal(weights["default"], reference_model(tiny_model_dir).get_output_embeddings().weight)


async def test_client_survives_pickling_for_ray_workers(torch_server):
    client = ProctorTeacherClient(f"grpc://{torch_server.grpc_target}")
    await client.generate("a", prompt_ids=[1, 2, 3], sampling_params={"prompt_logprobs": 2})
    copy = pickle.loads(pickle.dumps(client))
    out = await copy.generate("b", prompt_ids=[1, 2, 3], sampling_params={"prompt_logprobs": 2})
    assert np.array(out.extra_fields["prompt_ids"]).shape == (3, 2)
    await asyncio.gather(client.close(), copy.close())


def test_teacher_keys_resolve_as_verl_resolves_them():
    assert verl_teacher_keys({"distillation": {"teacher_models": {"teacher_model": {}}}}) == ["default"]
    models = {"teacher_model": {}, "a": {"key": "x/y"}, "b": {"key": "z"}}
    assert verl_teacher_keys({"distillation": {"teacher_models": models}}) == ["x/y", "z"]
    with pytest.raises(ValueError, match=r"proctor\.target"):
        make_teacher_clients({"distillation": {"teacher_models": {"teacher_model": {}}}})


def test_media_items_become_bytes_with_a_type():
    from PIL import Image

    png = media_item(Image.new("RGB", (2, 2)), "images")
    assert png.media_type == "image/png" and png.data.startswith(b"\x89PNG")
    waveform = np.linspace(-1, 1, 16, dtype=np.float32)
    audio = media_item((waveform, 24000), "audios")
    assert audio.media_type == "application/x-npy; rate=24000"
    # What the server decodes from it: the waveform at its own rate, not a default one.
    from proctor.server.engines.base import MediaItem
    from proctor.server.engines.media import decode_audio

    samples, rate = decode_audio(MediaItem(audio.data, audio.media_type))
    assert rate == 24000 and np.array_equal(samples, waveform)
    assert media_item(b"RIFF....WAVE", "audios").media_type == "audio/wav"
    with pytest.raises(ValueError, match="media type"):
        media_item(b"????", "videos")


# -- shared prompts on verl's teacher path ----------------------------------------------------------


@pytest.fixture(scope="module")
def reuse_server(tiny_model_dir):
    """Two torch replicas that reuse shared prefixes of 16 tokens and more."""
    from support.routers import reuse_router
    from support.servers import start_server

    server = start_server(reuse_router(tiny_model_dir))
    yield server
    server.stop()


def _reuse_counts(server) -> tuple[float, float]:
    from support.servers import metric_value

    return (metric_value(server, "proctor:prompt_reuse_hits_total"),
            metric_value(server, "proctor:prompt_reuse_misses_total"))


def _grpo_groups(seed: int, groups: int = 3, n: int = 8) -> list[tuple[list[int], list[int]]]:
    """`groups` prompts of 40-70 tokens, each rolled out `n` times (responses of 3-20), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(3, 512, (int(torch.randint(40, 71, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n):
            size = int(torch.randint(3, 21, (1,), generator=gen))
            samples.append((prompt, torch.randint(3, 512, (size,), generator=gen).tolist()))
    order = torch.randperm(len(samples), generator=gen).tolist()
    return [samples[i] for i in order]


async def test_verls_teacher_calls_of_grpo_groups_reuse_seven_of_eight(reuse_server, tiny_model_dir):
    clients = make_teacher_clients(verl_config(f"grpc://{reuse_server.grpc_target}", {"teacher_model": {}}))
    manager = verl_manager(clients, topk=4)
    samples = _grpo_groups(seed=7)
    hits, misses = _reuse_counts(reuse_server)
    # verl's own per-sample call, the whole sequence only (no split): all members in flight at once.
    answers = await asyncio.gather(*(manager.compute_teacher_logprobs_single(sequence_ids=p + r) for p, r in samples))
    hits_after, misses_after = _reuse_counts(reuse_server)
    assert (hits_after - hits, misses_after - misses) == (3 * 7, 3)
    for (prompt, response), (_, logprobs) in zip(samples[:6], answers[:6], strict=True):
        ids = prompt + response
        want = reference_rows(tiny_model_dir, ids).topk(4)[1]
        torch.testing.assert_close(logprobs[:-1].double(), want, atol=1e-4, rtol=0)


async def test_verls_agent_loop_sends_the_prompt_length_it_knows(reuse_server, tiny_model_dir):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from proctor.trainer_adapter.verl import patch_verl, unpatch_verl

    patch_verl()
    try:
        clients = make_teacher_clients(verl_config(f"grpc://{reuse_server.grpc_target}", {"teacher_model": {}}))
        worker = object.__new__(AgentLoopWorker)  # verl's own method, our manager behind it
        worker.distillation_enabled, worker.teacher_key = True, "data_source"
        worker.teacher_server_manager = verl_manager(clients, topk=0)
        samples = _grpo_groups(seed=8, groups=2)
        outputs = [SimpleNamespace(multi_modal_data={}, mm_processor_kwargs=None, extra_fields={}) for _ in samples]
        hits, misses = _reuse_counts(reuse_server)
        await asyncio.gather(*(worker._compute_teacher_logprobs(out, prompt_ids=p, response_ids=r, validate=False)
                               for out, (p, r) in zip(outputs, samples, strict=True)))
        hits_after, misses_after = _reuse_counts(reuse_server)
    finally:
        unpatch_verl()
    assert (hits_after - hits, misses_after - misses) == (2 * 7, 2)
    for output, (prompt, response) in zip(outputs, samples, strict=True):
        logprobs = output.extra_fields["teacher_logprobs"][:, 0]
        # Rows inside the prompt were not scored (zeros, which verl masks); from the last prompt token on,
        # verl's row i holds token i+1's log-prob.
        assert torch.equal(logprobs[: len(prompt) - 1], torch.zeros(len(prompt) - 1))
        want = reference_rows(tiny_model_dir, prompt + response, len(prompt)).logprobs
        torch.testing.assert_close(logprobs[len(prompt) - 1 : -1].double(), want, atol=1e-4, rtol=0)
