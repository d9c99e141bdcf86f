"""The in-flight count and the drain: requests refused once draining, the drain waiting
for the ones in flight (up to its grace period), the gauge following the count."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway import metrics
from gateway.domain import GatewayError
from gateway.request.in_flight import InFlight


def gauge() -> float:
    return float(metrics.IN_FLIGHT._value.get())


def test_enter_and_leave_count_requests_and_move_the_gauge() -> None:
    flight, before = InFlight(), gauge()
    flight.enter()
    flight.enter()
    assert flight.count == 2
    assert gauge() == before + 2
    flight.leave()
    flight.leave()
    assert flight.count == 0
    assert gauge() == before


async def test_a_drain_with_nothing_in_flight_returns_at_once_and_refuses_new_requests() -> None:
    flight = InFlight()
    started = time.monotonic()
    await flight.drain(5.0)
    assert time.monotonic() - started < 1.0
    assert flight.draining
    with pytest.raises(GatewayError) as info:
        flight.enter()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.message
    assert flight.count == 0


async def test_a_drain_waits_for_the_last_request_to_leave() -> None:
    flight = InFlight()
    flight.enter()
    drain = asyncio.create_task(flight.drain(5.0))
    await asyncio.sleep(0.05)
    assert not drain.done()  # the request is still in flight
    flight.leave()
    await asyncio.wait_for(drain, 1.0)
    assert flight.count == 0


async def test_a_drain_gives_up_after_its_grace_period() -> None:
    flight = InFlight()
    flight.enter()
    started = time.monotonic()
    await flight.drain(0.05)
    assert 0.05 <= time.monotonic() - started < 1.0
    assert flight.count == 1  # still in flight: the caller stops anyway
    flight.leave()
