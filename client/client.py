"""`TeacherClient`: the trainer's asyncio handle on a proctor server.

One client holds one connection (gRPC channel or HTTP pool) and a concurrency limit; every
call has a deadline, retries UNAVAILABLE / RESOURCE_EXHAUSTED with backoff (honouring the
server's hint), and cancels the server's work when the caller cancels. Results are torch
tensors in proctor's row convention (row i is about token i given tokens 0..i-1; rows
`first_row..T-1`); `proctor.client.batch` converts them to trainer layouts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import torch

from proctor.client.aligned import AlignedScores, StudentTokenizer, aligned_from_response
from proctor.client.retry import Deadline, RetryPolicy, call_with_retries
from proctor.client.scores import TeacherScores, scores_from_response
from proctor.client.transports import (
    MediaLike,
    TeacherError,
    Transport,
    UnembeddingMismatch,
    make_error,
    parse_target,
    processor_kwargs_json,
    to_wire_media,
)
from proctor.proto import decode_tensor, dtype_name, encode_tensor, scoring_pb2
from proctor.proto.routing_keys import UnroutableKey, key_table, route_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherInfo:
    """A teacher as ListTeachers describes it."""

    name: str
    model: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    max_model_len: int
    max_topk: int
    outputs: tuple[str, ...]
    keys: tuple[str, ...]
    engine: str
    dtype: str
    media: tuple[str, ...]
    replicas: tuple[tuple[str, str], ...] = ()  # (replica_id, state)
    score_ids_method: str = ""  # how score_ids are scored; "" when not served
    # Student tokenizer key -> the teacher ids of its exact-match map (aligned requests).
    aligned_vocabularies: tuple[tuple[str, int], ...] = ()
    chat_template: bool = False  # whether aligned requests may send messages
    batch_invariant: bool = False  # scores independent of batch, padding and replica
    max_drift: float | None = None  # the drift check's bound (None: replicas are not checked)
    drift: tuple[tuple[str, float], ...] = ()  # (replica_id, its latest drift) for replicas checked
    # The hidden-state forms offered (`RequestFields.hidden_form`), the projection's rank r (0: none)
    # and the share of the unembedding's energy it keeps.
    hidden_forms: tuple[str, ...] = ()
    projection_rank: int = 0
    projection_energy: float | None = None

    @classmethod
    def from_wire(cls, info: scoring_pb2.TeacherInfo) -> TeacherInfo:
        return cls(
            name=info.name, model=info.model, fingerprint=info.fingerprint, vocab_size=info.vocab_size,
            hidden_size=info.hidden_size, max_model_len=info.max_model_len, max_topk=info.max_topk,
            outputs=tuple(info.outputs), keys=tuple(info.keys), engine=info.engine, dtype=dtype_name(info.dtype),
            media=tuple(info.media), replicas=tuple((r.replica_id, r.state) for r in info.replicas),
            score_ids_method=info.score_ids_method,
            aligned_vocabularies=tuple((v.student_tokenizer, v.exact_matches) for v in info.aligned_vocabularies),
            chat_template=info.chat_template,
            batch_invariant=info.batch_invariant,
            max_drift=info.max_drift if info.HasField("max_drift") else None,
            drift=tuple((r.replica_id, r.drift) for r in info.replicas if r.HasField("drift")),
            hidden_forms=tuple(info.hidden_forms), projection_rank=info.projection_rank,
            projection_energy=info.projection_energy if info.HasField("projection_energy") else None,
        )


@dataclass
class ScoreInput:
    """One sequence for `score_many`; fields mirror `TeacherClient.score`'s arguments."""

    token_ids: Sequence[int] | torch.Tensor
    teacher_key: str | None = None
    prompt_length: int | None = None
    images: Sequence[MediaLike] | None = None
    videos: Sequence[MediaLike] | None = None
    audios: Sequence[MediaLike] | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None
    score_ids: ScoreIds | None = None
    options: dict[str, Any] = field(default_factory=dict)


def answer_from_response(response: scoring_pb2.ScoreResponse) -> TeacherScores | AlignedScores:
    """A unary answer: `AlignedScores` for an aligned request, else `TeacherScores`."""
    if response.HasField("aligned"):
        return aligned_from_response(response, scores_from_response(response.aligned.teacher))
    return scores_from_response(response)


