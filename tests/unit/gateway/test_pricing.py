"""gateway.pricing: a request's cost counted per tenant and model, by the configured prices."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from gateway import pricing
from ratelimit.budget.policy import PriceTable

SERIES = "gateway_tenant_spend_usd_total"


def spend(tenant: str, model: str) -> float:
    return REGISTRY.get_sample_value(SERIES, {"tenant": tenant, "model": model}) or 0.0


def test_spend_is_the_priced_tokens() -> None:
    prices = PriceTable.parse({"smol": {"prompt_per_million": 2.0, "completion_per_million": 8.0}})
    before = spend("t-price", "smol")
    cost = pricing.count_spend(prices, "t-price", "smol", 1_000, 500)
    assert cost == pytest.approx((1_000 * 2.0 + 500 * 8.0) / 1e6)
    pricing.count_spend(prices, "t-price", "smol", 1_000_000, 0)
    assert spend("t-price", "smol") - before == pytest.approx(cost + 2.0)


def test_the_default_price_applies_to_other_models() -> None:
    prices = PriceTable.parse({"*": {"prompt_per_million": 1.0, "completion_per_million": 1.0}})
    pricing.count_spend(prices, "t-default", "other", 10, 10)
    assert spend("t-default", "other") == pytest.approx(20 / 1e6)


def test_nothing_is_counted_unpriced_or_unattributed() -> None:
    priced = PriceTable.parse({"smol": {"prompt_per_million": 1.0, "completion_per_million": 1.0}})
    assert pricing.count_spend(PriceTable(), "t-free", "smol", 100, 100) == 0.0
    pricing.count_spend(priced, "", "smol", 100, 100)  # not authenticated
    pricing.count_spend(priced, "t-early", "", 100, 100)  # ended before a model
    assert REGISTRY.get_sample_value(SERIES, {"tenant": "t-free", "model": "smol"}) is None
    assert REGISTRY.get_sample_value(SERIES, {"tenant": "", "model": "smol"}) is None
    assert REGISTRY.get_sample_value(SERIES, {"tenant": "t-early", "model": ""}) is None
