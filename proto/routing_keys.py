"""The routing-key rule, read by the server's router and the client alike.

A request names its teacher by a key (verl's `data_source` value, or the teacher's own name).
Each teacher answers to its name and its configured keys; with one teacher the key may be
empty, with several it is required; a key no teacher answers to is an error, never a default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class UnroutableKey(Exception):
    """A key that selects no teacher; `status` is the contract's status name for it."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def key_table(teacher_keys: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """key → teacher name, from each teacher's name and keys (a key claimed twice is refused)."""
    table: dict[str, str] = {}
    for name, keys in teacher_keys.items():
        for key in (*keys, name):
            owner = table.setdefault(key, name)
            if owner != name:
                raise ValueError(f"routing key {key!r} is claimed by teachers {owner!r} and {name!r}")
    return table


def route_key(key: str | None, table: Mapping[str, str]) -> str:
    """The teacher name `key` selects under `table` (see `key_table`); UnroutableKey otherwise."""
    names = sorted(set(table.values()))
    if not key:
        if len(names) == 1:
            return names[0]
        raise UnroutableKey(
            "INVALID_ARGUMENT", f"teacher_key: required with several teachers (known keys: {', '.join(sorted(table))})"
        )
    name = table.get(key)
    if name is None:
        raise UnroutableKey("NOT_FOUND", f"teacher_key: no teacher for key {key!r} (known: {', '.join(sorted(table))})")
    return name
