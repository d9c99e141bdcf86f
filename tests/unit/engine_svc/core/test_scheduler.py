"""Scheduler: budgets, chunked prefill, preemption order, priorities, aging."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.core.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from tests.support.clock import FakeClock

from ..helpers import plan, run_step

LOW, NORMAL, CRITICAL = 1, 2, 3


def make(
    num_blocks: int = 64, block_size: int = 4, clock: FakeClock | None = None, **cfg: int | float
) -> Scheduler:
    config = SchedulerConfig(**({"max_num_batched_tokens": 16, "watermark": 0.0} | cfg))  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, block_size), clock or FakeClock())


def req(rid: str, n: int, max_tokens: int = 4, priority: int = NORMAL, t: float = 0.0) -> Request:
    return Request.create(
        rid, [7] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t, priority
    )


def test_chunked_prefill_and_decodes_first() -> None:
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", 3, max_tokens=5))
    assert plan(run_step(s)) == [("a", 3)]
    s.add_request(req("b", 20))
    out = run_step(s)
    assert plan(out) == [("a", 1), ("b", 7)]  # a's decode first, b chunked
    assert [e.sample for e in out.scheduled] == [True, False]
    assert plan(run_step(s)) == [("a", 1), ("b", 7)]
    assert plan(run_step(s)) == [("a", 1), ("b", 6)]  # b's last chunk samples
    assert s.requests["b"].num_output_tokens == 1


def test_budget_and_max_num_seqs() -> None:
    s = make(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4))
    out = run_step(s)
    assert plan(out) == [("0", 4), ("1", 4)]
    assert len(s.running) == 2
    assert [r.request_id for r in s.waiting] == ["2"]


def test_queue_full_is_a_return_value() -> None:
    """Room is the running batch's free slots plus max_waiting, scheduled or not."""
    s = make(max_num_seqs=1, max_waiting=2)
    for rid in "abc":
        assert s.add_request(req(rid, 2))
    assert not s.add_request(req("d", 2))
    assert "d" not in s.requests
    run_step(s)  # a runs, b and c wait: still full
    assert len(s.running) == 1
    assert not s.add_request(req("e", 2))


def test_preemption_takes_lowest_priority_then_latest_arrival() -> None:
    # 6 blocks of 2 tokens; three 4-token prompts fill all blocks (admitted together:
    # with isolation the NORMAL one would start alone)
    s = make(num_blocks=6, block_size=2, max_num_batched_tokens=32, priority_isolation=False)
    s.add_request(req("low_early", 4, max_tokens=8, priority=LOW, t=0.0))
    s.add_request(req("normal", 4, max_tokens=8, priority=NORMAL, t=1.0))
    s.add_request(req("low_late", 4, max_tokens=8, priority=LOW, t=2.0))
    run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 0
    out = run_step(s)  # every decode needs a new block: the least urgent goes
    assert out.preempted_req_ids == ["low_late"]
    assert plan(out) == [("normal", 1), ("low_early", 1)]
    assert s.requests["low_late"].status == RequestStatus.PREEMPTED
    assert s.requests["low_late"].num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids("low_late") == []
    assert s.num_preemptions_total == 1
    out = run_step(s)  # no room yet: no admission in a step that preempted / lacks blocks
    assert "low_late" not in [e.request.request_id for e in out.scheduled]


def test_priority_order_and_aging() -> None:
    clock = FakeClock()
    s = make(clock=clock, max_num_seqs=1, priority_aging_seconds=10.0)
    s.add_request(req("low", 2, max_tokens=1, priority=LOW, t=0.0))
    clock.now = 5.0
    s.add_request(req("crit", 2, max_tokens=1, priority=CRITICAL, t=5.0))
    assert plan(run_step(s)) == [("crit", 2)]
    # low has waited 25s (+2.5 classes) when a fresh critical arrives: low goes first
    clock.now = 25.0
    s.add_request(req("crit2", 2, max_tokens=1, priority=CRITICAL, t=25.0))
    assert plan(run_step(s)) == [("low", 2)]


