"""Errors of the registry and the limiter, each mapped to one gRPC status.

UnauthenticatedError     -> UNAUTHENTICATED    no, malformed or unknown key
PermissionDeniedError    -> PERMISSION_DENIED  revoked key, wrong role, model not allowed
NotFoundError            -> NOT_FOUND          unknown tenant or key id
ValueError               -> INVALID_ARGUMENT   bad policy or id
StoreError               -> UNAVAILABLE        Redis down or too slow
LimiterUnavailableError  -> UNAVAILABLE        Redis down and failing closed
ConflictError            -> ABORTED            a compare-and-set lost (re-read, retry)
"""

from __future__ import annotations


class StoreError(Exception):
    """The store failed or did not answer within the budget (never a denial)."""


class BreakerOpenError(StoreError):
    """The breaker skipped the store: nothing was sent, so nothing needs undoing."""


class LimiterUnavailableError(Exception):
    """The store is unreachable and the deployment fails closed (map to UNAVAILABLE)."""


class AuthError(Exception):
    """A request's credentials were not accepted."""


class UnauthenticatedError(AuthError):
    """No key, a malformed key, or a key nobody issued."""


class PermissionDeniedError(AuthError):
    """A known key that may not do this (revoked, wrong role, model not allowed)."""


class ConflictError(Exception):
    """What a write expected (a revision) is no longer what is stored."""


class NotFoundError(LookupError):
    """A tenant or key id that does not exist."""


__all__ = [
    "AuthError",
    "BreakerOpenError",
    "ConflictError",
    "LimiterUnavailableError",
    "NotFoundError",
    "PermissionDeniedError",
    "StoreError",
    "UnauthenticatedError",
]
