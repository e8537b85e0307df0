"""Bearer-token authentication shared by the gRPC and HTTP shells.

The token is compared in constant time (hmac.compare_digest) so that response timing says
nothing about how much of a guess was right. The scheme name is case-insensitive (RFC 7235,
section 2.1: "bearer", "Bearer" and "BEARER" are one scheme) and may be followed by more
than one space; the same rule holds for the gRPC `authorization` metadata.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """Token from an argument, a file, or the PROCTOR_AUTH_TOKEN(_FILE) environment variables."""
    token_file = token_file or os.environ.get("PROCTOR_AUTH_TOKEN_FILE")
    if token:
        return token
    if token_file:
        value = Path(token_file).read_text().strip()
        if not value:
            raise ValueError(f"auth token file {token_file} is empty")
        return value
    return os.environ.get("PROCTOR_AUTH_TOKEN") or None


BEARER = "bearer"


class TokenAuth:
    def __init__(self, token: str | None) -> None:
        self._expected = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value ("Bearer <token>") carries the token."""
        if self._expected is None:
            return True
        scheme, _, credentials = (authorization or "").strip(" ").partition(" ")
        token = credentials.lstrip(" ").encode("utf-8", "replace")
        # Compare the token even when the scheme is wrong, so timing does not tell which part failed.
        token_matches = hmac.compare_digest(token, self._expected)
        return token_matches and scheme.lower() == BEARER
