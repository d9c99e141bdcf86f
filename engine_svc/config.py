"""The ``engine`` config section: the engine service around an engine backend (the engine
itself is the ``engine_core`` section, ``engine_svc.core.config.EngineConfig``)."""

from __future__ import annotations

import dataclasses

from common.config import DEFAULT_MODEL_NAME, ServiceConfig


@dataclasses.dataclass(slots=True)
class EngineServiceConfig(ServiceConfig):
    port: int = 50071
    grace_seconds: float = 30.0
    backend: str = "native"  # native | trtllm | vllm
    model_name: str = DEFAULT_MODEL_NAME
    model_version: str = ""  # empty = derived from the checkpoint's checksum
    warmup: bool = True
    vllm_enforce_eager: bool = False  # backend vllm: no graph compile at start (faster start)
