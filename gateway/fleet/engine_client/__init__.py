"""Engine clients: one per wire protocol behind one seam (``base.EngineClient``).

``connect`` builds the client an engine entry names: llm.v1.Engine for a bare
``host:port`` or ``llm://``, smg-grpc-proto's VllmEngine for ``vllm://`` and
TrtllmService for ``trtllm://``, SglangScheduler for ``sglang://``
(docs/engine-protocols.md lists which guarantee holds on which).
"""

from __future__ import annotations

from gateway.config import EngineEntry
from gateway.fleet.engine_client.base import ChannelSecurity, EngineClient
from gateway.fleet.engine_client.llm_v1 import LlmV1Client
from gateway.fleet.engine_client.sglang import SglangClient
from gateway.fleet.engine_client.trtllm import TrtllmClient
from gateway.fleet.engine_client.vllm import VllmClient

__all__ = ["ChannelSecurity", "EngineClient", "connect"]


def connect(
    entry: EngineEntry,
    service_token: str = "",
    security: ChannelSecurity | None = None,
    poll_interval_s: float = 1.0,
) -> EngineClient:
    """The client of one engine address (a channel; nothing is sent until it is used)."""
    target = str(EngineEntry("llm", entry.host, entry.port))  # host:port
    if entry.protocol == "llm":
        return LlmV1Client(target, service_token, security, entry.tls_name)
    kinds: dict[str, type[VllmClient | TrtllmClient]] = {
        "vllm": VllmClient,
        "trtllm": TrtllmClient,
        "sglang": SglangClient,
    }
    kind = kinds[entry.protocol]
    return kind(
        target,
        service_token,
        security,
        entry.tls_name,
        poll_interval_s=poll_interval_s,
        model=entry.model,
        version=entry.version,
    )