def test_watermark_never_blocks_an_idle_engine() -> None:
    s = make(num_blocks=10, watermark=0.5, max_num_batched_tokens=64)
    s.add_request(req("big", 32))  # 8 of 10 blocks, past the 5-block watermark
    s.add_request(req("small", 4))
    assert plan(run_step(s)) == [("big", 32)]  # small waits: the watermark applies now


def test_abort_frees_blocks() -> None:
    s = make()
    s.add_request(req("a", 9))
    run_step(s)
    assert s.kv_cache_manager.num_free_blocks < 64
    (done,) = s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert done.status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_manager.num_free_blocks == 64
    assert not s.has_unfinished_requests()
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from([LOW, NORMAL, CRITICAL])),
        min_size=1,
        max_size=14,
    ),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
    num_blocks=st.integers(13, 40),
    threshold=st.sampled_from([0, 8]),
)
def test_invariants_under_random_workloads(
    reqs: list[tuple[int, int, int]], budget: int, max_seqs: int, num_blocks: int, threshold: int
) -> None:
    clock = FakeClock()
    s = make(
        num_blocks=num_blocks,
        clock=clock,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        long_prefill_token_threshold=threshold,
        watermark=0.05,
    )
    pending = list(enumerate(reqs))
    finished: set[str] = set()
    for _step in range(3000):
        if pending:  # staggered arrivals, one per step
            i, (n, m, p) = pending.pop(0)
            assert s.add_request(req(str(i), n, max_tokens=m, priority=p, t=clock.now))
        if not s.has_unfinished_requests():
            break
        clock.now += 1.0
        out = s.schedule()
        assert out.num_scheduled_tokens <= budget
        assert len(s.running) <= max_seqs
        assert all(e.is_decode for e in out.scheduled[: out.num_decodes])
        assert not any(e.is_decode for e in out.scheduled[out.num_decodes :])
        owned = [b.block_id for bl in s.kv_cache_manager.req_to_blocks.values() for b in bl]
        assert len(owned) == len(set(owned))
        assert len(owned) + s.kv_cache_manager.num_free_blocks == num_blocks
        for e in out.scheduled:
            assert len(e.block_ids) * 4 >= e.num_computed_tokens + e.num_new_tokens
        _, done = s.update_from_output(
            out, {e.request.request_id: 5 for e in out.scheduled if e.sample}
        )
        finished |= {r.request_id for r in done}
    assert finished == {str(i) for i in range(len(reqs))}  # nobody starved
    assert s.kv_cache_manager.num_free_blocks == num_blocks


def test_a_critical_arrival_displaces_a_low_request_from_a_full_batch() -> None:
    clock = FakeClock()
    s = make(clock=clock, max_num_seqs=1, priority_aging_seconds=10.0)
    s.add_request(req("low", 3, max_tokens=50, priority=LOW))
    run_step(s)
    run_step(s)
    s.add_request(req("crit", 3, priority=CRITICAL, t=clock.now))
    out = run_step(s)
    assert out.preempted_req_ids == ["low"]
    assert plan(out) == [("crit", 3)]  # admitted in the same step
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert s.requests["low"].num_preemptions == 1
    while "crit" in s.requests:
        run_step(s)
    out = run_step(s)
    assert plan(out)[0][0] == "low"  # resumes (recomputed) once the batch has room


def test_equal_or_close_classes_do_not_displace_each_other() -> None:
    clock = FakeClock()
    s = make(clock=clock, max_num_seqs=1, priority_aging_seconds=10.0)
    s.add_request(req("a", 3, max_tokens=50, priority=NORMAL))
    run_step(s)
    s.add_request(req("b", 3, priority=NORMAL, t=clock.now))
    s.add_request(req("c", 3, priority=NORMAL, t=clock.now))
    assert run_step(s).preempted_req_ids == []  # same class: first come, first served
    assert s.requests["a"].status == RequestStatus.RUNNING


