"""Where the live routing policies are kept: Redis (shared by every gateway replica).

    <ratelimit key_prefix>routing:policies   hash  model -> policy JSON (with its revision)

Writes are compare-and-set on the revision (one Lua call), so two admins or
an admin and the automatic guard never overwrite each other blindly.
``PolicyCache`` in front of it is what the request path reads: one dict
lookup, refreshed from Redis at most every ``ttl_s`` (the bound on how long
another replica routes by an old policy; the replica that writes updates
its own cache at once). A failed refresh keeps the last good policies.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

from common.log import get_logger
from gateway.release.snapshot import SnapshotCache, read_json_hash
from gateway.routing_policy import RoutingPolicy, from_dict
from ratelimit.errors import ConflictError
from ratelimit.redis_client import RedisClient
from ratelimit.tenancy.registry import redis_errors

log = get_logger(__name__)

_CAS = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local rev = 0
if cur then rev = tonumber(cjson.decode(cur)['revision']) or 0 end
if rev ~= tonumber(ARGV[2]) then return rev end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return -1
"""


class PolicyStore(Protocol):
    """Storage of the policies (Redis in production, memory in unit tests).

    Both methods raise ``StoreError`` when the storage fails.
    """

    async def load_all(self) -> dict[str, RoutingPolicy]:
        """Every stored policy by model."""

    async def compare_and_set(
        self, model: str, revision: int, policy: RoutingPolicy | None
    ) -> bool:
        """Write (None = delete) if the stored revision is ``revision`` (0 = absent)."""


class RedisPolicyStore:
    """Policies in one Redis hash.

    Args:
        client: ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        prefix: The ratelimit key prefix (so one prefix isolates a whole stack).
    """

    def __init__(self, client: RedisClient, prefix: str = "rl:") -> None:
        self.client = client
        self.key = f"{prefix}routing:policies"

    async def load_all(self) -> dict[str, RoutingPolicy]:
        """Every stored policy; a corrupt entry is logged and skipped."""
        return await read_json_hash(
            self.client, self.key, lambda model, d: from_dict(d, model), "routing policies"
        )

    async def compare_and_set(
        self, model: str, revision: int, policy: RoutingPolicy | None
    ) -> bool:
        """See ``PolicyStore``."""
        body = json.dumps(policy.to_dict(), sort_keys=True) if policy is not None else ""
        with redis_errors("routing policy write"):
            found = await self.client.eval(_CAS, 1, self.key, model, str(revision), body)  # type: ignore[misc]
        return int(found) == -1


class MemoryPolicyStore:
    """A dict with the same contract (unit tests, or a gateway without Redis)."""

    def __init__(self) -> None:
        self.policies: dict[str, RoutingPolicy] = {}

    async def load_all(self) -> dict[str, RoutingPolicy]:
        """See ``PolicyStore``."""
        return dict(self.policies)

    async def compare_and_set(
        self, model: str, revision: int, policy: RoutingPolicy | None
    ) -> bool:
        """See ``PolicyStore``."""
        cur = self.policies.get(model)
        if (cur.revision if cur is not None else 0) != revision:
            return False
        if policy is None:
            self.policies.pop(model, None)
        else:
            self.policies[model] = policy
        return True


class PolicyCache(SnapshotCache[RoutingPolicy]):
    """Local view of the policies with bounded staleness.

    Args:
        store: The shared store.
        ttl_s: Longest time a policy is used without re-reading the store.
    """

    def __init__(self, store: PolicyStore, ttl_s: float = 1.0) -> None:
        super().__init__(store.load_all, ttl_s, "routing policies")
        self.store = store

    async def write(self, model: str, policy: RoutingPolicy | None, expected: int) -> None:
        """Compare-and-set ``policy`` (None = delete) and update this replica at once.

        Raises:
            ConflictError: the stored revision is not ``expected``.
        """
        if not await self.store.compare_and_set(model, expected, policy):
            self.invalidate()
            raise ConflictError(
                f"the routing policy of {model!r} changed since revision "
                f"{expected}; read it again and retry"
            )
        self.set_local(model, policy)

    async def seed(self, policies: dict[str, RoutingPolicy]) -> None:
        """Store the configured policies of models that have none yet (Redis wins)."""
        current = await self.store.load_all()
        for model, policy in policies.items():
            if model in current:
                log.info(
                    "routing policy from redis kept over the config",
                    model=model,
                    revision=current[model].revision,
                )
                continue
            seeded = policy.replace(revision=1, updated_by="config", updated_at=time.time())
            if await self.store.compare_and_set(model, 0, seeded):
                log.info("routing policy seeded from the config", model=model)
        self.invalidate()
