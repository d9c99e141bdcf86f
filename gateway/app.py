"""Wiring: every component of one gateway process, built from config.

``GatewayApp.from_config`` builds the pipeline that every front shares; the
gRPC front (``gateway.fronts.grpc_servicer``) and, later, the OpenAI-compatible HTTP
front take ``app.pipeline``. ``start``/``drain``/``close`` plug into the
common server lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.log import get_logger
from common.service_auth import read_service_token
from gateway.config import GatewayConfig
from gateway.fleet.discovery import Discovery, has_names
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.engine_client import ChannelSecurity
from gateway.fleet.fair_queue import FairQueues
from gateway.fleet.replica_pool import ReplicaPool
from gateway.fleet.retry import RetryBudget, RetryPolicy
from gateway.fleet.tokenizers import TokenizerSet
from gateway.release.wiring import ReleaseControl
from gateway.request.authenticate import Authenticator, FailedAuthThrottle
from gateway.request.budgets import BudgetGate
from gateway.request.encode import Encoder
from gateway.request.models import ModelChooser
from gateway.request.pipeline import Pipeline
from ratelimit.config import RateLimitConfig
from ratelimit.factory import RateLimitStack
from tokenizer_svc.tokenizer import TextTokenizer

log = get_logger(__name__)


@dataclass(slots=True)
class GatewayApp:
    """The components of one gateway process."""

    config: GatewayConfig
    stack: RateLimitStack
    pool: ReplicaPool
    encoder: Encoder
    pipeline: Pipeline
    release: ReleaseControl  # model versions, canaries, rollback (RoutingAdmin)
    discovery: Discovery  # engine entries that are DNS names: one replica per address

    @classmethod
    def from_config(cls, config: GatewayConfig, rl_config: RateLimitConfig) -> GatewayApp:
        """Build everything; no network I/O until ``start``."""
        stack = RateLimitStack.from_config(rl_config)
        token = read_service_token(config.service_token_file)
        # each model's tokenizer comes from its engines; model_dir only for engines
        # that serve none
        tokenizers = TokenizerSet(TextTokenizer(config.model_dir) if config.model_dir else None)
        pool = ReplicaPool(
            config.engines,
            config.breaker,
            max_ejected_fraction=config.max_ejected_fraction,
            stats_interval_s=config.stats_interval_s,
            queue_weight=config.queue_weight,
            kv_weight=config.kv_weight,
            prefix_weight=config.prefix_weight,
            tenant_shard_size=config.tenant_shard_size,
            default_model=config.default_model,
            service_token=token,
            tokenizers=tokenizers,
            security=ChannelSecurity.from_files(
                config.engine_tls_ca_file,
                config.engine_tls_cert_file,
                config.engine_tls_key_file,
                config.engine_tls_server_name,
            ),
        )
        encoder = Encoder(
            config.tokenizer, config.encode_timeout_s, token, in_process=config.tokenize_in_process
        )
        dispatcher = Dispatcher(
            pool,
            RetryPolicy(
                config.max_attempts,
                config.retry_backoff_base_ms / 1000.0,
                config.retry_backoff_max_ms / 1000.0,
            ),
            RetryBudget(
                config.retry_budget_ratio, config.retry_budget_min, config.retry_budget_window_s
            ),
            failover=config.failover,
            max_failovers=config.max_failovers,
            queues=FairQueues(
                config.queue_max_wait_ms / 1000.0,
                config.queue_max_waiting,
                config.queue_max_waiting_per_tenant,
            ),
        )
        release = ReleaseControl.build(config, stack, pool, dispatcher)
        prices = config.price_table()
        pipeline = Pipeline(
            config,
            Authenticator(
                stack.registry,
                FailedAuthThrottle(config.auth_failures_per_minute, config.auth_failure_burst),
            ),
            encoder,
            tokenizers,
            stack.limiter,
            pool,
            dispatcher,
            router=release.router,
            shadow=release.shadow,
            models=ModelChooser(pool, release.routes),
            budgets=BudgetGate(stack.budgets, prices, rl_config.fail_mode),
            usage=stack.usage,
            prices=prices,
        )
        discovery = Discovery(config.engines, pool.sync, config.discovery_interval_s)
        return cls(config, stack, pool, encoder, pipeline, release, discovery)

    async def start(self) -> None:
        """Connect Redis, watch the engines, wait (bounded) for one SERVING engine."""
        await self.stack.start()
        await self.stack.join()  # the live replica count divides the fail-open share
        await self.release.start()
        if has_names(self.config.engines):
            await self.discovery.refresh()  # start from the resolved addresses
        self.pool.start()
        self.discovery.start()
        if not await self.pool.wait_ready(self.config.startup_wait_s):
            log.warning(
                "no engine replica is SERVING yet; requests get UNAVAILABLE until one is",
                engines=self.config.engines,
            )

    async def drain(self) -> None:
        """Stop admitting and let streams in flight finish within the grace period."""
        await self.pipeline.drain(self.config.grace_seconds)

    async def close(self) -> None:
        """Release every connection."""
        await self.release.close()
        await self.discovery.close()
        await self.pool.close()
        await self.encoder.close()
        await self.stack.aclose()
