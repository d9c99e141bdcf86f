"""What tenants spend, by the prices configured per model (``[gateway] prices``: USD per
million prompt and completion tokens; docs/configuration.md).

``count_spend`` adds a finished request's cost to
``gateway_tenant_spend_usd_total{tenant,model}``: the same figure as the request's usage
record (``cost_usd``), counted whether or not a usage log is kept, so a dashboard shows
spend per tenant from Prometheus alone. An unpriced model costs nothing and makes no
series: with no prices configured the counter has no samples.
"""

from __future__ import annotations

from gateway import metrics
from ratelimit.budget.policy import PriceTable


def count_spend(
    prices: PriceTable, tenant: str, model: str, prompt_tokens: int, completion_tokens: int
) -> float:
    """Count one request's cost against ``tenant`` and ``model``; returns it (USD)."""
    cost = prices.price(model).cost(prompt_tokens, completion_tokens)
    if cost > 0 and tenant and model:
        metrics.TENANT_SPEND.labels(tenant, model).inc(cost)
    return cost
