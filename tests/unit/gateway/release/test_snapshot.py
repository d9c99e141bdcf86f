"""SnapshotCache: refresh-ahead keeps the store off the request path, and no lookup
ever answers from a snapshot older than ``ttl_s``."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.release.snapshot import SnapshotCache
from ratelimit.errors import StoreError
from tests.support.clock import FakeClock

TTL = 1.0


class Store:
    """Each read answers the read's number, as of the moment the read started."""

    def __init__(self, clock: FakeClock, delay: asyncio.Event | None = None) -> None:
        self.clock = clock
        self.reads: list[float] = []  # when each read started
        self.fail = False
        self.gate = delay

    async def load(self) -> dict[str, float]:
        self.reads.append(self.clock())
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise StoreError("redis is down")
        return {"k": self.reads[-1]}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_first_lookup_waits_then_half_the_ttl_is_served_without_a_read(
    clock: FakeClock,
) -> None:
    store = Store(clock)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    assert await cache.get("k") == 1000.0
    assert (cache.num_refreshes, cache.num_waited) == (1, 1)
    clock.advance(TTL / 2 - 0.01)
    assert await cache.get("k") == 1000.0
    await settle()
    assert cache.num_refreshes == 1  # young enough: no read at all


async def test_past_half_the_ttl_a_lookup_answers_at_once_and_reads_beside_it(
    clock: FakeClock,
) -> None:
    gate = asyncio.Event()
    gate.set()
    store = Store(clock, gate)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    await cache.get("k")
    gate.clear()  # the next read hangs until released
    clock.advance(TTL * 0.6)
    assert await cache.get("k") == 1000.0  # answered from the snapshot it has
    assert await cache.get("k") == 1000.0
    await settle()
    assert len(store.reads) == 2  # one read ahead, not one per lookup
    gate.set()
    await settle()
    assert await cache.get("k") == 1000.6
    assert (cache.num_refreshes, cache.num_waited) == (2, 1)  # nobody waited for it


async def test_past_the_ttl_a_lookup_waits_for_the_store(clock: FakeClock) -> None:
    store = Store(clock)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    await cache.get("k")
    clock.advance(TTL + 0.01)
    assert await cache.get("k") == clock.now  # read on the path, new value at once
    assert cache.num_waited == 2


async def test_a_failed_read_ahead_keeps_the_last_good_snapshot(clock: FakeClock) -> None:
    store = Store(clock)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    await cache.get("k")
    store.fail = True
    clock.advance(TTL * 0.7)
    assert await cache.get("k") == 1000.0
    await settle()
    assert len(store.reads) == 2
    clock.advance(TTL * 0.2)  # a failed read counts as a read: no retry storm
    assert await cache.get("k") == 1000.0
    await settle()
    assert len(store.reads) == 2


async def test_close_stops_a_read_in_flight(clock: FakeClock) -> None:
    gate = asyncio.Event()
    gate.set()
    store = Store(clock, gate)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    await cache.get("k")
    gate.clear()
    clock.advance(TTL * 0.6)
    await cache.get("k")
    await settle()
    assert len(cache._ahead) == 1
    await cache.close()
    assert len(cache._ahead) == 0


async def test_invalidate_reads_again_on_the_next_lookup(clock: FakeClock) -> None:
    store = Store(clock)
    cache = SnapshotCache(store.load, TTL, "t", clock)
    await cache.get("k")
    clock.advance(0.01)
    cache.invalidate()
    assert await cache.get("k") == clock.now
    assert cache.num_waited == 2


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=1.5 * TTL), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
def test_no_lookup_answers_from_a_snapshot_older_than_the_ttl(
    steps: list[tuple[float, bool]],
) -> None:
    """Whatever the spacing of lookups, and whether a read ahead has finished before
    the next lookup or not, every answer was read at most ``ttl_s`` before it."""

    async def run() -> None:
        clock = FakeClock(1000.0)
        gate = asyncio.Event()
        gate.set()
        store = Store(clock, gate)
        cache = SnapshotCache(store.load, TTL, "t", clock)
        for gap, reads_finish in steps:
            clock.advance(gap)
            if reads_finish:
                gate.set()
            else:
                gate.clear()
            task = asyncio.ensure_future(cache.get("k"))
            await settle()
            if not task.done():  # a read on the lookup's path: the store answers now
                gate.set()
            read_at = await task
            assert read_at is not None
            assert clock.now - read_at <= TTL + 1e-9
            await settle()
        await cache.close()

    asyncio.run(run())
