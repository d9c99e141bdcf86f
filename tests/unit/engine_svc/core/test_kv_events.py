"""The prefix cache's event log: what the KV manager stores and the pool evicts, numbered,
bounded, recorded only while someone listens, gaps always visible."""

from __future__ import annotations

import time

from engine_svc.core.block_pool import hash_block_tokens
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.kv_events import KvEventLog
from tests.unit.engine_svc.core.test_cache_salt import _prefill, _req


def test_stores_name_the_chain_and_evictions_the_hash() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    log = kv.kv_events
    assert log is not None
    first = log.subscribe()
    a = _req("a", list(range(9)), "tenant:a")
    _prefill(kv, a)
    events, complete, cursor = log.since(first)
    assert complete
    assert [e.seq for e in events] == [first, first + 1]
    root, child = events
    assert root.block is not None
    assert child.block is not None
    assert (root.root, root.salt, root.block.token_ids) == (True, "tenant:a", (0, 1, 2, 3))
    assert not child.root
    assert child.block.parent == root.block.value
    assert child.block.token_ids == (4, 5, 6, 7)
    kv.free(a)
    _prefill(kv, _req("b", list(range(100, 116))))  # needs every block: evicts a's two
    events, complete, _ = log.since(cursor)
    removed = {e.removed for e in events if e.removed is not None}
    assert complete
    assert removed == {root.block.value, child.block.value}


def test_a_cache_hit_stores_nothing_again() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    log = kv.kv_events
    assert log is not None
    first = log.subscribe()
    _prefill(kv, _req("a", list(range(9))))
    _, _, cursor = log.since(first)
    _prefill(kv, _req("b", list(range(9))))  # both blocks hit
    assert log.since(cursor) == ([], True, cursor)


def test_nothing_is_recorded_without_a_listener_and_a_resume_across_it_is_a_gap() -> None:
    log = KvEventLog(capacity=8, first_seq=1)
    h = hash_block_tokens(None, [1, 2])
    log.stored(h, True, "")
    assert log.since(1) == ([], False, 2)  # numbered, not kept
    start = log.subscribe()
    log.stored(h, True, "")
    events, complete, cursor = log.since(start)
    assert complete
    assert [e.seq for e in events] == [start]
    assert cursor == start + 1
    log.unsubscribe()
    log.removed(h.value)  # nobody listens
    log.subscribe()
    log.removed(h.value)
    events, complete, _ = log.since(cursor)
    assert not complete
    assert [e.seq for e in events] == [cursor + 1]


def test_a_reader_behind_by_more_than_the_capacity_is_told() -> None:
    log = KvEventLog(capacity=3)
    start = log.subscribe()
    for i in range(5):
        log.removed(i)
    events, complete, cursor = log.since(start)
    assert not complete
    assert [e.removed for e in events] == [2, 3, 4]
    assert log.since(cursor) == ([], True, cursor)
    events, complete, _ = log.since(start + 3, limit=1)
    assert complete
    assert [e.removed for e in events] == [3]


def test_a_cursor_from_before_a_restart_is_a_gap() -> None:
    before = KvEventLog()
    cursor = before.subscribe()
    for i in range(3):
        before.removed(i)
    _, _, cursor = before.since(cursor)
    time.sleep(0.01)  # a restart takes longer than one event per microsecond since
    after = KvEventLog()  # the restarted engine's, numbering above every old cursor
    start = after.subscribe()
    after.removed(7)
    events, complete, _ = after.since(cursor)
    assert not complete
    assert [e.seq for e in events] == [start]
    assert after.since(10**18) == ([], False, start + 1)  # ahead of anything it gave


def test_no_prefix_cache_no_log() -> None:
    assert KVCacheManager(num_blocks=4, block_size=4).kv_events is None
