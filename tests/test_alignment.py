"""Alignment of two byte-level tokenizations: exact bytes, chunks, sums and the exact-match map.

The property test runs 1,000 seeded random texts (ASCII, multi-byte UTF-8 that the student
splits across tokens, whitespace runs, digits) and 200 random student id sequences (whose bytes
need not be UTF-8 at all) through decode -> teacher tokenization -> chunks -> answer, with
random teacher log-probs: the alignment, not the model, is what is checked here (the servers'
suite checks the model's numbers).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from proctor.server.alignment.answer import align_answer
from proctor.server.alignment.chunks import chunk
from proctor.server.alignment.students import StudentTokenizerError, StudentTokenizers
from proctor.server.alignment.token_bytes import NotByteLevel, TokenBytes
from proctor.server.alignment.vocab_map import exact_match_map, identical

WORDS = ["the", "teacher", "student", "scores", "token", "fox", "lazy", "dog", "distil", "a", "über", "naïve",
         "café", "東京", "数学", "🙂", "±", "×", "→", "≤", "ß", "Ж", "λ", "🚀", "é", "ñ"]
SPACES = [" ", "  ", "\t", "\n", "\n\n", " \t ", "   "]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 30)):
        kind = rng.random()
        if kind < 0.45:
            parts.append(rng.choice(WORDS))
        elif kind < 0.65:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
        elif kind < 0.85:
            parts.append(rng.choice(SPACES))
        else:
            parts.append("".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 4))))
        if rng.random() < 0.6:
            parts.append(" ")
    return "".join(parts)


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, tiny_student_dir):
    teacher = AutoTokenizer.from_pretrained(tiny_model_dir)
    student = AutoTokenizer.from_pretrained(tiny_student_dir)
    return teacher, student, TokenBytes.of(teacher), TokenBytes.of(student)


def _check_alignment(data: bytes, student_ids: np.ndarray, tables, rng: np.random.Generator) -> None:
    teacher_table, student_table = tables
    assert student_table.decode(student_ids) == data
    teacher_ids = teacher_table.encode(data)
    assert teacher_table.decode(teacher_ids) == data
    chunks = chunk(student_table.lengths[student_ids], teacher_table.lengths[teacher_ids])
    # Every chunk: at least one token of each side, both spelling exactly the chunk's bytes;
    # the chunks cover the response once, in order.
    starts = {side: np.concatenate([[0], stops[:-1]]) for side, stops in
              (("s", chunks.student_stops), ("t", chunks.teacher_stops), ("b", chunks.byte_stops))}
    assert chunks.byte_stops[-1] == len(data) and chunks.student_stops[-1] == len(student_ids)
    assert chunks.teacher_stops[-1] == len(teacher_ids)
    assert (chunks.student_stops > starts["s"]).all() and (chunks.teacher_stops > starts["t"]).all()
    assert (chunks.byte_stops > starts["b"]).all()
    for c in range(chunks.count):
        piece = data[starts["b"][c]:chunks.byte_stops[c]]
        assert student_table.decode(student_ids[starts["s"][c]:chunks.student_stops[c]]) == piece
        assert teacher_table.decode(teacher_ids[starts["t"][c]:chunks.teacher_stops[c]]) == piece
    assert np.array_equal(chunks.student_chunk, np.repeat(np.arange(chunks.count), np.diff(chunks.student_stops,
                                                                                           prepend=0)))
    # Chunk log-likelihoods: each chunk's once, they sum to the teacher's total over the response.
    logprobs = torch.from_numpy(-rng.exponential(3.0, len(teacher_ids)).astype(np.float32))
    answer = align_answer(chunks, first_row=5, teacher_sequence=teacher_ids, teacher_first_row=3,
                          teacher_logprobs=logprobs, teacher_topk=None, vocab_map=np.zeros(1, dtype=np.int64))
    first_of_chunk = starts["s"]
    total = answer.chunk_logprobs.double()[first_of_chunk].sum()
    assert abs(float(total) - float(logprobs.double().sum())) <= 1e-5 * max(1.0, abs(float(total)))


def test_1000_random_texts_align_exactly(tokenizers):
    _, student, teacher_table, student_table = tokenizers
    rng = random.Random(26)
    numbers = np.random.default_rng(26)
    split_characters = 0
    for _ in range(1000):
        text = random_text(rng)
        ids = np.asarray(student.backend_tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        split_characters += sum(1 for i in ids if student_table.pieces[i] and not _is_utf8(student_table.pieces[i]))
        _check_alignment(text.encode(), ids, (teacher_table, student_table), numbers)
    assert split_characters > 100, "the texts must split multi-byte characters across student tokens"


def test_random_student_ids_align_even_when_their_bytes_are_not_utf8(tokenizers):
    """A sampled response is any id sequence: bytes that are not UTF-8 get the teacher's byte tokens."""
    _, _, teacher_table, student_table = tokenizers
    rng = np.random.default_rng(7)
    ordinary = np.flatnonzero(~student_table.special)
    invalid = 0
    for _ in range(200):
        ids = rng.choice(ordinary, size=rng.integers(1, 40))
        data = student_table.decode(ids)
        invalid += not _is_utf8(data)
        _check_alignment(data, ids, (teacher_table, student_table), rng)
    assert invalid > 50


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_exact_match_map_pairs_decode_to_the_same_bytes_in_both_vocabularies(tokenizers):
    teacher, student, teacher_table, student_table = tokenizers
    mapping = exact_match_map(teacher_table, student_table)
    pairs = [(t, int(s)) for t, s in enumerate(mapping) if s >= 0]
    assert len(pairs) > 200
    student_vocab = student.get_vocab()
    for t, s in pairs:  # byte-level token strings spell bytes one to one: equal strings, equal bytes
        assert teacher.convert_ids_to_tokens(t) == student.convert_ids_to_tokens(s)
        assert teacher.decode([t]) == student.decode([s])
    for t, s in enumerate(mapping):  # and nothing that could match was left out
        if s < 0 and t not in teacher.all_special_ids:
            assert teacher.convert_ids_to_tokens(t) not in student_vocab
    specials = {teacher.convert_ids_to_tokens(t) for t in teacher.all_special_ids}
    assert all(student.convert_ids_to_tokens(int(mapping[teacher.convert_tokens_to_ids(tok)])) == tok
               for tok in specials & set(student.all_special_tokens))
    assert not identical(teacher_table, student_table) and identical(teacher_table, TokenBytes.of(teacher))


