"""Step interruption: a request that arrives during a step and outranks its prompts
runs between two of its layers and gets its first token before that step ends.

The scheduler's choice (fake clock, tiny configs), then the engine on a tiny
random model: the newcomer's token is emitted mid-step, every greedy output is
what the same requests give without interruption, and nothing is left held."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.core import LLMEngine, RequestOutput
from engine_svc.core.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import FinishReason, Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.core.scheduler import Scheduler
from tests.support.engine_config import engine_config

from ..conftest import write_tiny_model
from ..helpers import plan, run_to_completion, tokens_of

LOW, NORMAL, CRITICAL = 1, 2, 3


def make(num_blocks: int = 256, **cfg: int | float | bool) -> Scheduler:
    base = {"max_num_batched_tokens": 16, "watermark": 0.0, "interrupt_max_tokens": 8}
    config = SchedulerConfig(**(base | cfg))  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, 4), lambda: 0.0)


def req(rid: str, tenant: str, n: int, priority: int = NORMAL) -> Request:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request.create(rid, [7] * n, params, 0.0, priority, tenant_id=tenant)


def flood_step(s: Scheduler, n: int = 40, priority: int = NORMAL) -> None:
    assert s.add_request(req("f1", "flood", n, priority))


def test_another_tenants_short_prompt_interrupts_a_long_prefill() -> None:
    s = make()
    flood_step(s)
    outer = s.schedule()
    assert plan(outer) == [("f1", 16)]
    s.add_request(req("c1", "chat", 6))
    nested = s.schedule_interrupt(outer, 8)
    assert nested is not None
    assert plan(nested) == [("c1", 6)]
    (entry,) = nested.scheduled
    assert entry.sample
    assert entry.block_ids == s.kv_cache_manager.get_block_ids("c1")
    assert not set(entry.block_ids) & set(outer.scheduled[0].block_ids)
    assert s.requests["c1"].status == RequestStatus.RUNNING
    # the nested step finishes first, then the one it ran inside
    updated, _ = s.update_from_output(nested, {"c1": 5})
    assert [r.request_id for r in updated] == ["c1"]
    s.update_from_output(outer, {})
    assert s.requests["f1"].num_computed_tokens == 16
    assert ("c1", 1) in plan(s.schedule())  # decoding beside the flood from now on


@pytest.mark.parametrize(
    ("why", "newcomer", "cfg", "budget"),
    [
        ("same tenant: a flood never interrupts itself", ("c1", "flood", 6, NORMAL), {}, 8),
        ("its whole prompt exceeds the budget", ("c1", "chat", 9, NORMAL), {}, 8),
        ("no budget left in this step", ("c1", "chat", 4, NORMAL), {}, 0),
        ("the step in flight is short", ("c1", "chat", 6, NORMAL), {"interrupt_max_tokens": 16}, 8),
        (
            "without fair share only a class counts",
            ("c1", "chat", 6, NORMAL),
            {"fair_share": False},
            8,
        ),
        ("a lower class", ("c1", "chat", 6, LOW), {}, 8),
        ("the batch is full", ("c1", "chat", 6, NORMAL), {"max_num_seqs": 1}, 8),
        ("no free blocks", ("c1", "chat", 6, NORMAL), {"num_blocks": 5}, 8),
    ],
)
def test_no_interruption(
    why: str, newcomer: tuple[str, str, int, int], cfg: dict[str, int | bool], budget: int
) -> None:
    num_blocks = int(cfg.pop("num_blocks", 256))
    s = make(num_blocks, **cfg)
    flood_step(s)
    outer = s.schedule()
    s.add_request(req(*newcomer))
    free = s.kv_cache_manager.num_free_blocks
    assert s.schedule_interrupt(outer, budget) is None, why
    assert s.requests["c1"].status == RequestStatus.WAITING
    assert s.requests["c1"].num_computed_tokens == 0
    assert s.kv_cache_manager.num_free_blocks == free  # nothing taken on the way


def test_a_higher_class_interrupts_any_prefill() -> None:
    s = make(fair_share=False, interrupt_max_tokens=16)
    assert s.add_request(req("f1", "flood", 6, LOW))  # a short step: no share rule
    outer = s.schedule()
    s.add_request(req("c1", "flood", 6, CRITICAL))  # same tenant, but a class above
    nested = s.schedule_interrupt(outer, 16)
    assert nested is not None
    assert plan(nested) == [("c1", 6)]


def test_on_a_full_batch_a_class_above_interrupts_and_the_next_step_trims() -> None:
    s = make(max_num_seqs=2)
    s.add_request(req("l1", "low", 8, LOW))
    s.add_request(req("l2", "low", 8, LOW))
    outer = s.schedule()
    assert len(s.running) == 2
    s.add_request(req("n1", "chat", 4))  # NORMAL: one class above
    s.add_request(req("k1", "crit", 4, CRITICAL))
    s.add_request(req("k2", "crit", 4, CRITICAL))
    nested = s.schedule_interrupt(outer, 12)
    # a seat per running LOW request outranked by a class: two, though 12 tokens fit three
    assert nested is not None
    assert plan(nested) == [("k1", 4), ("k2", 4)]
    s.update_from_output(nested, {"k1": 5, "k2": 5})
    s.update_from_output(outer, {"l1": 5, "l2": 5})
    nxt = s.schedule()
    assert sorted(nxt.preempted_req_ids) == ["l1", "l2"]  # back to max_num_seqs
    assert sorted(r.request_id for r in s.running) == ["k1", "k2"]
    assert s.requests["l1"].status == RequestStatus.PREEMPTED


def test_a_step_short_of_blocks_is_interrupted_only_by_a_higher_class() -> None:
    s = make()
    flood_step(s)
    outer = s.schedule()
    outer.preempted_req_ids.append("victim")  # as if it had preempted for lack of blocks
    assert outer.short_of_blocks
    s.add_request(req("c1", "chat", 6))
    assert s.schedule_interrupt(outer, 8) is None  # a level tenant would cause thrashing
    s.add_request(req("k1", "crit", 6, CRITICAL))
    nested = s.schedule_interrupt(outer, 8)
    assert nested is not None
    assert plan(nested) == [("k1", 6)]


def test_a_step_that_only_decodes_is_never_interrupted() -> None:
    s = make()
    s.add_request(req("f1", "flood", 4))
    s.update_from_output(s.schedule(), {"f1": 5})
    outer = s.schedule()
    assert outer.num_decodes == 1
    s.add_request(req("c1", "chat", 4, CRITICAL))
    assert s.schedule_interrupt(outer, 8) is None


def test_the_budget_is_shared_and_the_most_urgent_goes_first() -> None:
    s = make(interrupt_max_tokens=8)
    flood_step(s)
    outer = s.schedule()
    s.add_request(req("c1", "chat", 5))
    s.add_request(req("k1", "crit", 5, CRITICAL))
    s.add_request(req("d1", "dev", 3))
    nested = s.schedule_interrupt(outer, 8)
    # critical first; the chat's 5 no longer fit, the 3-token one does
    assert nested is not None
    assert plan(nested) == [("k1", 5), ("d1", 3)]
    assert s.schedule_interrupt(outer, 8 - nested.num_scheduled_tokens) is None


# ---- the engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with 4 layers: a step can be interrupted 3 times."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deep"), seed=3, num_hidden_layers=4)


def engine(model_dir: Path, **kw: int | bool) -> LLMEngine:
    cfg = {
        "model_dir": str(model_dir),
        "dtype": "float32",
        "device": "cpu",
        "block_size": 4,
        "num_kv_blocks": 96,
        "max_num_batched_tokens": 48,
        "interrupt_max_tokens": 16,
        "enable_prefix_caching": True,
    }
    return LLMEngine(engine_config(**(cfg | kw)))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def reference(model_dir: Path, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Each prompt's greedy output alone on an engine that never interrupts."""
    return reference_each(model_dir, prompts, dict.fromkeys(prompts, n))


