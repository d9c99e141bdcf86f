"""The ``engine`` config section: the engine service around an engine backend (the engine
itself is the ``engine_core`` section, ``engine_svc.core.config.EngineConfig``)."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from common.config import DEFAULT_MODEL_NAME, ServiceConfig


@dataclasses.dataclass(slots=True)
class EngineServiceConfig(ServiceConfig):
    """The engine's gRPC service (``python -m engine_svc``).

    Attributes:
        backend: The engine behind the service: ``native`` (PyTorch, CPU or CUDA), the only
            one. vLLM and TensorRT-LLM run as their stock gRPC servers, which the gateway
            reaches directly (``vllm://`` and ``trtllm://`` engine addresses).
        model_name: The name the engine serves its model under (what requests ask for).
        model_version: The served model's version; "" = ``sha-<checksum>`` of the
            checkpoint's weights.
        warmup: Run one small batch before reporting SERVING.
        standard_protocols: The standard engine protocols (smg-grpc-proto) served beside
            llm.v1.Engine on the same port and authentication: ``vllm``
            (vllm.grpc.engine.VllmEngine), ``trtllm`` (trtllm.TrtllmService) and ``sglang``
            (sglang.grpc.scheduler.SglangScheduler); [] = none.
        tls_cert_file: PEM server certificate (chain) for the gRPC port; "" = plaintext.
            Set with ``tls_key_file``.
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_client_ca_file: PEM CA whose client certificates the port requires (mutual
            TLS): a caller without one fails the handshake, and one with it needs no
            service token (for clients that authenticate with certificates and cannot
            send metadata); "" = no client certificates (the service token applies).
    """

    port: int = 50071
    grace_seconds: float = 30.0
    backend: str = "native"
    model_name: str = DEFAULT_MODEL_NAME
    model_version: str = ""
    warmup: bool = True
    standard_protocols: list[str] = field(default_factory=lambda: ["vllm", "trtllm", "sglang"])
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""

    def __post_init__(self) -> None:
        if self.backend == "vllm":
            raise ValueError(
                "[engine] backend: vllm is no longer a backend of the engine service (the "
                "in-process adapter was removed). Run vLLM's stock gRPC server instead "
                "(`vllm serve <model dir> --grpc`, or deploy/stock_vllm.py) and list it in "
                "the gateway's engines as vllm://host:port (docs/engines.md); drop "
                "engine.backend and engine.vllm_enforce_eager from this config."
            )
        if self.backend != "native":
            raise ValueError(
                f"[engine] backend: unknown backend {self.backend!r}; the only one is native "
                "(vLLM and TensorRT-LLM run as their stock gRPC servers: docs/engines.md)"
            )
