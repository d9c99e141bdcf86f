"""llm.v1.Engine, our own engine protocol: the gateway's language on the wire, so the
client only adds credentials. Health is grpc.health.v1's Watch stream; the tokenizer
comes in named file pieces under the digest ModelInfo announced."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.service_auth import token_metadata
from gateway.fleet.engine_client.base import (
    ChannelSecurity,
    GenerateStream,
    Metadata,
    TokenizerFetchError,
)
from gateway.fleet.engine_client.kv_events import PromptBlocks
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import MAX_TOKENIZER_BYTES


class LlmV1Client:
    """An llm.v1.Engine replica.

    Args:
        address: ``host:port``.
        service_token: Sent on every call ("" = none).
        security: Plaintext, TLS or mutual TLS.
        tls_name: The name its certificate is checked against.
    """

    protocol = "llm"
    announces_tokenizer = True

    def __init__(
        self,
        address: str,
        service_token: str = "",
        security: ChannelSecurity | None = None,
        tls_name: str = "",
    ) -> None:
        self.address = address
        self.metadata = token_metadata(service_token)
        self.channel = (security or ChannelSecurity()).channel(address, tls_name)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, *, timeout: float, metadata: Metadata
    ) -> GenerateStream:
        call: GenerateStream = self.stub.Generate(
            request, timeout=timeout, metadata=(*metadata, *self.metadata)
        )
        return call

    async def model_info(self, timeout_s: float) -> engine_pb2.ModelInfo:
        info: engine_pb2.ModelInfo = await self.stub.GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return info

    async def stats(self, timeout_s: float) -> engine_pb2.EngineStats:
        stats: engine_pb2.EngineStats = await self.stub.GetStats(
            engine_pb2.GetStatsRequest(), timeout=timeout_s, metadata=self.metadata
        )
        return stats

    async def watch_health(self) -> AsyncGenerator[str, None]:
        stream = self._health.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for resp in stream:
                serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                yield "" if serving else "health check says NOT_SERVING"
        finally:
            stream.cancel()

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        return 0  # llm.v1.Engine streams no KV events

    def prefix_blocks(self) -> int:
        return 0

    async def tokenizer_files(self, digest: str, timeout_s: float) -> tuple[str, dict[str, bytes]]:
        files: dict[str, bytearray] = {}
        sizes: dict[str, int] = {}
        total = 0
        try:
            call = self.stub.GetTokenizer(
                engine_pb2.GetTokenizerRequest(), timeout=timeout_s, metadata=self.metadata
            )
            async for piece in call:
                total += len(piece.data)
                if piece.digest != digest or total > MAX_TOKENIZER_BYTES:
                    call.cancel()
                    raise TokenizerFetchError(
                        f"engine {self.address} sent a tokenizer other than the one it "
                        f"announced or over {MAX_TOKENIZER_BYTES} bytes"
                    )
                files.setdefault(piece.name, bytearray()).extend(piece.data)
                sizes[piece.name] = piece.file_size
        except grpc.aio.AioRpcError as e:
            raise TokenizerFetchError(
                f"GetTokenizer on {self.address} failed ({e.code().name}: {e.details()})"
            ) from None
        whole = {name: bytes(data) for name, data in files.items()}
        if any(len(whole[n]) != sizes[n] for n in whole):
            raise TokenizerFetchError(
                f"the tokenizer files from engine {self.address} are not the sizes it announced"
            )
        return digest, whole

    async def close(self) -> None:
        await self.channel.close(None)
