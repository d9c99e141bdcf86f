"""EngineConfig from one flat set of keyword args, for tests that vary engine and
scheduler settings together: the scheduler's knobs go to ``EngineConfig.scheduler``."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_svc.core.config import EngineConfig, SchedulerConfig

# max_model_len is the engine's key; the scheduler's copy is derived from it
SCHEDULER_KNOBS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig)) - {"max_model_len"}


def engine_config(**kwargs: Any) -> EngineConfig:
    """``EngineConfig(**kwargs)``, with the scheduler's knobs in its sub-section."""
    knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in SCHEDULER_KNOBS}
    return EngineConfig(**kwargs, scheduler=SchedulerConfig(**knobs))
