"""Shadow traffic: mirror a request to a candidate version and throw the answer away.

    admitted request ──► primary attempt (the client's stream, unchanged)
          └─ shadow share ─► background task: same prompt ids and sampling on a
                             replica of the shadow version, LOW priority,
                             request id ``<id>-shadow``; output discarded;
                             outcome and TTFT recorded per version

The copy never touches the tenant's limits (nothing is reserved or settled
for it), never reaches the client, and cannot fail or delay the primary: it
runs in its own task, bounded by ``max_in_flight`` (beyond it copies are
skipped and counted) and by the request's deadline. Its outcomes feed the
same per-version stats as real traffic, so the canary guard can judge a
version that only receives shadow traffic.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf import timestamp_pb2

from common.log import get_logger
from common.tasks import cancel_and_wait
from gateway import metrics
from gateway.fleet.dispatcher import EngineJob
from gateway.fleet.engine_client.base import GenerateStream
from gateway.fleet.replica_pool import NoReplicaError, ReplicaPool
from gateway.fleet.retry import breaker_verdict
from gateway.release.version_stats import VersionStats
from llm.v1 import common_pb2, engine_pb2

log = get_logger(__name__)


def shadow_request(job: EngineJob) -> engine_pb2.EngineGenerateRequest:
    """The engine request of a job's shadow copy."""
    deadline = timestamp_pb2.Timestamp()
    deadline.FromNanoseconds(int(job.deadline.wall_time * 1e9))
    return engine_pb2.EngineGenerateRequest(
        request_id=f"{job.request_id}-shadow",
        prompt_token_ids=job.prompt_token_ids,
        sampling=job.sampling,
        priority=common_pb2.LOW,
        tenant_id=job.tenant_id,
        deadline=deadline,
        model=job.model,
    )


class ShadowMirror:
    """Fire-and-forget shadow calls.

    Args:
        pool: The engine replicas.
        stats: Per-version outcomes (the guard's input).
        max_in_flight: Shadow calls allowed at once on this gateway replica.
    """

    def __init__(self, pool: ReplicaPool, stats: VersionStats, max_in_flight: int = 8) -> None:
        self.pool = pool
        self.stats = stats
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def num_in_flight(self) -> int:
        """Shadow calls running now."""
        return len(self._tasks)

    def mirror(self, job: EngineJob, version: str) -> bool:
        """Start a shadow copy of ``job`` on ``version``; False when skipped."""
        if self.num_in_flight >= self.max_in_flight:
            metrics.SHADOW_SKIPPED.labels(job.model, "saturated").inc()
            return False
        task = asyncio.create_task(self._run(job, version), name=f"shadow-{job.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def close(self) -> None:
        """Cancel every shadow call (shutdown)."""
        await cancel_and_wait(*self._tasks)

    async def _run(self, job: EngineJob, version: str) -> None:
        try:
            replica, ticket = self.pool.choose(job.model, version)
        except NoReplicaError as e:
            metrics.SHADOW_SKIPPED.labels(job.model, "unavailable").inc()
            self.stats.record(job.model, version, ok=False)
            log.info(
                "shadow copy skipped: no replica of the version", version=version, reason=str(e)
            )
            return
        start = time.perf_counter()
        ttft: float | None = None
        code = grpc.StatusCode.OK
        call: GenerateStream | None = None
        try:  # the replica is acquired: every path below ends in release()
            call = replica.client.generate(
                shadow_request(job),
                timeout=job.deadline.remaining(),
                metadata=(("x-request-id", f"{job.request_id}-shadow"), ("x-shadow", "1")),
            )
            async for resp in call:
                if resp.finish_reason == common_pb2.ERROR:
                    code = grpc.StatusCode.INTERNAL
                    break
                if ttft is None and resp.token_ids:
                    ttft = time.perf_counter() - start
                    metrics.SHADOW_TTFT.labels(job.model, version).observe(ttft)
                if resp.finish_reason:
                    break
        except grpc.aio.AioRpcError as e:
            code = e.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("shadow call failed")
        finally:
            if call is not None:
                call.cancel()
            verdict = breaker_verdict(code) if code != grpc.StatusCode.CANCELLED else None
            replica.release(verdict, ticket)
            metrics.SHADOW_REQUESTS.labels(job.model, version, code.name).inc()
            if verdict is not None:
                self.stats.record(job.model, version, ok=verdict, ttft_s=ttft)