def test_newcomer_gets_its_first_token_inside_the_step(deep_model_dir: Path) -> None:
    e = engine(deep_model_dir)
    flood = [(7 * i) % 90 + 2 for i in range(40)]
    chat = [5, 9, 11, 3, 8]
    e.add_request("f1", flood, greedy(6), tenant_id="flood")
    emitted: list[list[RequestOutput]] = []
    polls = []

    def poll() -> None:
        polls.append(len(emitted))
        if len(polls) == 1:  # arrives while the flood's prompt is in flight
            e.add_request("c1", chat, greedy(6), tenant_id="chat")

    step_outs = e.step(poll=poll, emit=emitted.append)
    assert len(polls) == 3  # between every two of the 4 layers
    assert [[(o.request_id, len(o.new_token_ids)) for o in outs] for outs in emitted] == [
        [("c1", 1)]
    ]
    assert [o.request_id for o in step_outs] == ["f1"]
    assert e.get_stats().num_step_interrupts_total == 1
    (nested,) = e.interrupt_timings  # for the step histograms, beside the outer step's
    assert nested.num_prefill_tokens == len(chat)
    assert e.last_step_timings is not None
    assert e.last_step_timings.num_prefill_tokens == len(flood)
    assert e.get_stats().num_steps_total == 2
    outs = run_to_completion(e)
    got = {
        "f1": tokens_of(step_outs) + tokens_of(outs["f1"]),
        "c1": tokens_of(emitted[0]) + tokens_of(outs["c1"]),
    }
    assert got == reference(deep_model_dir, {"f1": flood, "c1": chat}, 6)


