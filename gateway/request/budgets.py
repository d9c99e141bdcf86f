"""Tenant budgets on the request path: reserve after the limits, settle with them.

A tenant without budgets costs nothing here (no Redis call). For one with
budgets, ``charge`` reserves the prompt plus ``max_tokens`` (or their price
from the price table) against every budget in one script; ``settle`` charges
what was used. When Redis cannot answer, the limiter's fail mode decides:
``open`` admits without a budget check (counted), ``closed`` refuses with
UNAVAILABLE.
"""

from __future__ import annotations

import time

import grpc

from common.log import get_logger
from gateway import metrics
from gateway.domain import CallContext, GatewayError
from ratelimit import metrics as rl_metrics
from ratelimit.budget.ledger import BudgetDecision, BudgetHold, BudgetLedger
from ratelimit.budget.policy import PriceTable, amount_text
from ratelimit.config import Tenant
from ratelimit.errors import StoreError
from ratelimit.status import quota_metadata

log = get_logger(__name__)
WARNING_HEADER = "x-budget-warning"


class BudgetGate:
    """Budget checks of the gateway.

    Args:
        ledger: The budgets in Redis.
        prices: USD per million tokens per model (cost budgets).
        fail_mode: ``open`` or ``closed``, as the limiter's.
    """

    def __init__(self, ledger: BudgetLedger, prices: PriceTable, fail_mode: str) -> None:
        self.ledger = ledger
        self.prices = prices
        self.fail_mode = fail_mode

    async def charge(
        self, tenant: Tenant, model: str, prompt_tokens: int, max_tokens: int, call: CallContext
    ) -> BudgetHold | None:
        """Reserve against the tenant's budgets; None when it has none (or Redis failed
        and the deployment fails open).

        Raises:
            GatewayError: RESOURCE_EXHAUSTED naming the budget and when it has room
                again; UNAVAILABLE when Redis failed and the deployment fails closed.
        """
        budgets = (*tenant.budgets, *call.key_budgets)
        if not budgets:
            return None
        t0 = time.perf_counter()
        try:
            decision = await self.ledger.charge(
                tenant.tenant_id,
                budgets,
                self.prices.price(model),
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                shadow=tenant.shadow_mode,
            )
        except StoreError as e:
            if self.fail_mode == "closed":
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot check the tenant's budgets: the store is unavailable ({e}); "
                    "this deployment fails closed, retry shortly",
                ) from None
            rl_metrics.BUDGET_UNCHECKED.labels("charge").inc()
            log.warning("budget check skipped (failing open)", error=str(e))
            return None
        finally:
            metrics.STAGE_BUDGET.observe(time.perf_counter() - t0)
        self._report(tenant, decision, call)
        if not decision.allowed:
            retry = decision.retry_after_ms
            assert decision.refused is not None
            name = decision.refused.budget.label
            message = decision.message(tenant.tenant_id)
            violation = (f"tenant:{tenant.tenant_id}/budget:{name}", message)
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                message,
                retry_after_ms=retry if retry >= 0 else None,
                trailers=quota_metadata([violation], retry, message),
            )
        return decision.hold

    def _report(self, tenant: Tenant, decision: BudgetDecision, call: CallContext) -> None:
        tid = tenant.tenant_id
        for level, amount in zip(decision.levels, decision.amounts, strict=True):
            after = level.used + amount if decision.allowed else level.used
            rl_metrics.BUDGET_USED_RATIO.labels(tid, level.budget.label).set(
                after / level.budget.limit
            )
        warned = decision.warnings() if decision.allowed else []
        for level in warned:
            rl_metrics.BUDGET_EVENTS.labels(tid, level.budget.label, "warned").inc()
        if warned:
            call.ratelimit[WARNING_HEADER] = ", ".join(
                f"{lv.budget.label}: {lv.percent:.0f}% of "
                f"{amount_text(lv.budget.limit, lv.budget.metric)} used"
                for lv in warned
            )
            log.info("budget past its soft threshold", budgets=[lv.budget.label for lv in warned])
        if decision.refused is not None:
            event = "shadow_refused" if decision.allowed else "refused"
            rl_metrics.BUDGET_EVENTS.labels(tid, decision.refused.budget.label, event).inc()
            log.info("budget " + event.replace("_", "-"), reason=decision.message(tid))

    async def settle(self, hold: BudgetHold, prompt_tokens: int, completion_tokens: int) -> None:
        """Charge the exact usage; a store failure leaves the reservation charged."""
        try:
            await self.ledger.settle(
                hold, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
            )
        except StoreError as e:
            rl_metrics.BUDGET_UNCHECKED.labels("settle").inc()
            log.warning("budget settle skipped; the reservation stays charged", error=str(e))
