"""Build the standard-protocol servicers the config asks for and register them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.log import get_logger
from engine_svc.backends.base import Backend
from engine_svc.config import EngineServiceConfig
from engine_svc.service import EngineServicer
from engine_svc.standard import sglang_scheduler, trtllm_service, vllm_engine
from engine_svc.standard.shared import StandardEngine, tokenizer_bundle
from tokenizer_svc.tokenizer import TextTokenizer, TokenizerFilesError, read_tokenizer_files

log = get_logger(__name__)

PROTOCOLS = ("vllm", "trtllm", "sglang")


@dataclass(slots=True)
class StandardServicers:
    """The servicers to add beside llm.v1.Engine, with their full service names."""

    adders: list[tuple[Callable[[grpc.aio.Server], None], str]] = field(default_factory=list)

    def register(self, server: grpc.aio.Server) -> list[str]:
        for add, _ in self.adders:
            add(server)
        return [name for _, name in self.adders]


def check_protocols(names: Sequence[str]) -> list[str]:
    """The configured protocol names, checked.

    Raises:
        ValueError: a name is not one of ``PROTOCOLS``.
    """
    bad = [n for n in names if n not in PROTOCOLS]
    if bad:
        raise ValueError(
            f"engine.standard_protocols: unknown {bad}; choose from {list(PROTOCOLS)} (or none)"
        )
    return list(dict.fromkeys(names))


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    """The model's tokenizer for stop strings; None (logged) when it has none."""
    try:
        return TextTokenizer.from_files(read_tokenizer_files(model_dir))
    except (FileNotFoundError, TokenizerFilesError) as e:
        log.warning("no tokenizer: standard protocols refuse stop strings", reason=str(e))
        return None


def standard_servicers(
    backend: Backend,
    servicer: EngineServicer,
    svc: EngineServiceConfig,
    model_dir: Path,
    version: str,
    build: str,
) -> StandardServicers:
    """The VllmEngine / TrtllmService / SglangScheduler servicers ``svc.standard_protocols``
    names."""
    names = check_protocols(svc.standard_protocols)
    out = StandardServicers()
    if not names:
        return out
    engine = StandardEngine(
        backend,
        servicer,
        model_name=svc.model_name,
        model_dir=str(model_dir),
        tokenizer=load_tokenizer(model_dir),
        bundle=tokenizer_bundle(model_dir),
        version=version,
        build=build,
    )
    if "vllm" in names:
        v = vllm_engine.VllmEngineServicer(engine)
        out.adders.append((lambda s: vllm_engine.add_to_server(v, s), vllm_engine.SERVICE_NAME))
    if "trtllm" in names:
        t = trtllm_service.TrtllmServiceServicer(engine)
        name = trtllm_service.SERVICE_NAME
        out.adders.append((lambda s: trtllm_service.add_to_server(t, s), name))
    if "sglang" in names:
        g = sglang_scheduler.SglangSchedulerServicer(engine)
        name = sglang_scheduler.SERVICE_NAME
        out.adders.append((lambda s: sglang_scheduler.add_to_server(g, s), name))
    return out