def _token_list(token_ids: Sequence[int] | torch.Tensor, field: str = "token_ids") -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise make_error("INVALID_ARGUMENT", f"{field}: must be 1-D, got shape {tuple(token_ids.shape)}",
                             field=field)
        return token_ids.tolist()
    return [int(t) for t in token_ids]


def _given(ids: Sequence[int] | torch.Tensor | None) -> Sequence[int] | torch.Tensor:
    return [] if ids is None else ids


def _messages(messages: Iterable[Mapping[str, str]] | None) -> list[scoring_pb2.AlignedMessage]:
    """A conversation of {"role", "content"} mappings as the wire's messages."""
    out = []
    for index, message in enumerate(messages or ()):
        try:
            out.append(scoring_pb2.AlignedMessage(role=message["role"], content=message["content"]))
        except (KeyError, TypeError) as exc:
            raise make_error("INVALID_ARGUMENT", f"messages[{index}]: give a mapping with a string role and content "
                             f"({exc!r})", field=f"messages[{index}]") from None
    return out


# Token ids to score per row: int [R, K] (-1 pads) or R lists of ids (ragged rows are padded).
ScoreIds = torch.Tensor | Sequence[Sequence[int]]


class RequestFields(TypedDict, total=False):
    """What one scored sequence may ask for besides its ids (`TeacherClient.build_request`).

    `teacher_key` routes it; `prompt_length` (default 1) is the first row answered; `logprobs`
    (default True), `topk` (default 0) and `hidden_states` (default False) choose the answer;
    images / videos / audios and `mm_processor_kwargs` carry a multimodal prompt; `score_ids`
    ([R, K], -1 pads) asks for the teacher's log-probs at those ids; `temperature` divides the
    teacher's logits (None: 1); `request_id` defaults to a fresh uuid; `replica` pins the sequence
    to that replica of the teacher (a ListTeachers replica id), with no failover (`proctor verify`).
    `hidden_form` (default "": the teacher's dtype, exact) is the form hidden states travel in
    (`proctor.proto.hidden_forms`): "float32", "bfloat16", "fp8" (uint8 rows [R, H + 4]), "projected"
    (float32 [R, r], with `unembedding(projected=True)`), "projected_fp8"; the losses take each as it is.

    A student with another tokenizer names one of the server's student tokenizers
    (`student_tokenizer`; then the ids and `prompt_length` are the student's) and gives the
    teacher's prompt, as teacher ids (`teacher_prompt_ids`) or as a conversation for the
    teacher's chat template (`messages`: {"role", "content"} mappings): the answer is then
    `AlignedScores`, in the student's rows.
    """

    teacher_key: str | None
    prompt_length: int | None
    logprobs: bool
    topk: int
    hidden_states: bool
    images: Iterable[MediaLike] | None
    videos: Iterable[MediaLike] | None
    audios: Iterable[MediaLike] | None
    mm_processor_kwargs: Mapping[str, Any] | str | None
    request_id: str | None
    score_ids: ScoreIds | None
    temperature: float | None
    student_tokenizer: str | None
    teacher_prompt_ids: Sequence[int] | torch.Tensor | None
    messages: Iterable[Mapping[str, str]] | None
    replica: str | None
    hidden_form: str