@pytest.mark.parametrize("off", ["no emit", "interrupt_max_tokens=0"])
def test_nothing_interrupts_when_off(deep_model_dir: Path, off: str) -> None:
    e = engine(deep_model_dir, interrupt_max_tokens=16 if off == "no emit" else 0)
    e.add_request("f1", list(range(2, 42)), greedy(2), tenant_id="flood")
    polled: list[int] = []
    if off == "no emit":
        e.step(poll=lambda: polled.append(1))
    else:
        e.step(poll=lambda: polled.append(1), emit=lambda outs: None)
    assert not polled  # the step never looked for arrivals
    run_to_completion(e)
    assert e.get_stats().num_step_interrupts_total == 0


Arrival = tuple[int, str, int, int, int]  # (poll index, tenant, length, priority, max tokens)
SHARED = [41, 42, 43, 44, 45, 46, 47, 48]  # two full blocks: a prefix cache hit


def reference_each(
    model_dir: Path, prompts: dict[str, list[int]], n: dict[str, int]
) -> dict[str, list[int]]:
    """Each prompt's greedy output alone, with its own max_tokens, never interrupted."""
    e = engine(model_dir, interrupt_max_tokens=0)
    out = {}
    for rid, prompt in prompts.items():
        e.add_request(rid, prompt, greedy(n[rid]))
        out[rid] = tokens_of(run_to_completion(e)[rid])
    return out