def test_top_k_maps_at_one_to_one_chunks_only_and_reports_the_unmapped_mass(tokenizers):
    _, student, teacher_table, student_table = tokenizers
    data = "The quick brown fox 12345 東京".encode()
    ids = np.asarray(student.backend_tokenizer.encode(data.decode(), add_special_tokens=False).ids)
    teacher_ids = teacher_table.encode(data)
    chunks = chunk(student_table.lengths[ids], teacher_table.lengths[teacher_ids])
    mapping = exact_match_map(teacher_table, student_table)
    rng = torch.Generator().manual_seed(0)
    top_ids = torch.randint(0, teacher_table.size, (len(teacher_ids), 6), generator=rng)
    top_lp = torch.log_softmax(torch.randn(len(teacher_ids), 6, generator=rng), -1) - 0.5
    answer = align_answer(chunks, first_row=2, teacher_sequence=teacher_ids, teacher_first_row=0,
                          teacher_logprobs=torch.zeros(len(teacher_ids)), teacher_topk=(top_ids, top_lp),
                          vocab_map=mapping)
    single = chunks.one_to_one()[chunks.student_chunk]
    assert single.any() and (~single).any()
    for row in range(len(ids)):
        if not single[row]:
            assert (answer.topk_ids[row] == -1).all() and torch.isnan(answer.unmapped_mass[row])
            continue
        j = int(chunks.teacher_stops[chunks.student_chunk[row]] - 1)
        want = [int(mapping[t]) for t in top_ids[j]]
        assert answer.topk_ids[row].tolist() == want
        lost = sum(float(top_lp[j, k].exp()) for k in range(6) if want[k] < 0)
        assert abs(float(answer.unmapped_mass[row]) - lost) < 1e-6
        assert torch.equal(answer.topk_logprobs[row][answer.topk_ids[row] >= 0], top_lp[j][torch.tensor(want) >= 0])


def test_a_tokenizer_that_is_not_byte_level_is_refused_at_load(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(NotByteLevel):
        TokenBytes.of(word_level)
    word_level.save_pretrained(tmp_path / "words")
    with pytest.raises(StudentTokenizerError, match="only byte-level tokenizers"):
        StudentTokenizers({"words": str(tmp_path / "words")}).load({})
    with pytest.raises(StudentTokenizerError, match="not a directory"):
        StudentTokenizers({"gone": str(tmp_path / "gone")}).load({})
