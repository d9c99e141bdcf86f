"""The config switch between one Redis and a Redis Cluster (no server needed: neither
client connects before its first command), and which errors count as a failed call (a
real uvloop transport on a loopback socket for the one uvloop raises)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError, RedisClusterException

from common.config import load_config
from ratelimit.config import RateLimitConfig
from ratelimit.errors import StoreError
from ratelimit.factory import make_client
from ratelimit.redis_client import is_store_failure, leaked_by_the_client, store_errors


def test_one_server_by_default() -> None:
    client = make_client(RateLimitConfig(redis_url="redis://10.0.0.1:6380/0"))
    assert type(client) is Redis
    assert client.connection_pool.connection_kwargs["port"] == 6380


def test_the_cluster_client_from_env_with_every_seed() -> None:
    config = load_config(
        RateLimitConfig,
        "ratelimit",
        env={
            "LLM_RATELIMIT_REDIS_URL": "redis://llm:pw@10.0.0.1:7000/0",
            "LLM_RATELIMIT_REDIS_CLUSTER": "true",
            "LLM_RATELIMIT_REDIS_STARTUP_NODES": "10.0.0.2:7001, [fd00::3]:7002",
        },
    )
    assert config.redis_startup_nodes == ["10.0.0.2:7001", "[fd00::3]:7002"]
    client = make_client(config)
    assert isinstance(client, RedisCluster)
    seeds = {(n.host, n.port) for n in client.startup_nodes}
    assert seeds == {("10.0.0.1", 7000), ("10.0.0.2", 7001), ("fd00::3", 7002)}
    # the URL's user and password go to every node
    assert {n.connection_kwargs["username"] for n in client.startup_nodes} == {"llm"}


def test_startup_nodes_need_cluster_mode() -> None:
    with pytest.raises(ValueError, match="redis_cluster: true"):
        RateLimitConfig(redis_startup_nodes=["10.0.0.2:7001"])


@pytest.mark.parametrize("bad", ["10.0.0.2", ":7001", "h:0", "h:70000", "h:port"])
def test_a_bad_seed_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        RateLimitConfig(redis_cluster=True, redis_startup_nodes=[bad])


def _raised_inside_redis_py() -> AttributeError:
    """A real AttributeError from redis-py's own code (``key_slot`` of a non-bytes key)."""
    try:
        key_slot(None)  # type: ignore[arg-type]
    except AttributeError as exc:
        return exc
    raise AssertionError("key_slot(None) did not raise")


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("connection reset"),  # redis-py's
        RedisClusterException("no node answers"),
        ConnectionResetError("a socket error the client did not wrap"),
        "leaked",
    ],
)
def test_store_errors_maps_every_failed_call_to_store_error(error: Exception | str) -> None:
    exc = _raised_inside_redis_py() if error == "leaked" else error
    assert isinstance(exc, Exception)
    assert is_store_failure(exc)
    match = f"redis authenticate failed: {type(exc).__name__}"
    with pytest.raises(StoreError, match=match), store_errors("authenticate"):
        raise exc


def _raised_by_a_closed_uvloop_transport() -> RuntimeError:
    """What a write meets under uvloop when the node closed the connection under the
    call: a real uvloop TCP transport to a real socket, closed, then written to."""

    async def write_after_close() -> RuntimeError:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        try:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", server.sockets[0].getsockname()[1]
            )
            writer.transport.close()
            await asyncio.sleep(0)  # the close takes effect on the next turn of the loop
            try:
                writer.writelines([b"PING\r\n"])
            except RuntimeError as exc:
                return exc
            raise AssertionError("uvloop accepted a write on a closed transport")
        finally:
            server.close()
            await server.wait_closed()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(write_after_close())


def test_a_write_on_a_uvloop_transport_closed_under_the_call_is_a_store_failure() -> None:
    exc = _raised_by_a_closed_uvloop_transport()
    assert leaked_by_the_client(exc)
    with (
        pytest.raises(StoreError, match="redis settle failed: RuntimeError"),
        store_errors("settle"),
    ):
        raise exc
    with pytest.raises(RuntimeError), store_errors("settle"):  # our own: still a bug
        raise RuntimeError("an event loop mistake of the caller's code")


def test_an_attribute_error_of_our_own_code_stays_a_bug() -> None:
    """Only what redis-py or asyncio leak is the store's failure: the same error raised
    by the caller's code surfaces as itself (an INTERNAL with a stack trace)."""
    assert leaked_by_the_client(_raised_inside_redis_py())
    with pytest.raises(AttributeError), store_errors("authenticate"):
        None.missing  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(TypeError), store_errors("authenticate"):
        len(1)  # type: ignore[arg-type]
    assert not is_store_failure(ValueError("a bad reply we could not parse"))
