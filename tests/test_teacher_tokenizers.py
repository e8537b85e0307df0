"""A teacher's tokenizer is a property of the teacher (its `tokenizer_path`, from the serving
plan), read without looking inside its replicas: loaded here before any replica has started."""

from __future__ import annotations

from proctor.server.config import single_teacher_router
from proctor.server.engines.base import EngineSpec
from proctor.server.front.http.teacher_tokenizers import Tokenizers


async def test_the_tokenizer_comes_from_the_teachers_plan_not_its_replicas(tiny_model_dir):
    from transformers import AutoTokenizer

    router = single_teacher_router(EngineSpec(name="torch", model_path=str(tiny_model_dir)), name="tiny")
    teacher = router.teachers["tiny"]
    assert teacher.tokenizer_path == str(tiny_model_dir)
    assert all(replica.engine is None for replica in teacher.replicas)  # nothing started
    tokenizer = await Tokenizers().tokenizer(teacher)
    want = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert tokenizer is not None and tokenizer.encode("the teacher scores") == want.encode("the teacher scores")


async def test_a_teacher_without_a_tokenizer_path_has_none(tiny_model_dir):
    router = single_teacher_router(EngineSpec(name="torch", model_path=str(tiny_model_dir)), name="tiny")
    teacher = router.teachers["tiny"]
    teacher.tokenizer_path = None
    assert await Tokenizers().tokenizer(teacher) is None
