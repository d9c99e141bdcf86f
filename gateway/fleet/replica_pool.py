"""The engine replica pool: which replica serves the next attempt.

Candidates serve the requested model (and version, when pinned), are
healthy (health watch SERVING), not draining, not already tried by this
request, and their breaker admits a call. Among them the lowest score wins:

    load  = outstanding + queue_weight * num_waiting
    score = (load + 1) * (1 + kv_weight * kv_cache_usage)

so an idle replica with a full KV cache loses to an idle one with room; a replica
whose KV events say it holds the start of the prompt has its score cut by up to
half (``engine_client.kv_events.prefix_discount``); ties go to the replica picked
least recently (spreads sequential traffic,
and sends a recovering half-open replica its probe soon). ``NoReplicaError``
says, per replica, why none could serve. Replicas are grouped into
deployments by (model, version) from their ModelInfo; which version a
request goes to is decided before (``gateway.release.version_router``): ``choose`` takes
that version and, in order, the versions to fall back to when it has no
replica able to serve.

With ``tenant_shard_size`` k > 0, a tenant's requests go to its shard: the k
replicas of the deployment that rank highest for that tenant under rendezvous
hashing (the same for every gateway replica, and a replica joining or leaving
moves only the tenants whose shard it enters or leaves). Within the shard the
score decides; the other replicas take the tenant's attempt only when no
shard replica can (unhealthy, draining, circuit open, or already tried by this
request, as after a full engine queue's refusal). So one tenant's flood fills
its own k replicas, not every one, and two tenants share all of theirs only
when their shards coincide.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.breaker import BreakerGroup, BreakerPolicy, BreakerState, Ticket
from common.log import get_logger
from gateway import metrics
from gateway.config import PREFIX_WEIGHT, EngineEntry, parse_engine_entry
from gateway.fleet.engine_client import ChannelSecurity
from gateway.fleet.engine_client.kv_events import PromptBlocks, prefix_discount
from gateway.fleet.replica import Replica
from gateway.fleet.tokenizers import TokenizerSet
from llm.v1 import engine_pb2

log = get_logger(__name__)


class NoReplicaError(Exception):
    """No replica can take the attempt; the message lists why, per replica."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model as seen across the pool (for ListModels)."""

    model: str
    max_context_length: int
    versions: dict[str, tuple[int, int]]  # version -> (num_replicas, num_healthy)
    routes: dict[str, tuple[float, str]] = field(default_factory=dict)  # version ->
    # (weight percent, state) under the model's routing policy; empty = no policy
    targets: tuple[str, ...] = ()  # a model route's targets in order ("model[@version]")


def _entries(addresses: Sequence[str | EngineEntry]) -> dict[str, EngineEntry]:
    """Engine entries by address text, first of each kept, in order."""
    out: dict[str, EngineEntry] = {}
    for a in addresses:
        entry = parse_engine_entry(a) if isinstance(a, str) else a
        out.setdefault(str(entry), entry)
    return out


