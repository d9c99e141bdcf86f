"""Failed authentications per client address (fake clock), where the address comes from,
and what a key store failure becomes."""

from __future__ import annotations

import grpc
import pytest
from redis.crc import key_slot

from gateway.domain import CallContext, GatewayError, client_source
from gateway.request.authenticate import Authenticator, FailedAuthThrottle
from ratelimit.tenancy.registry import Registry
from tests.support.clock import FakeClock


def test_a_burst_of_failures_then_one_per_refill() -> None:
    clock = FakeClock(1000.0)
    throttle = FailedAuthThrottle(per_minute=60, burst=3, clock=clock)
    for _ in range(3):
        assert throttle.blocked_ms("1.2.3.4") == 0
        throttle.failure("1.2.3.4")
    assert throttle.blocked_ms("1.2.3.4") == 1000  # one failure back per second
    assert throttle.blocked_ms("5.6.7.8") == 0  # other addresses are not affected
    clock.advance(0.25)
    assert throttle.blocked_ms("1.2.3.4") == 750
    clock.advance(0.75)
    assert throttle.blocked_ms("1.2.3.4") == 0
    throttle.failure("1.2.3.4")  # the one that refilled
    assert throttle.blocked_ms("1.2.3.4") == 1000
    throttle.failure("1.2.3.4")  # failing while throttled does not dig deeper
    clock.advance(1.0)
    assert throttle.blocked_ms("1.2.3.4") == 0


def test_off_unknown_source_and_bounded_memory() -> None:
    clock = FakeClock(1000.0)
    off = FailedAuthThrottle(per_minute=0, burst=1, clock=clock)
    for _ in range(10):
        off.failure("1.2.3.4")
    assert off.blocked_ms("1.2.3.4") == 0
    throttle = FailedAuthThrottle(per_minute=60, burst=1, max_sources=100, clock=clock)
    throttle.failure("")  # no address known: never throttled
    assert throttle.blocked_ms("") == 0
    for i in range(1000):
        throttle.failure(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle._sources) == 100
    assert throttle.blocked_ms("10.0.3.231") > 0  # the most recent are kept
    assert throttle.blocked_ms("10.0.0.0") == 0  # the oldest went first


@pytest.mark.parametrize(
    ("forwarded", "peer", "expected"),
    [
        ("", "ipv4:127.0.0.1:51234", "127.0.0.1"),
        ("", "ipv6:[::1]:51234", "::1"),
        ("", "10.1.2.3", "10.1.2.3"),  # aiohttp's request.remote
        ("198.51.100.7", "ipv4:10.0.0.9:443", "198.51.100.7"),
        ("1.1.1.1, 2.2.2.2,  198.51.100.7 ", "ipv4:10.0.0.9:443", "198.51.100.7"),  # last hop
        ("", "", ""),
    ],
)
def test_client_source(forwarded: str, peer: str, expected: str) -> None:
    assert client_source(forwarded, peer) == expected


def test_client_source_is_cut_to_a_label() -> None:
    assert client_source("x" * 500, "") == "x" * 64
    assert client_source("", "ipv4:" + "1" * 500 + ":80") == "1" * 64


class ClosedUnderTheCall:
    """A key store whose reads fail inside redis-py itself, as its asyncio client does
    when a node's connection is closed under a call (an AttributeError of its own)."""

    async def get(self, key: str) -> str:
        key_slot(None)  # type: ignore[arg-type]  # raises inside redis.crc
        raise AssertionError("unreachable")


class OwnBug:
    async def get(self, key: str) -> str:
        return None.upper()  # type: ignore[attr-defined,no-any-return]


async def test_a_key_store_failure_leaked_by_the_client_is_unavailable_not_internal() -> None:
    registry = Registry(ClosedUnderTheCall())  # type: ignore[arg-type]
    auth = Authenticator(registry)
    with pytest.raises(GatewayError) as caught:
        await auth.tenant(CallContext(authorization=f"Bearer sk-llm-{'a' * 40}"))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "key store is unavailable" in caught.value.message
    assert "retry" in caught.value.message
    # the same error raised by our own code is a bug, reported as one (INTERNAL)
    with pytest.raises(AttributeError):
        await Authenticator(Registry(OwnBug())).tenant(  # type: ignore[arg-type]
            CallContext(authorization=f"Bearer sk-llm-{'b' * 40}")
        )
