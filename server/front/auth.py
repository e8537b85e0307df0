"""Bearer-token authentication shared by the gRPC and HTTP shells.

The token is compared in constant time (hmac.compare_digest) so that response timing says
nothing about how much of a guess was right. The scheme name is case-insensitive (RFC 7235,
section 2.1: "bearer", "Bearer" and "BEARER" are one scheme) and may be followed by more
than one space; the same rule holds for the gRPC `authorization` metadata.

Auth fails closed: a token that is set but empty or whitespace (`PROCTOR_AUTH_TOKEN=""`, an
empty token file) stops the start with one line instead of serving with no auth, and
`proctor serve` will not bind an address other than loopback without a token unless told so
(`--allow-unauthenticated` or `PROCTOR_ALLOW_UNAUTHENTICATED=1`): `check_exposure`.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

ALLOW_UNAUTHENTICATED_ENV = "PROCTOR_ALLOW_UNAUTHENTICATED"


class AuthSetupError(ValueError):
    """The server's auth settings would leave it open where that was not asked for: it does not
    start (`proctor serve` prints the message as one line and exits 2)."""


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """Token from an argument, a file, or the PROCTOR_AUTH_TOKEN(_FILE) environment variables;
    one given but empty or whitespace is an AuthSetupError, never "no auth"."""
    token_file = token_file or os.environ.get("PROCTOR_AUTH_TOKEN_FILE") or None
    if token is not None:
        return _nonblank(token, "the auth token")
    if token_file:
        return _nonblank(Path(token_file).read_text().strip(), f"auth token file {token_file}")
    value = os.environ.get("PROCTOR_AUTH_TOKEN")
    return None if value is None else _nonblank(value, "PROCTOR_AUTH_TOKEN")


def _nonblank(token: str, where: str) -> str:
    if not token.strip():
        raise AuthSetupError(f"{where} is set but empty; give a token, or unset it to serve without one")
    if token != token.strip():
        raise AuthSetupError(f"{where} begins or ends with whitespace, which no client can send back")
    return token


def is_loopback(host: str) -> bool:
    """Whether binding `host` accepts connections from this machine only (a name other than
    localhost is not trusted to be loopback: fail closed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None, *, allow_unauthenticated: bool) -> None:
    """Refuse to serve other machines without a token unless explicitly allowed."""
    if token is None and not is_loopback(host) and not allow_unauthenticated:
        raise AuthSetupError(f"refusing to bind {host} without an auth token: set PROCTOR_AUTH_TOKEN(_FILE) or "
                             f"--auth-token-file, or pass --allow-unauthenticated ({ALLOW_UNAUTHENTICATED_ENV}=1) "
                             "to serve other machines with no auth")


BEARER = "bearer"


class TokenAuth:
    def __init__(self, token: str | None) -> None:
        if token is not None:
            _nonblank(token, "the auth token")
        self._expected = token.encode() if token is not None else None

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