def score_ids_tensor(score_ids: ScoreIds, first_row: int) -> scoring_pb2.Tensor:
    """The wire form of score_ids: int32 [R, K], -1 padding, saying its first row."""
    if isinstance(score_ids, torch.Tensor):
        if score_ids.dim() != 2 or score_ids.is_floating_point():
            raise make_error("INVALID_ARGUMENT", f"score_ids: must be an integer [rows, K] tensor, got "
                             f"{score_ids.dtype} of shape {tuple(score_ids.shape)}", field="score_ids")
        ids = score_ids.to(torch.int32)
    else:
        rows = [[int(t) for t in row] for row in score_ids]
        ids = torch.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=torch.int32)
        for index, row in enumerate(rows):
            ids[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return encode_tensor(ids.contiguous(), first_row=first_row)


class TeacherClient:
    """Async client for one proctor server.

    >>> async with TeacherClient("grpc://teacher:50051", token=...) as client:
    ...     scores = await client.score(ids, prompt_length=p, topk=64)

    `max_concurrency` bounds calls in flight (the rest wait in the client, not the server's
    queue); `timeout` is the default deadline per call, retries included.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        max_concurrency: int = 64,
        timeout: float | None = 120.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 64 << 20,
        seed: int | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.target = target
        self.scheme, self.address = parse_target(target)
        self.token = token
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.max_message_bytes = max_message_bytes
        self.retries = 0  # attempts that were retried (observable in tests and logs)
        self._rng = random.Random(seed)
        self._transport: Transport | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._teachers: dict[str, TeacherInfo] | None = None
        self._unembeddings: dict[tuple[str, str], torch.Tensor] = {}
        self._unembedding_locks: dict[str, asyncio.Lock] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def _connect(self) -> Transport:
        """Open the connection lazily, inside the running loop (grpc.aio channels are loop-bound)."""
        if self._transport is None:
            if self.scheme in ("grpc", "grpcs"):
                from proctor.client.grpc_transport import GrpcTransport

                self._transport = GrpcTransport(
                    self.address, secure=self.scheme == "grpcs", token=self.token,
                    max_message_bytes=self.max_message_bytes,
                )
            else:
                from proctor.client.http_transport import HttpTransport

                self._transport = HttpTransport(f"{self.scheme}://{self.address}", token=self.token,
                                                max_connections=self.max_concurrency)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._transport

    async def __aenter__(self) -> TeacherClient:
        self._connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._transport is not None:
            transport, self._transport = self._transport, None
            await transport.close()

    @property
    def transport_name(self) -> str:
        return "grpc" if self.scheme in ("grpc", "grpcs") else "http"

    # -- the retry loop --------------------------------------------------------------------
    async def _call(self, attempt, timeout: float | None, what: str):
        transport = self._connect()
        deadline = Deadline(self.timeout if timeout is None else timeout)

        async def limited(remaining: float | None):
            async with self._semaphore:
                return await attempt(transport, remaining)

        def note(error: TeacherError, wait: float) -> None:
            self.retries += 1
            log.info("%s: %s; retrying in %.2fs", what, error, wait)

        return await call_with_retries(limited, policy=self.retry, deadline=deadline, rng=self._rng, on_retry=note)

    # -- scoring ---------------------------------------------------------------------------
    def build_request(
        self, token_ids: Sequence[int] | torch.Tensor, **fields: Unpack[RequestFields]
    ) -> scoring_pb2.ScoreRequest:
        """The wire request for one sequence (the server validates ranges and sizes).

        `score_ids`: ids to score for rows first_row..T-1 (first_row = prompt_length, else 1),
        e.g. the student's top-k at the rollout (`proctor.client.batch.student_topk_ids`).
        `temperature`: engines that cannot apply it (vLLM's) refuse any value but 1 with
        INVALID_ARGUMENT.
        """
        unknown = sorted(set(fields) - RequestFields.__optional_keys__)
        if unknown:
            raise TypeError(f"build_request() got unexpected keyword argument(s): {', '.join(unknown)}")
        request = scoring_pb2.ScoreRequest(
            request_id=fields.get("request_id") or uuid.uuid4().hex,
            teacher_key=fields.get("teacher_key") or "",
            token_ids=_token_list(token_ids),
            logprobs=fields.get("logprobs", True),
            topk=int(fields.get("topk", 0)),
            hidden_states=fields.get("hidden_states", False),
            images=to_wire_media(fields.get("images"), "images"),
            videos=to_wire_media(fields.get("videos"), "videos"),
            audios=to_wire_media(fields.get("audios"), "audios"),
            mm_processor_kwargs=processor_kwargs_json(fields.get("mm_processor_kwargs")),
            student_tokenizer=fields.get("student_tokenizer") or "",
            teacher_prompt_ids=_token_list(_given(fields.get("teacher_prompt_ids")), "teacher_prompt_ids"),
            messages=_messages(fields.get("messages")),
            replica=fields.get("replica") or "",
            hidden_form=fields.get("hidden_form") or "",
        )
        prompt_length = fields.get("prompt_length")
        if prompt_length is not None:
            request.prompt_length = int(prompt_length)
        if fields.get("score_ids") is not None:
            first_row = 1 if prompt_length is None else int(prompt_length)
            request.score_ids.CopyFrom(score_ids_tensor(fields["score_ids"], first_row))
        if fields.get("temperature") is not None:
            request.temperature = float(fields["temperature"])
        return request

    async def score(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        *,
        timeout: float | None = None,
        **fields: Unpack[RequestFields],
    ) -> TeacherScores | AlignedScores:
        """Score one sequence (`fields`: `RequestFields`). Hidden states travel by ScoreStream on
        gRPC (no message limit).

        With `score_ids` ([R, K] ids for rows first_row..T-1, -1 padding) the answer's
        `score_logprobs` holds the teacher's full-vocabulary log-probs at those ids. With
        `student_tokenizer` (and `teacher_prompt_ids` or `messages`) it is `AlignedScores`: the
        teacher's scores of its own tokenization, aligned to the student's rows.
        """
        request = self.build_request(token_ids, **fields)
        if request.hidden_states:
            return await self._stream_request(request, timeout)

        async def attempt(transport: Transport, remaining: float | None):
            return answer_from_response(await transport.score(request, remaining))

        return await self._call(attempt, timeout, f"score {request.request_id}")

    async def stream_hidden_states(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        *,
        timeout: float | None = None,
        **fields: Unpack[RequestFields],
    ) -> TeacherScores:
        """Score with hidden states through ScoreStream and reassemble the row chunks."""
        request = self.build_request(token_ids, **{**fields, "hidden_states": True})
        return await self._stream_request(request, timeout)

    async def _stream_request(self, request: scoring_pb2.ScoreRequest, timeout: float | None) -> TeacherScores:
        async def attempt(transport: Transport, remaining: float | None) -> TeacherScores:
            return await assemble_stream(transport.score_stream(request, remaining))

        return await self._call(attempt, timeout, f"stream {request.request_id}")

    async def score_many(
        self,
        sequences: Iterable[Sequence[int] | torch.Tensor | ScoreInput],
        *,
        return_exceptions: bool = False,
        **common: Any,
    ) -> list[TeacherScores | BaseException]:
        """Score many sequences concurrently (at most max_concurrency in flight); results keep
        the input order. Without return_exceptions the first failure cancels the rest."""

        async def one(item):
            if isinstance(item, ScoreInput):
                args = {**common, **item.options}
                for name in ("teacher_key", "prompt_length", "images", "videos", "audios", "mm_processor_kwargs",
                             "score_ids"):
                    if getattr(item, name) is not None:
                        args[name] = getattr(item, name)
                return await self.score(item.token_ids, **args)
            return await self.score(item, **common)

        self._connect()
        tasks = [asyncio.ensure_future(one(item)) for item in sequences]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # -- catalogue and unembeddings --------------------------------------------------------
    async def teachers(self, *, timeout: float | None = None, refresh: bool = True) -> dict[str, TeacherInfo]:
        """The server's teachers by name (cached for `teacher_for_key` and `unembedding`)."""
        if self._teachers is not None and not refresh:
            return self._teachers

        async def attempt(transport: Transport, remaining: float | None):
            return await transport.list_teachers(remaining)

        response = await self._call(attempt, timeout, "ListTeachers")
        self._teachers = {info.name: TeacherInfo.from_wire(info) for info in response.teachers}
        return self._teachers

    async def student_tokenizers(self, *, timeout: float | None = None) -> dict[str, StudentTokenizer]:
        """The server's student tokenizers by key (what aligned requests may name)."""

        async def attempt(transport: Transport, remaining: float | None):
            return await transport.list_teachers(remaining)

        response = await self._call(attempt, timeout, "ListTeachers")
        return {s.key: StudentTokenizer(s.key, s.vocab_size, s.fingerprint) for s in response.student_tokenizers}

    async def routing_table(self) -> dict[str, str]:
        """key → teacher name, as the server routes (each teacher's name and keys)."""
        teachers = await self.teachers(refresh=self._teachers is None)
        return key_table({t.name: t.keys for t in teachers.values()})

    async def teacher_for_key(self, teacher_key: str | None) -> TeacherInfo:
        """The teacher a routing key selects, by the server's catalogue (same rule as the server)."""
        teachers = await self.teachers(refresh=self._teachers is None)
        try:
            return teachers[route_key(teacher_key, await self.routing_table())]
        except UnroutableKey as exc:
            raise make_error(exc.status, exc.message, field="teacher_key") from None

    async def unembedding(
        self, teacher_key: str | None = None, *, timeout: float | None = None, projected: bool = False
    ) -> torch.Tensor:
        """The teacher's lm_head weight [V, H] (`projected`: W·P [V, r], for the projected hidden
        forms), fetched once and cached per fingerprint.

        Every chunk must carry the fingerprint ListTeachers gives for that teacher, and the
        shape must match its vocab and hidden sizes: a cached weight is never paired with
        hidden states from different teacher weights.
        """
        info = await self.teacher_for_key(teacher_key)
        cache_key = (info.name, info.fingerprint, projected)
        lock = self._unembedding_locks.setdefault(info.name, asyncio.Lock())
        async with lock:
            if cache_key in self._unembeddings:
                return self._unembeddings[cache_key]

            async def attempt(transport: Transport, remaining: float | None) -> torch.Tensor:
                chunks = transport.unembedding(info.name, remaining, projected=projected)
                return await assemble_unembedding(chunks, info, info.projection_rank if projected else None)

            weight = await self._call(attempt, timeout, f"GetUnembedding {info.name}")
            self._unembeddings = {k: v for k, v in self._unembeddings.items()
                                  if k[0] != info.name or (k[1] == info.fingerprint and k[2] != projected)}
            self._unembeddings[cache_key] = weight
            return weight


async def assemble_stream(chunks: AsyncIterator[scoring_pb2.ScoreChunk]) -> TeacherScores:
    """Rebuild one TeacherScores from ScoreStream chunks, checking every row arrived once."""
    scores: TeacherScores | None = None
    hidden: torch.Tensor | None = None
    filled = 0
    last = False
    async for chunk in chunks:
        response = chunk.response
        if scores is None:
            scores = scores_from_response(response)
            first_hidden = scores.hidden_states
            scores.hidden_states = None
            if first_hidden is not None:
                hidden = _place_rows(None, first_hidden, response.hidden_states.first_row, scores)
                filled += first_hidden.shape[0]
        elif response.HasField("hidden_states"):
            piece = decode_tensor(response.hidden_states)
            hidden = _place_rows(hidden, piece, response.hidden_states.first_row, scores)
            filled += piece.shape[0]
        last = chunk.last
    if scores is None or not last:
        raise make_error("UNAVAILABLE", "the score stream ended before its last chunk")
    if hidden is not None:
        if filled != scores.num_rows:
            raise make_error("INTERNAL", f"the stream sent {filled} hidden-state rows, expected {scores.num_rows}")
        scores.hidden_states = hidden
    return scores


def _place_rows(hidden: torch.Tensor | None, piece: torch.Tensor, first_row: int, scores: TeacherScores) -> torch.Tensor:
    if hidden is None:
        hidden = torch.empty((scores.num_rows, piece.shape[1]), dtype=piece.dtype)
    start = first_row - scores.first_row
    if start < 0 or start + piece.shape[0] > hidden.shape[0]:
        raise make_error("INTERNAL", f"hidden-state chunk rows {first_row}.. fall outside rows "
                                     f"{scores.first_row}..{scores.num_tokens - 1}")
    hidden[start : start + piece.shape[0]] = piece
    return hidden


async def assemble_unembedding(
    chunks: AsyncIterator[scoring_pb2.TensorChunk], info: TeacherInfo, rank: int | None = None
) -> torch.Tensor:
    """The streamed unembedding [V, H] (or W·P [V, rank]), its fingerprint and shape checked."""
    width = info.hidden_size if rank is None else rank
    weight: torch.Tensor | None = None
    filled = 0
    last = False
    async for chunk in chunks:
        if chunk.fingerprint != info.fingerprint:
            raise UnembeddingMismatch(
                "FAILED_PRECONDITION",
                f"unembedding of teacher {info.name!r} has fingerprint {chunk.fingerprint!r}, but the teacher "
                f"is listed with {info.fingerprint!r}: the server changed weights; call teachers() again",
            )
        shape = tuple(int(d) for d in chunk.full_shape)
        if shape != (info.vocab_size, width):
            raise UnembeddingMismatch(
                "FAILED_PRECONDITION",
                f"unembedding of teacher {info.name!r} has shape {shape}, expected "
                f"({info.vocab_size}, {width})",
            )
        piece = decode_tensor(chunk.tensor)
        if weight is None:
            weight = torch.empty(shape, dtype=piece.dtype)
        start = int(chunk.tensor.first_row)
        weight[start : start + piece.shape[0]] = piece
        filled += piece.shape[0]
        last = chunk.last
    if weight is None or not last or filled != weight.shape[0]:
        raise make_error("UNAVAILABLE", f"the unembedding stream of {info.name!r} ended early ({filled} rows)")
    return weight
