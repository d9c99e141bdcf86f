"""Fair share between tenants: counters, lift, and the scheduler's order, chunking,
weights, priorities and preemption under it (fake clock, tiny configs)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.convert import generate_input_from_proto
from engine_svc.core.config import SchedulerConfig
from engine_svc.core.fair_share import FairShare
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from engine_svc.core.validation import validate_request
from llm.v1 import engine_pb2

from ..helpers import plan, run_step

LOW, NORMAL, CRITICAL = 1, 2, 3


def make(num_blocks: int = 256, block_size: int = 4, **cfg: int | float | bool) -> Scheduler:
    config = SchedulerConfig(**({"max_num_batched_tokens": 16, "watermark": 0.0} | cfg))  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, block_size), lambda: 0.0)


def req(
    rid: str, tenant: str, n: int, max_tokens: int = 4, priority: int = NORMAL, weight: float = 1.0
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request.create(
        rid, [7] * n, params, 0.0, priority, tenant_id=tenant, tenant_weight=weight
    )


def test_counters_charge_weight_and_lift() -> None:
    fs = FairShare(prefill_weight=1.0, decode_weight=2.0)
    fs.admit("a")
    fs.charge("a", 100, 10)  # 100 prompt + 10 generated tokens
    assert fs.counter("a") == 120.0
    fs.admit("b")  # joins while a is active: starts at the least-served active level
    assert fs.counter("b") == 120.0
    fs.charge("b", 100, 0, weight=2.0)  # twice the share: half the cost
    assert fs.counter("b") == 170.0
    fs.release("a")
    assert fs.counter("a") == 0.0  # idle tenants keep nothing
    assert fs.num_tenants == 1
    fs.admit("a")
    assert fs.counter("a") == 170.0  # idle time banks no credit
    fs.release("a")
    fs.release("b")
    assert fs.num_tenants == 0


def steps_until_scheduled(fair: bool) -> int:
    """Steps until a short prompt that joins behind a 4-prompt flood first runs."""
    s = make(max_num_batched_tokens=16, max_num_seqs=8, fair_prefill_chunk=0, fair_share=fair)
    for i in range(4):
        s.add_request(req(f"flood{i}", "flood", 40))
    run_step(s)  # flood0 is prefilling
    s.add_request(req("chat", "chat", 6))
    for step in range(1, 30):
        if "chat" in [rid for rid, _ in plan(run_step(s))]:
            return step
    raise AssertionError("chat never ran")


def test_a_short_request_is_not_queued_behind_another_tenants_flood() -> None:
    # it joins level with the flood (no credit from before), then the flood has been
    # served more than it: one step, not all four prompts
    assert steps_until_scheduled(fair=True) <= 2
    assert steps_until_scheduled(fair=False) >= 9  # by arrival: behind 160 prompt tokens


def test_prefill_chunks_are_capped_only_while_two_tenants_wait() -> None:
    s = make(max_num_batched_tokens=16, fair_prefill_chunk=4)
    s.add_request(req("long", "a", 40))
    assert plan(run_step(s)) == [("long", 16)]  # alone: the whole budget
    s.add_request(req("short", "b", 6))
    # both advance, neither hogs; the newcomer, level with "a", goes first
    assert plan(run_step(s)) == [("short", 4), ("long", 4)]
    assert plan(run_step(s)) == [("long", 4), ("short", 2)]  # short's first token
    assert plan(run_step(s)) == [("short", 1), ("long", 15)]  # nobody else waits: uncapped


def test_the_step_that_finishes_a_newcomers_prompt_stays_short() -> None:
    s = make(max_num_batched_tokens=32, fair_prefill_chunk=4, max_num_seqs=8)
    for i in range(3):
        s.add_request(req(f"flood{i}", "flood", 40))
    run_step(s)  # the flood alone: uncapped
    s.add_request(req("chat", "chat", 3))
    step = plan(run_step(s))
    # first (lifted level with the flood, nothing running yet), its whole prompt, so
    # its first token, in this step; the flood's prompts share one chunk after it
    assert step == [("chat", 3), ("flood0", 4)]
    # the next step the chat decodes and the flood's prompts take the rest (no tenant
    # waits beside them: uncapped, work-conserving)
    assert plan(run_step(s)) == [("chat", 1), ("flood0", 4), ("flood1", 27)]


def test_the_cap_holds_each_request_of_each_tenant() -> None:
    s = make(max_num_batched_tokens=32, fair_prefill_chunk=6, max_num_seqs=8)
    for i in range(2):
        s.add_request(req(f"a{i}", "a", 20))
        s.add_request(req(f"b{i}", "b", 20))
    for _ in range(3):
        chunks = [e.num_new_tokens for e in run_step(s).scheduled if not e.is_decode]
        assert chunks == [6, 6, 6, 6]


def test_a_tenant_alone_gets_everything() -> None:
    """Work-conserving: one tenant's steps are the same with fair share on or off."""
    plans = []
    for fair in (True, False):
        s = make(max_num_batched_tokens=16, fair_share=fair)
        for i in range(5):
            s.add_request(req(f"r{i}", "only", 5 + 7 * i, max_tokens=3))
        plans.append([plan(run_step(s)) for _ in range(12)])
    assert plans[0] == plans[1]


