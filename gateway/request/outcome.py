"""What one generate request came to: its model, version and tokens charged, as the
request's trace attributes and its usage record (with its cost)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from ratelimit.budget.policy import PriceTable
from ratelimit.usage.records import UsageEvent


@dataclass(slots=True)
class Outcome:
    """Filled in as the request goes; read once it has ended (metrics, trace, usage)."""

    model: str = ""  # set once the model is known (no client strings as label values)
    version: str = ""
    prompt_tokens: int = 0  # what the request was charged (set when it settles)
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0

    def span_attributes(self, tenant_id: str) -> dict[str, str | int]:
        """The attributes of the request's root span."""
        return {
            "llm.tenant_id": tenant_id,
            "gen_ai.request.model": self.model,
            "llm.model_version": self.version,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "llm.cached_prompt_tokens": self.cached_prompt_tokens,
        }

    def usage_event(
        self, tenant_id: str, key_id: str, code: grpc.StatusCode, prices: PriceTable
    ) -> UsageEvent:
        """The usage record of the request, priced by the model's price."""
        price = prices.price(self.model)
        return UsageEvent(
            tenant_id=tenant_id,
            key_id=key_id,
            model=self.model,
            model_version=self.version,
            status=code.name,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            completion_tokens=self.completion_tokens,
            cost_usd=price.cost(self.prompt_tokens, self.completion_tokens),
        )
