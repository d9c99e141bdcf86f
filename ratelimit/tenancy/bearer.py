"""The one parser of ``authorization: Bearer <key>`` credentials (gateway and admin APIs)."""

from __future__ import annotations

from typing import Any

from ratelimit.errors import UnauthenticatedError


def bearer_credential(authorization: str | bytes | None, credential: str = "API key") -> str:
    """The key of an ``authorization`` value ``Bearer <key>``.

    Args:
        authorization: The metadata or header value (``None`` or empty: missing).
        credential: What the key is, for the message ("API key", "admin key").

    Raises:
        UnauthenticatedError: the value is missing or not a bearer credential.
    """
    text = authorization.decode() if isinstance(authorization, bytes) else authorization or ""
    if not text.strip():
        raise UnauthenticatedError(
            f"missing {credential}: send metadata 'authorization: Bearer <{credential}>'"
        )
    scheme, _, token = text.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthenticatedError(f"the authorization metadata must be 'Bearer <{credential}>'")
    return token.strip()


def metadata_bearer(context: Any, credential: str = "API key") -> str:
    """``bearer_credential`` of a gRPC call's first ``authorization`` metadata value."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_credential(value, credential)
    return bearer_credential(None, credential)
