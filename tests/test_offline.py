"""Offline teacher signals through a real server: `proctor score-dataset`, its shards read back, the
resume rule, the Ray Data job and `proctor verify-dataset`.

One module-scoped server holds two torch teachers: `tiny` in a replica worker (batch-invariant, so
that two runs of a job write the same bytes) and `other` in the front (other weights: another
fingerprint).
One reference job (`stored`) is scored once and compared with everything else.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from proctor.client import SyncTeacherClient
from proctor.client.loss import distillation_loss
from proctor.client.offline import (
    IdentityMismatch,
    JobSettings,
    OfflineScores,
    OfflineStream,
    codecs,
    hf_dataset,
    run_job,
)
from proctor.client.offline.verify import verify_dataset

from support.reference import reference_rows
from support.scoring import sequences

K = 64
BLOCK_ROWS = 8
ROWS = 96


@pytest.fixture(scope="module")
def teachers(tiny_model_dir, other_model_dir):
    from proctor.server.engines.base import EngineSpec
    from proctor.server.engines.factory import create_engine
    from proctor.server.front.fleet.routing import Replica, ReplicaSet, Router, engine_replica
    from proctor.server.worker.replica_engine import create_replica_engine

    from support.servers import start_server

    tiny = EngineSpec(name="torch", model_path=str(tiny_model_dir), max_topk=K, inference={"batch_invariant": True})
    other = EngineSpec(name="torch", model_path=str(other_model_dir), max_topk=K)

    async def build_other():  # in the front: it only has to answer with another fingerprint
        return create_engine(other)

    server = start_server(Router([
        ReplicaSet("tiny", [engine_replica("tiny-0", partial(create_replica_engine, tiny, name="tiny-0"))],
                   tokenizer_path=str(tiny_model_dir)),
        ReplicaSet("other", [Replica("other-0", build_other)], tokenizer_path=str(other_model_dir)),
    ]))
    yield f"grpc://{server.grpc_target}"
    server.stop()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """ROWS sequences, each with its prompt length (every third shares one prompt)."""
    path = tmp_path_factory.mktemp("input") / "rows.jsonl"
    shared = [7, 8, 9, 10, 11]
    with open(path, "w") as handle:
        for index, ids in enumerate(sequences(ROWS, seed=45, length=(8, 40))):
            prompt = shared if index % 3 == 0 else ids[:4]
            handle.write(json.dumps({"token_ids": prompt + ids[4:], "prompt_length": len(prompt)}) + "\n")
    return path


def settings(source: Path, out: Path, target: str, **changes) -> JobSettings:
    return JobSettings(**{"source": str(source), "out": str(out), "target": target, "teacher_key": "tiny",
                          "topk": K, "block_rows": BLOCK_ROWS, "max_concurrency": 8, **changes})


@pytest.fixture(scope="module")
def stored(teachers, source, tmp_path_factory) -> Path:
    """The reference job: the whole input scored once, in the main (u8) form."""
    out = tmp_path_factory.mktemp("stored")
    report = asyncio.run(run_job(settings(source, out, teachers)))
    assert report.rows == ROWS and report.skipped == 0
    return out


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("shard-*.parquet"))}


def stored_indices(directory: Path) -> list[int]:
    return sorted(i for p in directory.glob("shard-*.parquet") for i in pq.read_table(p, columns=["index"])["index"].to_pylist())


def test_ids_pack_into_the_fewest_bits_and_u8_stays_within_its_stated_error():
    assert [codecs.id_bits(v) for v in (512, 513, 151_936)] == [9, 10, 18]
    rng = np.random.default_rng(0)
    for bits in (9, 17, 18):
        ids = rng.integers(0, 1 << bits, size=(7, 64))
        packed = codecs.pack_ids(ids, bits)
        assert len(packed) == -(-ids.size * bits // 8)
        np.testing.assert_array_equal(codecs.unpack_ids(packed, ids.size, bits).reshape(ids.shape), ids)
    values = np.sort(rng.normal(-6, 3, size=(50, 64)), axis=1)[:, ::-1]
    data, offset, scale = codecs.encode_topk_logprobs(values, "u8")
    decoded = codecs.decode_topk_logprobs(data, values.shape, "u8", offset, scale)
    assert (np.abs(decoded - values) <= codecs.row_error(decoded, "u8", scale)).all()
    assert np.abs(decoded - values).max() > 0.25 * scale.max()  # the bound is near what happens, not loose
    assert codecs.topk_kl(values, decoded).mean() < 1e-3


def test_stored_rows_equal_online_and_the_float64_reference_within_the_stated_error(stored, teachers, tiny_model_dir):
    dataset = OfflineScores(stored)
    assert len(dataset) == ROWS and [dataset[i].index for i in range(ROWS)] == list(range(ROWS))
    with SyncTeacherClient(teachers) as client:
        online = [client.score(s.token_ids, teacher_key="tiny", topk=K, prompt_length=s.prompt_length)
                  for s in dataset]
    for item, live in zip(dataset, online, strict=True):
        scores = item.scores
        assert (scores.first_row, scores.num_tokens) == (live.first_row, live.num_tokens)
        assert scores.topk_ids.dtype == torch.int32 and scores.logprobs.dtype == torch.float32
        torch.testing.assert_close(scores.topk_ids, live.topk_ids, rtol=0, atol=0)
        torch.testing.assert_close(scores.logprobs, live.logprobs, rtol=0, atol=0)  # stored float32, as served
        assert ((scores.topk_logprobs - live.topk_logprobs).abs() <= item.topk_error).all()
        reference = reference_rows(tiny_model_dir, item.token_ids.tolist(), item.prompt_length)
        exact = reference.distributions.gather(1, scores.topk_ids.long())
        assert ((scores.topk_logprobs.double() - exact).abs() <= item.topk_error.double() + 1e-5).all()
        torch.testing.assert_close(scores.logprobs.double(), reference.logprobs, rtol=0, atol=1e-5)


def test_the_stream_and_the_hugging_face_reader_give_the_same_tensors(stored):
    dataset = OfflineScores(stored)
    streamed = list(OfflineStream(stored))
    hf = hf_dataset(stored)
    assert len(streamed) == len(hf) == len(dataset)
    for i in (0, 17, ROWS - 1):
        torch.testing.assert_close(streamed[i].scores.topk_logprobs, dataset[i].scores.topk_logprobs)
        row = hf[i]
        torch.testing.assert_close(row["topk_logprobs"], dataset[i].scores.topk_logprobs, rtol=0, atol=0)
        torch.testing.assert_close(row["topk_ids"], dataset[i].scores.topk_ids, rtol=0, atol=0)
        assert row["first_row"] == dataset[i].prompt_length


def test_the_top_k_and_sampled_losses_take_stored_rows_as_they_take_online_ones(stored, teachers):
    batch = [OfflineScores(stored)[i] for i in range(6)]
    with SyncTeacherClient(teachers) as client:
        online = [client.score(s.token_ids, teacher_key="tiny", topk=K, prompt_length=s.prompt_length) for s in batch]
    rows = sum(s.scores.num_rows for s in batch)
    logits = torch.randn(rows, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    targets = torch.cat([s.token_ids[s.prompt_length:] for s in batch])
    student_logprobs = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)

    def loss(scores, mode: str) -> float:
        if mode == "k3":
            given = {"student_logprobs": student_logprobs, "teacher_logprobs": torch.cat([s.logprobs for s in scores])}
        else:
            given = {"student_logits": logits, "teacher_topk_ids": torch.cat([s.topk_ids for s in scores]).long(),
                     "teacher_topk_logprobs": torch.cat([s.topk_logprobs for s in scores])}
        config = {"loss_mode": mode, "topk": K, "use_task_rewards": False, "log_prob_min_clamp": None}
        return distillation_loss(config, **given).metrics["loss"]

    for mode in ("forward_kl_topk", "k3"):
        assert loss([s.scores for s in batch], mode) == pytest.approx(loss(online, mode), abs=5e-3)


def test_a_sigkill_mid_job_then_the_same_command_gives_identical_shards_once_each(stored, teachers, source, tmp_path):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "proctor.server.cli.main", "score-dataset", str(source), "--out", str(out),
               "--target", teachers, "--teacher", "tiny", "--topk", str(K), "--block-rows", str(BLOCK_ROWS),
               "--max-concurrency", "2"]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = 0
    for line in job.stderr:
        seen += line.startswith("shard-")
        if seen == 2:
            os.kill(job.pid, signal.SIGKILL)
            break
    job.wait(60)
    assert job.returncode == -signal.SIGKILL
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    assert 2 <= len(before) < ROWS // BLOCK_ROWS
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"{len(before)} blocks already stored" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet") if p.name in before} == before
    assert digests(out) == digests(stored)  # the same bytes as the run never killed
    assert stored_indices(out) == list(range(ROWS))  # 0 lost, 0 duplicated
    assert not list(out.glob("*.tmp"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == ROWS
    assert manifest == json.loads((stored / "manifest.json").read_text())


@pytest.mark.parametrize(("change", "named"), [
    ({"topk": 32}, "K (--topk): stored 64, now 32"),
    ({"temperature": 0.5}, "temperature: stored None, now 0.5"),
    ({"teacher_key": "other"}, "teacher fingerprint: stored"),
])
def test_another_teacher_k_or_temperature_refuses_to_append_naming_what_differs(stored, teachers, source, change,
                                                                                   named):
    before = digests(stored)
    with pytest.raises(IdentityMismatch, match="refusing to append") as refused:
        asyncio.run(run_job(settings(source, stored, teachers, **change)))
    assert named in str(refused.value)
    assert digests(stored) == before


def test_verify_dataset_reports_the_largest_difference_against_the_stated_error(stored, teachers, tmp_path):
    from typer.testing import CliRunner

    from proctor.server.cli.main import app

    good = CliRunner().invoke(app, ["verify-dataset", str(stored), "--target", teachers, "--sample", "12"])
    assert good.exit_code == 0, good.output
    assert "stated quantization error" in good.output and good.output.strip().endswith("ok")
    report = asyncio.run(verify_dataset(stored, teachers, sample=12))
    assert 0 < report.topk_diff <= report.topk_stated + 1e-5 and report.topk_over == 0
    assert report.ids_equal == report.positions
    other = CliRunner().invoke(app, ["verify-dataset", str(stored), "--target", teachers, "--teacher", "other",
                                     "--sample", "4"])
    assert other.exit_code == 1 and other.output.startswith("fingerprint: stored")
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for path in stored.glob("*"):
        table = pq.read_table(path) if path.suffix == ".parquet" else None
        if table is None:
            (tampered / path.name).write_bytes(path.read_bytes())
            continue
        offsets = table["topk_offset"].to_pylist()
        offsets[0][0] += 0.05  # one stored row moved by more than its grid's half step
        column = pa.array(offsets, type=table["topk_offset"].type)
        table = table.set_column(table.schema.get_field_index("topk_offset"), "topk_offset", column)
        pq.write_table(table, tampered / path.name)
    bad = asyncio.run(verify_dataset(tampered, teachers, sample=ROWS))
    assert bad.topk_over > 0 and not bad.ok


def test_the_ray_data_job_writes_the_single_process_shards_and_resumes_the_same_way(stored, teachers, source,
                                                                                     tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from proctor.client.offline.ray_job import run_ray_job

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 80 << 20,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        out = tmp_path / "ray"
        out.mkdir()
        kept = sorted(stored.glob("shard-*.parquet"))[::2]  # half the blocks done by the single-process job
        for path in kept:
            (out / path.name).write_bytes(path.read_bytes())
        report = run_ray_job(settings(source, out, teachers), actors=2, cpus_per_actor=1)
        assert report.skipped == len(kept) and report.rows == ROWS - len(kept) * BLOCK_ROWS
        assert sorted(e.file for e in report.written) == sorted(set(digests(stored)) - {p.name for p in kept})
        assert digests(out) == digests(stored)
        assert json.loads((out / "manifest.json").read_text()) == json.loads((stored / "manifest.json").read_text())
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_the_noisy_student_trains_from_the_stored_top_k_alone(stored, tiny_model_dir):
    from proctor.trainer_adapter.offline_demo import train_offline

    logs = train_offline(stored, tiny_model_dir, steps=8, batch=8, sequences=16)
    assert logs[-1]["loss"] < 0.5 * logs[0]["loss"]


def test_f16_score_ids_and_hidden_states_are_stored_as_online(teachers, source, tmp_path):
    rows = [json.loads(line) for line in source.read_text().splitlines()[:BLOCK_ROWS]]
    for row in rows:  # each row's ids to score: three ids a response row
        row["student_ids"] = [[1, 2, i % 512] for i in range(len(row["token_ids"]) - row["prompt_length"])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "f16"
    asyncio.run(run_job(settings(path, out, teachers, topk_form="f16", score_ids_column="student_ids",
                                 hidden_form="bfloat16")))
    with SyncTeacherClient(teachers) as client:
        for item in OfflineScores(out):
            row = rows[item.index]
            live = client.stream_hidden_states(item.token_ids, teacher_key="tiny", topk=K,
                                               prompt_length=item.prompt_length, score_ids=row["student_ids"],
                                               hidden_form="bfloat16")
            assert item.scores.hidden_states.dtype == torch.bfloat16
            torch.testing.assert_close(item.scores.hidden_states, live.hidden_states, rtol=0, atol=0)
            torch.testing.assert_close(item.scores.score_logprobs, live.score_logprobs, rtol=0, atol=0)
            assert ((item.scores.topk_logprobs - live.topk_logprobs).abs() <= item.topk_error).all()
            assert item.topk_error.max() < 5e-3  # f16's stated error: |x| * 2^-11


def test_text_rows_go_through_the_teachers_tokenizer_and_every_source_reads_the_same(tiny_model_dir, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    from proctor.client.offline.inputs import InputRows, RowEncoder

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    encoder = RowEncoder(tiny_model_dir)
    both = encoder.encode(0, {"prompt": "the cat", "response": " sat down"})
    prompt = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    assert both.token_ids == prompt + tokenizer(" sat down", add_special_tokens=False)["input_ids"]
    assert both.prompt_length == len(prompt)
    chat = encoder.encode(1, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    head = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.token_ids[: chat.prompt_length] == tokenizer(head, add_special_tokens=False)["input_ids"]
    records = [{"token_ids": [1, 2, 3, i], "prompt_length": 2} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    for name in ("rows.jsonl", "rows.parquet", "saved"):
        assert InputRows(str(tmp_path / name)).rows(1, 4) == records[1:4]
