"""A real Redis for the budget ledger (started once per module, stopped after it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from common.redis_server import RedisServer
from tests.unit.gateway.request.fakes import Ledgers


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
async def ledgers(redis_url: str) -> AsyncIterator[Ledgers]:
    made = Ledgers(redis_url)
    try:
        yield made
    finally:
        await made.close()
