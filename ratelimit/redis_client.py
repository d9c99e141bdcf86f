"""The Redis client of every component: one server, or a Redis Cluster.

``RedisClient`` is what the limiter, the registry, the audit log, usage records,
budgets, routing policies and model routes take: ``redis.asyncio.Redis`` for one
server (or a primary with replicas behind one address), or
``redis.asyncio.cluster.RedisCluster`` when ``ratelimit.redis_cluster`` is true.
The cluster client reads the slot map from any seed node (``redis_url``, plus
``redis_startup_nodes``), sends each command to the primary of its key's slot
and follows ``MOVED``/``ASK`` and failovers by re-reading the map.

Nothing else changes between the two: every Lua script and every transaction
touches the keys of one hash tag (one tenant's ``{<tenant>}``) or one global
key, so no call can be refused with ``CROSSSLOT``; pipelines that span tenants
are non-transactional and the cluster client splits them by node.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from common.redis_nodes import parse_node
from ratelimit.errors import StoreError

RedisClient: TypeAlias = Redis | RedisCluster
# What a failed call raises: the cluster client's own errors (no node answers, a slot
# no node serves while a shard fails over) are not RedisErrors
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)
# ...and what the asyncio client leaks when a connection is closed under a call (a node
# killed while the cluster client still writes to it: ``_writer`` is None, or the
# transport's internals are: a known redis-py asyncio defect; under uvloop the write
# meets a closed handle, a RuntimeError). They count as a failed call only when raised
# inside redis-py, asyncio or uvloop's transports (``leaked_by_the_client``): the same
# error raised by our own code is a bug, and stays one.
LEAKED_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (AttributeError, TypeError, RuntimeError)
# everything ``store_errors`` looks at (OSError: a socket error the client did not wrap)
STORE_FAILURES: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError, *LEAKED_TRANSPORT_ERRORS)
_CLIENT_CODE = tuple(str(Path(m.__file__).parent) + "/" for m in (redis, asyncio) if m.__file__)
# uvloop's compiled transports name their source relative to the package
_UVLOOP_HANDLES = "uvloop/handles/"


def _innermost(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def leaked_by_the_client(exc: BaseException) -> bool:
    """True for an AttributeError or TypeError raised inside redis-py or asyncio, or a
    RuntimeError raised by a uvloop transport (a closed connection under a call); not
    for the same errors raised in the caller's own code."""
    if not isinstance(exc, LEAKED_TRANSPORT_ERRORS):
        return False
    tb = _innermost(exc.__traceback__)
    if tb is None:
        return False
    where = tb.tb_frame.f_code.co_filename
    if isinstance(exc, RuntimeError):  # only uvloop's "the handler is closed"
        return where.startswith(_UVLOOP_HANDLES)
    return where.startswith(_CLIENT_CODE)


def is_store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the Redis call failed (the store, not the caller, is at fault)."""
    return isinstance(exc, (*REDIS_ERRORS, OSError)) or leaked_by_the_client(exc)


@contextlib.contextmanager
def store_errors(op: str) -> Iterator[None]:
    """Turn a failed Redis call into ``StoreError`` (UNAVAILABLE, or the fail mode):
    ``REDIS_ERRORS``, a socket error, or a transport error the client leaked.

    Every Redis call of the limiter, the budgets, the registry, the audit log and
    usage records runs inside one, so a node dying under a call is never an
    internal error.
    """
    try:
        yield
    except STORE_FAILURES as exc:
        if not is_store_failure(exc):
            raise
        raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc


def connect(
    url: str, *, cluster: bool = False, startup_nodes: Sequence[str] = (), **kwargs: Any
) -> RedisClient:
    """A pooled client of ``url`` (``from_url``'s keyword arguments pass through).

    With ``cluster`` the URL is one seed node (its user, password, TLS and timeouts
    apply to every node) and ``startup_nodes`` more seeds, so the client starts while
    any one of them answers; ``max_connections`` is then per node.
    """
    if not cluster:
        if startup_nodes:
            raise ValueError("startup nodes are for a Redis Cluster (set cluster)")
        return Redis.from_url(url, **kwargs)
    nodes = [ClusterNode(*parse_node(n)) for n in startup_nodes]
    return RedisCluster.from_url(url, startup_nodes=nodes or None, **kwargs)
