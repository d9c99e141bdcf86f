"""bench.loadlib: workload mixes, tenant specs and the report's statistics (no servers)."""

from __future__ import annotations

import random

import pytest

from bench.loadlib.stats import Slo, full_summary, percentile, summarize
from bench.loadlib.targets import RequestRecord
from bench.loadlib.workload import SHAPES, Caps, TenantSpec, parse_mix


def rec(
    tenant: str = "t",
    priority: int = 2,
    ttft: float | None = 0.1,
    e2e: float = 1.0,
    out: int = 10,
    status: str = "OK",
) -> RequestRecord:
    return RequestRecord(
        tenant,
        priority,
        "short_chat",
        0.0,
        out,
        num_prompt_tokens=20,
        num_output_tokens=out if status == "OK" else 0,
        ttft=ttft,
        e2e=e2e,
        itl=[0.1] * (out - 1),
        status=status,
    )


def test_parse_mix_weights_and_errors() -> None:
    mix = parse_mix("short_chat:0.8,long_context:0.2")
    assert [(s.name, w) for s, w in mix] == [("short_chat", 0.8), ("long_context", 0.2)]
    assert parse_mix("chatlike")[0][1] == 1.0
    with pytest.raises(ValueError, match="unknown workload"):
        parse_mix("nope")
    with pytest.raises(ValueError, match="> 0"):
        parse_mix("short_chat:0")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_stay_in_their_bounds_and_are_seeded(name: str) -> None:
    shape = SHAPES[name]
    draws = [shape.draw(random.Random(7)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    rng = random.Random(1)
    for _ in range(500):
        p, o = shape.draw(rng)
        assert shape.prompt[0] <= p <= shape.prompt[1]
        assert shape.output[0] <= o <= shape.output[1]


def test_chatlike_is_skewed() -> None:
    rng = random.Random(0)
    prompts = sorted(SHAPES["chatlike"].draw(rng)[0] for _ in range(2000))
    median, p99 = prompts[1000], prompts[1980]
    assert p99 > 5 * median  # a long tail, like real chat traces


def test_caps_clamp() -> None:
    assert Caps(64, 8).apply(1000, 300) == (64, 8)
    assert Caps().apply(1000, 300) == (1000, 300)
    assert Caps().apply(0, 0) == (4, 1)


def test_tenant_spec_parse() -> None:
    t = TenantSpec.parse("name=gold,priority=critical,rate=2.5,rpm=60,mix=short_chat")
    assert (t.name, t.priority, t.priority_value, t.rate, t.rpm) == ("gold", "CRITICAL", 3, 2.5, 60)
    with pytest.raises(ValueError, match="unknown tenant field"):
        TenantSpec.parse("name=x,colour=red")
    with pytest.raises(ValueError, match="priority"):
        TenantSpec.parse("name=x,priority=URGENT")


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) != percentile([], 50)  # nan


def test_summarize_counts_throughput_errors_and_goodput() -> None:
    records = [rec(ttft=0.1), rec(ttft=0.3), rec(status="RESOURCE_EXHAUSTED", ttft=None, e2e=0.002)]
    s = summarize(records, wall_s=2.0, slo=Slo(ttft_ms=200))
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (3, 2, 1)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(10.0)
    assert s["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["error_latency_ms"]["p99"] == pytest.approx(2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(1000 * 0.8 / 9)
    assert s["goodput_req_s"] == pytest.approx(0.5)  # one of three met 200 ms
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_breakdowns_by_tenant_priority_and_kind() -> None:
    records = [rec("a", 3), rec("a", 3), rec("b", 1)]
    full = full_summary(records, 1.0)
    assert set(full["per_tenant"]) == {"a", "b"}
    assert set(full["per_priority"]) == {"CRITICAL", "LOW"}
    assert full["per_priority"]["CRITICAL"]["num_ok"] == 2
    assert set(full["per_kind"]) == {"short_chat"}
    assert full["overall"]["num_ok"] == 3