def test_an_aged_low_request_is_no_longer_displaced() -> None:
    clock = FakeClock()
    s = make(clock=clock, max_num_seqs=1, priority_aging_seconds=10.0)
    s.add_request(req("low", 3, max_tokens=500, priority=LOW))
    run_step(s)
    clock.now = 25.0  # 2.5 aging periods: LOW now ranks above a fresh CRITICAL
    s.add_request(req("crit", 3, priority=CRITICAL, t=clock.now))
    assert run_step(s).preempted_req_ids == []
    assert s.requests["low"].status == RequestStatus.RUNNING


def test_a_critical_arrival_starts_alone_and_the_low_batch_resumes_the_step_after() -> None:
    clock = FakeClock()
    s = make(clock=clock, max_num_batched_tokens=64, priority_isolation=True)
    for i in range(3):
        s.add_request(req(f"low{i}", 4, max_tokens=20, priority=LOW))
    run_step(s)  # the LOW prompts
    assert len(plan(run_step(s))) == 3  # three LOW decodes
    clock.now = 1.0
    s.add_request(req("crit", 6, priority=CRITICAL, t=1.0))
    s.add_request(req("low_new", 4, priority=LOW, t=1.0))
    assert plan(run_step(s)) == [("crit", 6)]  # its prefill alone: no LOW decode or prompt
    out = plan(run_step(s))
    assert ("crit", 1) in out
    assert {"low0", "low1", "low2", "low_new"} <= {rid for rid, _ in out}


def test_isolation_never_stalls_when_the_urgent_request_cannot_start() -> None:
    # 4 blocks of 4 tokens: the LOW request holds 2; CRITICAL's 20-token prompt needs 5
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64, priority_isolation=True)
    s.add_request(req("low", 6, max_tokens=20, priority=LOW))
    run_step(s)
    s.add_request(req("crit", 20, priority=CRITICAL, t=0.0))
    assert plan(run_step(s)) == [("low", 1)]  # the step runs as usual


def test_aging_counts_for_isolation_and_off_is_first_come_first_served() -> None:
    clock = FakeClock()
    s = make(clock=clock, priority_aging_seconds=10.0, priority_isolation=True)
    s.add_request(req("low", 2, max_tokens=1, priority=LOW, t=0.0))
    clock.now = 25.0  # low has aged past CRITICAL: a fresh CRITICAL does not hold it back
    s.add_request(req("crit", 2, max_tokens=1, priority=CRITICAL, t=25.0))
    assert sorted(plan(run_step(s))) == [("crit", 2), ("low", 2)]
    s = make(priority_isolation=False)
    s.add_request(req("low", 2, max_tokens=1, priority=LOW))
    s.add_request(req("crit", 2, max_tokens=1, priority=CRITICAL))
    assert sorted(plan(run_step(s))) == [("crit", 2), ("low", 2)]


def test_lower_classes_prefill_in_small_chunks_for_a_while_after_an_urgent_arrival() -> None:
    clock = FakeClock()
    s = make(
        clock=clock,
        num_blocks=200,
        max_num_batched_tokens=512,
        fair_prefill_chunk=128,
        priority_window_s=5.0,
    )
    s.add_request(req("crit", 8, max_tokens=1, priority=CRITICAL, t=0.0))
    run_step(s)
    clock.now = 1.0
    s.add_request(req("low", 600, max_tokens=1, priority=LOW, t=1.0))
    assert plan(run_step(s)) == [("low", 128)]  # within the window: capped
    clock.now = 10.0  # past the 5 s window: the whole budget again
    assert plan(run_step(s)) == [("low", 472)]
    s = make(clock=clock, num_blocks=200, max_num_batched_tokens=512, priority_window_s=0.0)
    s.add_request(req("crit", 8, max_tokens=1, priority=CRITICAL, t=10.0))
    run_step(s)
    s.add_request(req("low", 600, max_tokens=1, priority=LOW, t=10.0))
    assert plan(run_step(s)) == [("low", 512)]
