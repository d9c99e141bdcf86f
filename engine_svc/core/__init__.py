"""Native engine core: request state, KV block pool, scheduler, sampler, LLMEngine.

Synchronous and free of gRPC, asyncio and Redis, so it is unit-testable with
plain tensors and drivable from one service thread.
"""

from engine_svc.core.config import EngineConfig, SchedulerConfig
from engine_svc.core.llm_engine import LLMEngine
from engine_svc.core.outputs import STEP_PHASES, EngineStats, ModelInfo, RequestOutput, StepTimings
from engine_svc.core.request import FinishReason, Request, RequestStatus, TokenLogprobs
from engine_svc.core.sampling_params import SamplingParams

__all__ = [
    "STEP_PHASES",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "ModelInfo",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SchedulerConfig",
    "StepTimings",
    "TokenLogprobs",
]