@settings(max_examples=30, deadline=None)
@given(
    floods=st.lists(st.integers(17, 60), min_size=1, max_size=3),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 8),
            st.sampled_from(["chat", "dev", "flood"]),
            st.integers(1, 20),
            st.sampled_from([LOW, NORMAL, CRITICAL]),
            st.integers(1, 4),
        ),
        max_size=6,
    ),
    num_blocks=st.sampled_from([24, 96]),
    shared=st.booleans(),
    max_num_seqs=st.sampled_from([2, 32]),
)
def test_interrupted_runs_match_and_give_everything_back(
    deep_model_dir: Path,
    floods: list[int],
    arrivals: list[Arrival],
    num_blocks: int,
    shared: bool,
    max_num_seqs: int,
) -> None:
    """Whatever arrives mid-step (finishing in its nested step or not, hitting the
    prefix cache or not, on a full batch or not): greedy outputs equal the
    uninterrupted run's, every KV block returns to the pool and no fair-share
    counter is left behind."""
    e = engine(deep_model_dir, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs)
    head = SHARED if shared else []
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    for i, n in enumerate(floods):
        rid = f"f{i}"
        prompts[rid] = head + [(13 * i + 7 * j) % 90 + 2 for j in range(n)]
        max_tokens[rid] = 3
        e.add_request(rid, prompts[rid], greedy(3), tenant_id="flood")
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    polls = 0

    def poll() -> None:
        nonlocal polls
        while pending and pending[0][1][0] <= polls:
            k, (_, tenant, n, prio, m) = pending.pop(0)
            rid = f"a{k}"
            prompts[rid] = head + [(5 * k + 3 * j) % 90 + 2 for j in range(n)]
            max_tokens[rid] = m
            e.add_request(rid, prompts[rid], greedy(m), prio, tenant_id=tenant)
        polls += 1

    got: dict[str, list[int]] = {}

    def collect(outs: list[RequestOutput]) -> None:
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    for _ in range(500):
        if not e.has_unfinished_requests() and not pending:
            break
        if not e.has_unfinished_requests():
            poll()  # idle: the arrival comes between steps
        collect(e.step(poll=poll, emit=collect))
    assert not e.has_unfinished_requests()
    assert set(got) == set(prompts)
    assert {rid: len(t) for rid, t in got.items()} == max_tokens
    assert got == reference_each(deep_model_dir, prompts, max_tokens)
    assert e.kv_cache_manager.block_pool.num_used_blocks == 0
    assert e.kv_cache_manager.req_to_blocks == {}
    assert e.get_stats().num_fair_share_tenants == 0
    assert not e.scheduler.requests
    assert len(e.scheduler.running) <= max_num_seqs  # trimmed back after interruptions


def test_a_failing_interruption_fails_only_its_own_requests(
    deep_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(deep_model_dir)
    flood = [(7 * i) % 90 + 2 for i in range(40)]
    e.add_request("f1", flood, greedy(2), tenant_id="flood")
    update = e.scheduler.update_from_output

    def broken(out, tokens):  # type: ignore[no-untyped-def]
        if any(s.request.request_id == "c1" for s in out.scheduled):
            raise RuntimeError("a bug in the nested step's update")
        return update(out, tokens)

    monkeypatch.setattr(e.scheduler, "update_from_output", broken)
    emitted: list[RequestOutput] = []

    def poll() -> None:
        if "c1" not in e.scheduler.requests and not emitted:
            e.add_request("c1", [5, 9, 11, 3, 8], greedy(2), tenant_id="chat")

    outs = e.step(poll=poll, emit=emitted.extend)
    assert [(o.request_id, o.finish_reason) for o in emitted] == [("c1", FinishReason.ERROR)]
    assert [(o.request_id, len(o.new_token_ids)) for o in outs] == [("f1", 1)]  # unharmed
    monkeypatch.undo()
    rest = run_to_completion(e)
    assert (
        tokens_of(outs) + tokens_of(rest["f1"]) == reference(deep_model_dir, {"f1": flood}, 2)["f1"]
    )
    assert e.kv_cache_manager.block_pool.num_used_blocks == 0
    assert e.get_stats().num_fair_share_tenants == 0


@pytest.mark.parametrize(("prompt_len", "interrupts"), [(48, True), (50, False)])
def test_interruptions_never_exceed_the_step_budget(
    deep_model_dir: Path, prompt_len: int, interrupts: bool
) -> None:
    """interrupt_max_tokens (256) is capped at max_num_batched_tokens (48): a CRITICAL
    prompt (a class above, so no share threshold) of 48 tokens interrupts, 50 do not."""
    e = engine(deep_model_dir, interrupt_max_tokens=256, max_num_batched_tokens=48)
    e.add_request("f1", list(range(2, 42)), greedy(2), tenant_id="flood")
    seen: list[int] = []

    def poll() -> None:
        if not seen:
            seen.append(1)
            prompt = [(3 * j) % 90 + 2 for j in range(prompt_len)]
            e.add_request("c1", prompt, greedy(2), CRITICAL, tenant_id="chat")

    e.step(poll=poll, emit=lambda outs: None)
    assert e.get_stats().num_step_interrupts_total == int(interrupts)
    status = RequestStatus.RUNNING if interrupts else RequestStatus.WAITING
    assert e.scheduler.requests["c1"].status == status
    run_to_completion(e)
