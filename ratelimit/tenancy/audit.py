"""Audit log of admin mutations: who (admin key id), what (rpc), when, on what, detail.

Kept in a capped Redis list (newest first) and also emitted as a structured
log line, so it survives in the log pipeline after the list rolls over.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.log import get_logger
from ratelimit.redis_client import RedisClient
from ratelimit.tenancy.registry import redis_errors

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One admin mutation."""

    time: float  # unix seconds
    actor: str  # key id of the admin key
    action: str  # rpc name
    target: str  # tenant or key id
    detail: str  # JSON of the change


class AuditLog:
    """Append-only (capped) audit trail in Redis.

    Args:
        client: ``RedisClient`` (one server or a cluster) with ``decode_responses=True``.
        prefix: Key prefix; the list is ``<prefix>audit``.
        max_events: Older events are trimmed beyond this many.
    """

    def __init__(
        self, client: RedisClient, *, prefix: str = "rl:", max_events: int = 10_000
    ) -> None:
        self.client = client
        self.key = f"{prefix}audit"
        self.max_events = max_events

    async def record(
        self, actor: str, action: str, target: str, detail: Mapping[str, Any]
    ) -> AuditEvent:
        """Append one event (raises ``StoreError`` if Redis fails)."""
        event = AuditEvent(time.time(), actor, action, target, json.dumps(detail, sort_keys=True))
        raw = json.dumps(
            {
                "time": event.time,
                "actor": actor,
                "action": action,
                "target": target,
                "detail": event.detail,
            }
        )
        with redis_errors("audit"):
            pipe = self.client.pipeline(transaction=True)
            pipe.lpush(self.key, raw)
            pipe.ltrim(self.key, 0, self.max_events - 1)
            await pipe.execute()
        log.info("audit", actor=actor, action=action, target=target, detail=event.detail)
        return event

    async def list(self, limit: int = 100) -> list[AuditEvent]:
        """The newest ``limit`` events, newest first."""
        with redis_errors("audit list"):
            raws = await self.client.lrange(self.key, 0, max(limit, 1) - 1)
        events = []
        for raw in raws:
            d = json.loads(raw)
            events.append(
                AuditEvent(float(d["time"]), d["actor"], d["action"], d["target"], d["detail"])
            )
        return events