def shard_rank(tenant: str, address: str) -> int:
    """Rendezvous-hash weight of ``address`` for ``tenant`` (higher = in its shard first)."""
    digest = hashlib.blake2b(f"{tenant}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def score(replica: Replica, queue_weight: float, kv_weight: float) -> float:
    """Routing score (lower is better); see the module docstring."""
    stats = replica.stats
    waiting = stats.num_waiting if stats is not None else 0
    kv = stats.kv_cache_usage if stats is not None else 0.0
    load = replica.outstanding + queue_weight * waiting
    return (load + 1.0) * (1.0 + kv_weight * kv)


class ReplicaPool:
    """Every configured engine replica, with breakers and the routing rule.

    Args:
        addresses: Each replica's engine entry (``[protocol://]host:port``, parsed or
            not; the address is its text).
        policy: Breaker thresholds.
        max_ejected_fraction: Ejection cap of the breaker group.
        stats_interval_s: GetStats period.
        queue_weight / kv_weight: Score weights.
        prefix_weight: Weight of a replica's cached share of the prompt (KV events).
        tenant_shard_size: Replicas per tenant's shard (0 = every replica); see the
            module docstring.
        default_model: Model for requests without one ("" = the most common).
        tokenizers: The models' tokenizers, fetched by the replicas (None = a new set
            with no tokenizer of its own).
        security: Plaintext, TLS or mutual TLS engine channels.
    """

    def __init__(
        self,
        addresses: Sequence[str | EngineEntry],
        policy: BreakerPolicy,
        *,
        max_ejected_fraction: float = 0.5,
        stats_interval_s: float = 0.5,
        queue_weight: float = 1.0,
        kv_weight: float = 1.0,
        prefix_weight: float = PREFIX_WEIGHT,
        tenant_shard_size: int = 0,
        default_model: str = "",
        service_token: str = "",
        tokenizers: TokenizerSet | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.service_token = service_token
        self.security = security
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerSet()
        self.breakers = BreakerGroup(policy, max_ejected_fraction, on_change=self._on_breaker)
        self.stats_interval_s = stats_interval_s
        self.retire_grace_s = 60.0
        self._retiring: set[asyncio.Future[None]] = set()
        self.replicas = [self._replica(e) for e in _entries(addresses).values()]
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.prefix_weight = prefix_weight
        self.tenant_shard_size = tenant_shard_size
        self._default_model = default_model

    def _replica(self, entry: EngineEntry) -> Replica:
        return Replica(
            entry,
            self.breakers.add(str(entry)),
            self.stats_interval_s,
            self.service_token,
            self.tokenizers,
            self.security,
        )

    @staticmethod
    def _on_breaker(name: str, state: BreakerState) -> None:
        metrics.BREAKER_STATE.labels(name).set(int(state))
        log.warning("engine replica breaker changed", replica=name, state=state.name)

    def start(self) -> None:
        """Start every replica's health watch and stats poll."""
        self._started = True
        for r in self.replicas:
            r.start()

    def sync(self, addresses: Sequence[str | EngineEntry]) -> None:
        """Make the pool exactly ``addresses`` (engine discovery): new replicas join,
        vanished ones leave routing at once and are closed after a grace period."""
        entries = _entries(addresses)
        wanted = list(entries)
        current = {r.address for r in self.replicas}
        gone = [r for r in self.replicas if r.address not in entries]
        added = [a for a in wanted if a not in current]
        if not gone and not added:
            return
        fresh = [self._replica(entries[a]) for a in added]
        self.replicas = [r for r in self.replicas if r.address in wanted] + fresh
        self.tokenizers.retain(r.info.tokenizer_digest for r in self.replicas if r.info)
        for r in gone:
            self.breakers.remove(r.address)
            self._retiring.add(asyncio.ensure_future(self._retire(r)))
        if getattr(self, "_started", False):
            for r in fresh:
                r.start()
        log.info(
            "engine replicas changed",
            added=added,
            removed=[r.address for r in gone],
            replicas=len(self.replicas),
        )

    async def _retire(self, replica: Replica) -> None:
        if replica.outstanding:  # streams on it get the grace period to finish or fail over
            await asyncio.sleep(self.retire_grace_s)
        await replica.close()
        if all(r.address != replica.address for r in self.replicas):  # not back meanwhile
            metrics.forget_replica(replica.address)  # no stale health or breaker series

    async def close(self) -> None:
        """Stop background work and close the channels."""
        await asyncio.gather(*(r.close() for r in self.replicas))
        for task in list(self._retiring):
            task.cancel()

    async def wait_ready(self, within_s: float) -> bool:
        """Wait until one replica is healthy (True) or ``within_s`` pass (False)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        while not any(r.healthy for r in self.replicas):
            if loop.time() >= end:
                return False
            await asyncio.sleep(0.05)
        return True

    def default_model(self) -> str:
        """The configured default model, else the model most replicas serve ("" if none known)."""
        if self._default_model:
            return self._default_model
        models = Counter(r.info.model for r in self.replicas if r.info is not None)
        return models.most_common(1)[0][0] if models else ""

    def model_info(self, model: str, version: str = "") -> engine_pb2.ModelInfo | None:
        """ModelInfo of a replica serving ``model`` (healthy ones first), or None."""
        known = [
            r
            for r in self.replicas
            if r.info is not None
            and r.info.model == model
            and (not version or r.info.version == version)
        ]
        known.sort(key=lambda r: not r.healthy)
        return known[0].info if known else None

    def catalog(self) -> list[ModelEntry]:
        """Models, versions and replica counts, from the replicas' ModelInfo."""
        entries: dict[str, ModelEntry] = {}
        for r in self.replicas:
            if r.info is None:
                continue
            e = entries.setdefault(
                r.info.model, ModelEntry(r.info.model, r.info.max_context_length, {})
            )
            n, healthy = e.versions.get(r.info.version, (0, 0))
            e.versions[r.info.version] = (n + 1, healthy + int(r.healthy and not r.draining))
        return sorted(entries.values(), key=lambda e: e.model)

    def candidates(self, model: str, version: str, exclude: Iterable[str]) -> list[Replica]:
        """Replicas that may take the attempt now."""
        skip = set(exclude)
        return [
            r
            for r in self.replicas
            if r.address not in skip
            and r.healthy
            and not r.draining
            and r.info is not None
            and r.info.model == model
            and (not version or r.info.version == version)
            and r.breaker.available()
        ]

    def deployments(self) -> dict[tuple[str, str], list[Replica]]:
        """Replicas grouped by (model, version) from their ModelInfo."""
        groups: dict[tuple[str, str], list[Replica]] = {}
        for r in self.replicas:
            if r.info is not None:
                groups.setdefault((r.info.model, r.info.version), []).append(r)
        return groups

    def choose(
        self,
        model: str,
        version: str = "",
        exclude: Iterable[str] = (),
        fallbacks: Sequence[str] = (),
        tenant: str = "",
        prompt: PromptBlocks | None = None,
    ) -> tuple[Replica, Ticket]:
        """Pick and acquire a replica of ``version``, else of each fallback version in order;
        ``tenant``'s shard first (``tenant_shard_size``); ``prompt`` weighs the replicas'
        prefix caches in.

        ``release(verdict, ticket)`` the replica when the call ends (the ticket tells
        its breaker whether this call is a half-open probe).

        Raises:
            NoReplicaError: none can serve; the message says why for each replica.
        """
        exclude = set(exclude)
        n = len(prompt.token_ids) if prompt is not None else 0

        def cached(r: Replica) -> float:
            return (
                1.0
                if prompt is None
                else prefix_discount(r.client.cached_tokens(prompt), n, self.prefix_weight)
            )

        for v in dict.fromkeys((version, *fallbacks)):
            found = self.candidates(model, v, exclude)
            shard = self.shard(model, v, tenant)
            found.sort(
                key=lambda r: (
                    shard is not None and r.address not in shard,
                    score(r, self.queue_weight, self.kv_weight) * cached(r),
                    r.last_pick,
                )
            )
            for r in found:
                ticket = r.breaker.admit()
                if ticket is not None:
                    r.acquire()
                    return r, ticket
        raise NoReplicaError(self.explain(model, version, exclude, fallbacks))

    def shard(self, model: str, version: str, tenant: str) -> set[str] | None:
        """Addresses of ``tenant``'s shard among the replicas serving ``model`` (and
        ``version``), healthy or not, so that a flapping replica does not move shards;
        None = no shard (off, an anonymous tenant, or no more replicas than its size)."""
        k = self.tenant_shard_size
        if k <= 0 or not tenant:
            return None
        serving = {
            r.address
            for r in self.replicas
            if r.info is not None
            and r.info.model == model
            and (not version or r.info.version == version)
        }
        if len(serving) <= k:
            return None
        return set(sorted(serving, key=lambda a: shard_rank(tenant, a), reverse=True)[:k])

    def explain(
        self, model: str, version: str, exclude: set[str], fallbacks: Sequence[str] = ()
    ) -> str:
        """Why no replica can serve ``model`` right now, one clause per replica."""
        wanted = {version, *fallbacks} if version else set()
        reasons = []
        for r in self.replicas:
            if r.address in exclude:
                why = "already tried by this request"
            elif not r.healthy:
                why = f"unhealthy: {r.last_error}"
            elif r.draining:
                why = "draining"
            elif r.info is not None and r.info.model != model:
                why = f"serves {r.info.model!r}"
            elif r.info is not None and wanted and r.info.version not in wanted:
                why = f"runs version {r.info.version!r}"
            else:
                why = f"circuit {r.breaker.state.name.lower().replace('_', '-')}"
            reasons.append(f"{r.address} {why}")
        return "; ".join(reasons) or "no engine replicas are configured"
