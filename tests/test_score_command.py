"""`proctor score --text`: text is tokenized as the scored teacher tokenizes it, or refused.

The command tokenizes text on the caller's side; a tokenizer that is not the teacher's turns the
text into other ids, which the teacher scores and the table prints as its answer (exit 0). So the
command proves the match first (`TeacherInfo.tokenizer_fingerprint`) and refuses in one line
naming `--tokenizer` when it cannot. The teacher here has another tokenizer than the built-in tiny
teacher's (the tiny student's: other merges, vocabulary 400), the command's default.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from proctor.server.cli.main import app
from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec

from support.reference import assert_matches_reference
from support.servers import start_server

TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tiny_student_dir):
    """A teacher whose tokenizer is not the tiny teacher's."""
    server = start_server(single_teacher_router(EngineSpec(name="torch", model_path=str(tiny_student_dir)),
                                                name="other"))
    yield server
    server.stop()


def _score(*args: str):
    return CliRunner().invoke(app, ["score", "--text", TEXT, "--topk", "0", *args])


def _table_rows(output: str) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of the table's scored rows."""
    rows = [re.match(r"\s*\d+\s+(\d+):'.*?'\s+(-?[\d.]+|nan|-inf)", line) for line in output.splitlines()[2:]]
    return [int(r.group(1)) for r in rows if r], [float(r.group(2)) for r in rows if r]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_text_with_a_tokenizer_not_the_teacher_s_is_refused_in_one_line(other_tokenizer_teacher, transport):
    target = other_tokenizer_teacher.grpc_target if transport == "grpc" else other_tokenizer_teacher.http_url
    done = _score("--target", target if transport == "http" else f"grpc://{target}")  # the default tokenizer
    assert done.exit_code == 1, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokenizer" in lines[0] and "'other'" in lines[0], done.stderr
    assert "Traceback" not in done.output and "teacher other: rows" not in done.output


def test_text_with_the_teacher_s_tokenizer_scores_its_ids(other_tokenizer_teacher, tiny_student_dir):
    done = _score("--target", f"grpc://{other_tokenizer_teacher.grpc_target}", "--tokenizer", str(tiny_student_dir))
    assert done.exit_code == 0, done.output
    ids = AutoTokenizer.from_pretrained(str(tiny_student_dir))(TEXT)["input_ids"]
    shown, logprobs = _table_rows(done.stdout)
    assert shown == ids[1:]  # rows 1..T-1, each the teacher's own id for the text
    assert_matches_reference(torch.tensor(logprobs), tiny_student_dir, ids, atol=1e-4)  # the table's 4 decimals


def test_the_default_tokenizer_is_proven_against_the_tiny_teacher_over_http(torch_server, tiny_model_dir):
    done = _score("--target", torch_server.http_url)
    assert done.exit_code == 0, done.output
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))(TEXT)["input_ids"]
    assert _table_rows(done.stdout)[0] == ids[1:]
