"""The bench tenant's limits: ``bench.gateway_bench`` keys its tenant on the gateway
with them (``stack.make_key``), and the ``smg-tenant`` side gives SMG's tenant the same
token and request budgets (``stock.stock_stack``)."""

from __future__ import annotations

from llm.v1 import admin_pb2

# far above what the bench asks for, so nothing is denied, but every limit is checked:
# the request unit and lease before tokenizing, the tokens after (two Redis calls)
BENCH_LIMITS = admin_pb2.LimitPolicy(
    requests_per_minute=1_000_000, tokens_per_minute=1_000_000_000, max_concurrent=10_000
)


def bench_limits(limited: bool) -> admin_pb2.LimitPolicy:
    """The bench tenant's limits: ``BENCH_LIMITS``, or none at all (every field 0)."""
    return BENCH_LIMITS if limited else admin_pb2.LimitPolicy()
