"""The in-flight count and the drain: requests refused once draining, the drain waiting
for the ones in flight (up to its grace period), the gauge following the count."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog

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
    with structlog.testing.capture_logs() as logs:
        # a grace far beyond the guard: returning inside it means it did not wait
        await asyncio.wait_for(flight.drain(3600.0), 30.0)
    assert [e["event"] for e in logs] == ["draining", "drained"]
    assert flight.draining
    with pytest.raises(GatewayError) as info:
        flight.enter()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.message
    assert flight.count == 0


async def test_a_drain_waits_for_the_last_request_to_leave() -> None:
    flight = InFlight()
    flight.enter()
    drain = asyncio.create_task(flight.drain(3600.0))
    await asyncio.sleep(0.05)
    assert not drain.done()  # the request is still in flight
    flight.leave()
    await asyncio.wait_for(drain, 30.0)  # a guard, not a timing
    assert flight.count == 0


async def test_a_drain_gives_up_after_its_grace_period() -> None:
    flight = InFlight()
    flight.enter()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(flight.drain(0.05), 30.0)
    assert [e["event"] for e in logs] == ["draining", "drain timed out"]
    assert logs[-1]["in_flight"] == 1
    assert flight.count == 1  # still in flight: the caller stops anyway
    flight.leave()
