"""`proctor score`: one request from the shell, printed as a table a person can read.

It speaks the wire contract directly (stubs for gRPC, JSON for HTTP) rather than through
the trainer-side client, so the server package keeps no dependency on the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np

from proctor.proto import decode_tensor, scoring_pb2, scoring_pb2_grpc
from proctor.proto.routing_keys import UnroutableKey, key_table, route_key


class ScoreFailed(Exception):
    """What the command prints as its one line on stderr (exit 1): a refusal or the server's error."""


@dataclass
class RowScores:
    first_row: int
    logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    teacher: str


def tokenize(text: str, tokenizer_dir: Path | None):
    """The text's ids by the tokenizer in tokenizer_dir (default: the built-in tiny teacher's)."""
    from transformers import AutoTokenizer

    from proctor.server.cli.tiny_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or ensure_default_model()), local_files_only=True)
    return tok, tok(text)["input_ids"]


def _teachers(target: str, token: str | None) -> list[scoring_pb2.TeacherInfo]:
    """The server's ListTeachers answer, over the target's transport."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if target.startswith(("http://", "https://")):
        from google.protobuf.json_format import ParseDict

        reply = httpx.get(target.rstrip("/") + "/v1/teachers", headers=headers, timeout=60)
        if reply.status_code != 200:
            raise ScoreFailed(f"error {reply.status_code}: {reply.text[:200]}")
        return list(ParseDict(reply.json(), scoring_pb2.TeachersResponse(), ignore_unknown_fields=True).teachers)
    with grpc.insecure_channel(target.removeprefix("grpc://")) as channel:
        try:
            answer = scoring_pb2_grpc.TeacherScoringStub(channel).ListTeachers(
                scoring_pb2.TeachersRequest(), metadata=tuple(headers.items()) or None, timeout=60)
        except grpc.RpcError as exc:
            raise ScoreFailed(f"error {exc.code().name}: {exc.details()}") from exc
    return list(answer.teachers)


def check_teacher_tokenizer(target: str, teacher_key: str, tokenizer_dir: Path | None, token: str | None) -> None:
    """Refuse (one line, exit 1) unless the local tokenizer is provably the scored teacher's.

    Text tokenized by another tokenizer is scored as the wrong ids and printed as the teacher's
    answer; so the local tokenizer files' digest must equal the one the server reports for the
    teacher the key routes to (`TeacherInfo.tokenizer_fingerprint`, the same function)."""
    from proctor.server.cli.tiny_model import ensure_default_model
    from proctor.server.engines.fingerprint import tokenizer_fingerprint

    teachers = {t.name: t for t in _teachers(target, token)}
    try:
        name = route_key(teacher_key, key_table({n: t.keys for n, t in teachers.items()}))
    except UnroutableKey as exc:
        raise ScoreFailed(exc.message) from None
    local_dir = tokenizer_dir or ensure_default_model()
    local = tokenizer_fingerprint(local_dir)
    served = teachers[name].tokenizer_fingerprint
    if not served or local != served:
        reason = (f"the server reports no tokenizer fingerprint for teacher {name!r}" if not served else
                  f"tokenizer fingerprint {local or 'none'} at {local_dir} is not teacher {name!r}'s ({served})")
        raise ScoreFailed(f"cannot prove --text is tokenized as the teacher tokenizes it: {reason}; "
                         "pass the teacher's own tokenizer directory with --tokenizer DIR, or send ids with --ids")


def score_once(
    target: str,
    token_ids: list[int],
    *,
    teacher_key: str = "",
    prompt_length: int | None = None,
    topk: int = 5,
    token: str | None = None,
) -> RowScores:
    """Score one sequence on a grpc:// or http:// target."""
    if target.startswith("http://") or target.startswith("https://"):
        body = {"token_ids": token_ids, "teacher_key": teacher_key, "logprobs": True, "topk": topk}
        if prompt_length is not None:
            body["prompt_length"] = prompt_length
        headers = {"authorization": f"Bearer {token}"} if token else {}
        reply = httpx.post(target.rstrip("/") + "/v1/score", json=body, headers=headers, timeout=60)
        data = reply.json()
        if reply.status_code != 200:
            raise ScoreFailed(f"error {reply.status_code}: {data['error']['message']}")
        first = data["first_row"]

        def float32(values: list) -> list:  # JSON's text of the wire's float32 scores, read back as float32
            return np.asarray(values, dtype=np.float32).tolist()

        return RowScores(first, float32(data["logprobs"][first:]), (data.get("topk_ids") or [])[first:] if topk else [],
                         float32((data.get("topk_logprobs") or [])[first:]) if topk else [], data["teacher"])
    address = target.removeprefix("grpc://")
    request = scoring_pb2.ScoreRequest(token_ids=token_ids, teacher_key=teacher_key, logprobs=True, topk=topk)
    if prompt_length is not None:
        request.prompt_length = prompt_length
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        try:
            reply = scoring_pb2_grpc.TeacherScoringStub(channel).Score(request, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            raise ScoreFailed(f"error {exc.code().name}: {exc.details()}") from exc
    return RowScores(
        reply.first_row,
        decode_tensor(reply.logprobs).tolist(),
        decode_tensor(reply.topk_ids).tolist() if topk else [],
        decode_tensor(reply.topk_logprobs).tolist() if topk else [],
        reply.teacher,
    )


def format_table(token_ids: list[int], scores: RowScores, tokenizer=None) -> str:
    """pos | token | log-prob | top candidates, one line per scored row."""

    def show(token_id: int) -> str:
        if tokenizer is None:
            return str(token_id)
        return f"{token_id}:{tokenizer.decode([token_id])!r}"

    lines = [f"teacher {scores.teacher}: rows {scores.first_row}..{len(token_ids) - 1}",
             f"{'pos':>4}  {'token':<18} {'logprob':>9}  top-k"]
    for offset, logprob in enumerate(scores.logprobs):
        pos = scores.first_row + offset
        top = ""
        if scores.topk_ids:
            top = "  ".join(f"{show(i)}({lp:.2f})" for i, lp in zip(scores.topk_ids[offset], scores.topk_logprobs[offset], strict=True))
        lines.append(f"{pos:>4}  {show(token_ids[pos]):<18} {logprob:>9.4f}  {top}")
    return "\n".join(lines)
