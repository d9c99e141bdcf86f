"""Fair share between tenants: a virtual token counter per tenant.

Within one priority class the scheduler serves the tenant that has received
the least service so far, after the Virtual Token Counter of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI 2024):

- every scheduled token is charged to its tenant, prefill tokens at
  ``prefill_weight`` and decode tokens at ``decode_weight``, divided by the
  tenant's weight (a weight-2 tenant gets twice the share of a weight-1 one);
- waiting requests are admitted, and prefill budget handed out, lowest
  counter first; the running request preempted first is the one whose
  tenant has the highest counter;
- a tenant that becomes active (its first live request) starts at the lowest
  counter among the active tenants, or keeps its own if that is higher: idle
  time earns no credit to flood with later, and a newcomer is served at once.

It is work-conserving: counters only order the work, nothing is held back, so
a tenant alone on the engine gets all of it. Counters of tenants with no live
request are dropped (memory stays bounded by the live requests, whatever the
number of tenant ids).

Timeline of two tenants, A flooding long prompts, B sending short chats::

    counters  A: 0 ... 900 ... 1400          B joins at 900 (lifted, not 0)
    admitted  A A A | B (900 < 1400) | A ...  B is next, never behind A's queue
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FairShare:
    """Virtual token counters of the tenants with live requests.

    Attributes:
        prefill_weight: cost of one prompt token.
        decode_weight: cost of one generated token (a decode step reads the
            whole context, so it costs more than a prefill token per token).
    """

    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    _counters: dict[str, float] = field(default_factory=dict)
    _live: dict[str, int] = field(default_factory=dict)

    def admit(self, tenant: str) -> None:
        """A request of ``tenant`` became live (queued)."""
        n = self._live.get(tenant, 0)
        if n == 0:
            active = [self._counters[t] for t in self._live]
            floor = min(active) if active else 0.0
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)
        self._live[tenant] = n + 1

    def release(self, tenant: str) -> None:
        """A request of ``tenant`` finished (or was dropped)."""
        n = self._live.get(tenant, 0) - 1
        if n > 0:
            self._live[tenant] = n
            return
        self._live.pop(tenant, None)
        self._counters.pop(tenant, None)

    def charge(
        self, tenant: str, num_prefill_tokens: int, num_decode_tokens: int, weight: float = 1.0
    ) -> None:
        """Count service the tenant received (``weight`` > 0: its share)."""
        cost = self.prefill_weight * num_prefill_tokens + self.decode_weight * num_decode_tokens
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / weight

    def counter(self, tenant: str) -> float:
        """Service received so far (0 for a tenant with no live request)."""
        return self._counters.get(tenant, 0.0)

    @property
    def num_tenants(self) -> int:
        """Tenants with a live request (the counters kept)."""
        return len(self._live)