def test_service_follows_the_weights() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=1, num_blocks=4096)
    n = 0
    service: Counter[str] = Counter()
    for _ in range(200):  # both tenants always have work waiting; one request runs at a time
        for tenant, weight in (("heavy", 2.0), ("light", 1.0)):
            while sum(1 for r in s.waiting if r.tenant_id == tenant) < 2:
                n += 1
                s.add_request(req(f"{tenant}{n}", tenant, 8, max_tokens=1, weight=weight))
        for e in run_step(s).scheduled:
            service[e.request.tenant_id] += e.num_new_tokens
    assert 1.8 <= service["heavy"] / service["light"] <= 2.2


def test_priority_classes_come_before_fair_share() -> None:
    s = make(max_num_batched_tokens=8, max_num_seqs=1)
    s.add_request(req("served", "busy", 8, max_tokens=1))
    run_step(s)
    run_step(s)  # "busy" has been served; "idle" not at all
    s.add_request(req("normal", "idle", 8, max_tokens=1))
    s.add_request(req("critical", "busy", 8, max_tokens=1, priority=CRITICAL))
    assert plan(run_step(s)) == [("critical", 8)]


def test_preemption_takes_the_most_served_tenant_first() -> None:
    # 8 blocks of 2 tokens; four 4-token prompts fill them, every decode then needs one
    s = make(num_blocks=8, block_size=2, max_num_batched_tokens=32)
    s.add_request(req("a1", "a", 4, max_tokens=8))
    s.add_request(req("a2", "a", 4, max_tokens=8))
    s.add_request(req("a3", "a", 4, max_tokens=8))
    s.add_request(req("b1", "b", 4, max_tokens=8))
    run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 0
    assert s.fair is not None
    assert s.fair.counter("a") > s.fair.counter("b")
    out = run_step(s)
    assert out.preempted_req_ids
    assert all(rid.startswith("a") for rid in out.preempted_req_ids)
    assert "b1" in [rid for rid, _ in plan(out)]


@given(
    jobs=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(1, 6)),
        min_size=1,
        max_size=24,
    ),
    cap=st.sampled_from([0, 3, 8]),
    aborts=st.lists(st.integers(0, 23), max_size=6),
)
@settings(max_examples=60, deadline=None)
def test_everything_finishes_and_no_counter_or_block_is_left(
    jobs: list[tuple[str, int, int]], cap: int, aborts: list[int]
) -> None:
    """Finished, aborted (waiting or running) and preempted requests alike (the tiny
    pool forces preemptions) leave no counter and no block behind."""
    s = make(num_blocks=24, block_size=4, max_num_seqs=4, fair_prefill_chunk=cap)
    pending = list(enumerate(jobs))
    for step in range(2000):
        if pending and len(s.waiting) < 3:
            i, (tenant, n, out_len) = pending.pop(0)
            assert s.add_request(req(f"r{i}", tenant, n, max_tokens=out_len))
        if step in aborts:
            s.finish_requests(list(s.requests)[:1], RequestStatus.FINISHED_ABORTED)
        if not pending and not s.has_unfinished_requests():
            break
        run_step(s)
        assert s.fair is not None
        live = {r.tenant_id for r in s.requests.values()}
        assert s.fair.num_tenants == len(live)  # counters only for tenants with live requests
    assert not pending
    assert not s.has_unfinished_requests()
    assert s.fair is not None
    assert s.fair.num_tenants == 0
    assert s.kv_cache_manager.num_free_blocks == 24


def test_requests_carry_their_tenant_through_the_engine_protocol() -> None:
    msg = engine_pb2.EngineGenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        tenant_id="team-a",
        tenant_weight=3.0,
        sampling=engine_pb2.EngineSamplingParams(max_tokens=4),
    )
    inp = generate_input_from_proto(msg, "m")
    assert (inp.tenant_id, inp.tenant_weight) == ("team-a", 3.0)
    msg.tenant_weight = 0.0  # unset: weight 1
    assert generate_input_from_proto(msg, "m").tenant_weight == 1.0
    for bad in (-1.0, float("nan"), float("inf")):  # refused with the request's other checks
        msg.tenant_weight = bad
        inp = generate_input_from_proto(msg, "m")
        with pytest.raises(ValueError, match="tenant_weight must be > 0"):
            validate_request(
                inp.request_id, inp.prompt_token_ids, inp.sampling_params, inp.priority, [],
                vocab_size=100, max_model_len=64, tenant_weight=inp.tenant_weight,
            )  # fmt: skip
