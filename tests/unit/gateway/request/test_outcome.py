"""A request's outcome as its trace attributes and its priced usage record."""

from __future__ import annotations

import grpc
import pytest

from gateway.request.outcome import Outcome
from ratelimit.budget.policy import Price, PriceTable

OUTCOME = Outcome(
    model="m", version="v2", prompt_tokens=100, cached_prompt_tokens=40, completion_tokens=10
)


def test_span_attributes_name_the_tenant_model_version_and_tokens() -> None:
    assert OUTCOME.span_attributes("acme") == {
        "llm.tenant_id": "acme",
        "gen_ai.request.model": "m",
        "llm.model_version": "v2",
        "gen_ai.usage.input_tokens": 100,
        "gen_ai.usage.output_tokens": 10,
        "llm.cached_prompt_tokens": 40,
    }


def test_the_usage_event_is_priced_by_the_model_price() -> None:
    prices = PriceTable({"m": Price(prompt_per_million=2.0, completion_per_million=10.0)})
    event = OUTCOME.usage_event("acme", "k1", grpc.StatusCode.CANCELLED, prices)
    assert (event.tenant_id, event.key_id, event.model, event.model_version) == (
        "acme",
        "k1",
        "m",
        "v2",
    )
    assert event.status == "CANCELLED"
    assert (event.prompt_tokens, event.cached_prompt_tokens, event.completion_tokens) == (
        100,
        40,
        10,
    )
    assert event.cost_usd == pytest.approx((100 * 2.0 + 10 * 10.0) / 1e6)


def test_a_model_without_a_price_costs_the_default() -> None:
    prices = PriceTable({"other": Price(1.0, 1.0)}, default=Price(0.0, 0.0))
    assert OUTCOME.usage_event("acme", "", grpc.StatusCode.OK, prices).cost_usd == 0.0
    assert Outcome().usage_event("acme", "", grpc.StatusCode.OK, PriceTable()).model == ""
