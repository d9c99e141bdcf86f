"""The one bearer-credential parser, used by the gateway and both admin APIs."""

from __future__ import annotations

from typing import Any

import pytest

from ratelimit.errors import UnauthenticatedError
from ratelimit.tenancy.bearer import bearer_credential, metadata_bearer


@pytest.mark.parametrize(
    "value", ["Bearer sk-1", "bearer sk-1", "BEARER   sk-1  ", b"Bearer sk-1", " Bearer sk-1"]
)
def test_the_key_of_a_bearer_value(value: str | bytes) -> None:
    assert bearer_credential(value) == "sk-1"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("   ", "missing API key"),
        ("Basic dXNlcjpwYXNz", "must be 'Bearer <API key>'"),
        ("Bearer", "must be 'Bearer <API key>'"),
        ("Bearer    ", "must be 'Bearer <API key>'"),
        ("sk-1", "must be 'Bearer <API key>'"),
    ],
)
def test_anything_else_is_unauthenticated_and_says_what_to_send(
    value: str | None, message: str
) -> None:
    with pytest.raises(UnauthenticatedError, match=message):
        bearer_credential(value)


class Context:
    def __init__(self, md: tuple[tuple[str, Any], ...]) -> None:
        self.md = md

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.md


def test_metadata_bearer_reads_the_authorization_entry_and_names_the_credential() -> None:
    ctx = Context((("x-request-id", "r1"), ("authorization", "Bearer adm-1")))
    assert metadata_bearer(ctx, "admin key") == "adm-1"
    with pytest.raises(UnauthenticatedError, match=r"missing admin key.*Bearer <admin key>"):
        metadata_bearer(Context((("x-request-id", "r1"),)), "admin key")
