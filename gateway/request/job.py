"""The engine job of a counted prompt: the route's target it fits, its max_tokens, the
model version by routing policy, and the engine request id."""

from __future__ import annotations

import grpc
import structlog

from gateway.domain import CallContext, Deadline, GatewayError, engine_request_id
from gateway.fleet.dispatcher import EngineJob
from gateway.release.version_router import RouteDecision, VersionRouter
from gateway.request.models import Choice
from gateway.request.params import engine_sampling, resolve_max_tokens
from gateway.spans import stage
from llm.v1 import common_pb2, gateway_pb2
from ratelimit.config import Tenant


class JobBuilder:
    """Builds each admitted request's EngineJob.

    Args:
        router: Model version by routing policy (None = the requested version, or any).
        default_max_tokens: max_tokens of a request that gives none.
        max_max_tokens: The most max_tokens a request may ask for.
    """

    def __init__(
        self, router: VersionRouter | None, default_max_tokens: int, max_max_tokens: int
    ) -> None:
        self.router = router
        self.default_max_tokens = default_max_tokens
        self.max_max_tokens = max_max_tokens

    async def build(
        self,
        request: gateway_pb2.GenerateRequest,
        call: CallContext,
        tenant: Tenant,
        choice: Choice,
        prompt_ids: list[int],
        deadline: Deadline,
        priority: common_pb2.Priority.ValueType,
    ) -> tuple[EngineJob, str]:
        """The engine job of a counted prompt (the route's target it fits, max_tokens,
        the version by routing policy), and the version a shadow copy goes to.

        Raises:
            GatewayError: INVALID_ARGUMENT when max_tokens does not fit.
        """
        # a route's next target when the prompt and the asked-for output do not fit
        choice.fit(len(prompt_ids), max(request.sampling.max_tokens, request.sampling.min_tokens))
        model, info = choice.model, choice.info
        try:
            max_tokens = resolve_max_tokens(
                request.sampling,
                len(prompt_ids),
                info.max_context_length,
                self.default_max_tokens,
                self.max_max_tokens,
            )
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        with stage(call.trace, "gateway.route"):
            route = await self._route(model, choice.version, tenant, call)
        engine_id = engine_request_id(tenant.tenant_id)
        structlog.contextvars.bind_contextvars(engine_request_id=engine_id)
        job = EngineJob(
            request_id=engine_id,
            correlation_id=call.request_id,
            traceparent=call.traceparent,
            tenant_id=tenant.tenant_id,
            tenant_weight=float(tenant.fair_share),
            cache_salt=tenant.cache_salt,
            priority=priority,
            model=model,
            model_version=route.version,
            prompt_token_ids=prompt_ids,
            sampling=engine_sampling(request.sampling, max_tokens),
            deadline=deadline,
            stop_strings=list(request.sampling.stop),
            fallback_versions=route.fallbacks,
            fallback_models=choice.next_targets(len(prompt_ids) + max_tokens),
            trace=call.trace,
        )
        return job, route.shadow_version

    async def _route(
        self, model: str, version: str, tenant: Tenant, call: CallContext
    ) -> RouteDecision:
        if self.router is None:
            return RouteDecision(version, reason="request" if version else "any")
        return await self.router.decide(model, version, tenant.tenant_id, call.session_key)
