"""Token ids as the wire carries them: int32, checked here once for every JSON surface.

The gRPC message types its ids `int32`, so protobuf holds them to that range; a JSON body
(`/v1/score`'s token_ids, teacher_prompt_ids and score_ids, `/v1/completions`' prompts) can
carry any integer, and is held to the same range by `int32_ids`, with one message whichever
field it is. `extend_ids` puts ids into a `ScoreRequest` for the HTTP shell and the core alike
(an aligned request's teacher sequence, a completions prompt), which is why this module sits
in the front's core and not in `front.http`.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence, Sequence

from proctor.server.common.errors import invalid

INT32 = range(-(2**31), 2**31)
# Token ids go into a ScoreRequest in slices of this many, so no single C call holds the GIL long.
_IDS_SLICE = 1 << 16


def int32_ids(field: str, ids: Iterable[object]) -> None:
    """Every id an integer (not a bool) in the int32 range, else INVALID_ARGUMENT naming `field`."""
    ids = ids if isinstance(ids, list) else list(ids)
    if set(map(type, ids)) <= {int}:  # JSON's ids (a bool's type is not int): C passes, no bytecode per id
        fine = not ids or (min(ids) in INT32 and max(ids) in INT32)
    else:
        fine = all(not isinstance(t, bool) and isinstance(t, int) and t in INT32 for t in ids)
    if not fine:
        raise invalid(field, "must be token ids: integers in the int32 range")


def extend_ids(target: MutableSequence[int], ids: Sequence[int]) -> None:
    """Token ids appended to a message's repeated field in slices, so that no one C call holds the GIL long."""
    for start in range(0, len(ids), _IDS_SLICE):
        target.extend(ids[start:start + _IDS_SLICE])
