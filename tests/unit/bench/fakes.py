"""Fakes of the bench tests. The admin API's tenant and key calls, recorded. A
gateway_bench run without services: every side answers at once with fixed times
(engine 10 ms to the first token, the bare relay 1 ms more, the gateway 2 ms more, the
HTTP fronts 3 ms more to the first text event) and the gateway's /metrics holds one
stage histogram that grows by one observation per scrape."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.gatewaylib import measure as measure_mod
from bench.gatewaylib.scrape import Histo
from bench.gatewaylib.sides import SIDES, OneRequest, Sample
from llm.v1 import admin_pb2


class FakeAdmin:
    """The admin stub's two calls, recorded; keys numbered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def UpsertTenant(self, tenant: admin_pb2.Tenant, metadata: Any, timeout: float) -> None:
        self.calls.append(("upsert", tenant, metadata))

    def CreateApiKey(
        self, req: admin_pb2.CreateApiKeyRequest, metadata: Any, timeout: float
    ) -> admin_pb2.CreateApiKeyResponse:
        self.calls.append(("key", req, metadata))
        return admin_pb2.CreateApiKeyResponse(key=f"sk-{len(self.calls)}")


FIRST_TOKEN_S = {"engine": 0.010, "floor": 0.011, "gateway": 0.012}


def fake_sample(side: str) -> Sample:
    if side == "curl":
        return 0.015, math.nan, math.nan, 0.015
    ttft = FIRST_TOKEN_S.get(side, 0.012)
    return ttft, 0.001, 0.002, ttft + (0.003 if side not in FIRST_TOKEN_S else 0.0)


@contextlib.asynccontextmanager
async def fake_side_client(side: str, *_: Any, **__: Any) -> AsyncIterator[OneRequest]:
    async def one() -> Sample:
        return fake_sample(side)

    yield one


def bench_args(**over: Any) -> argparse.Namespace:
    """gateway_bench's flags, small."""
    base = {
        "rounds": 2,
        "requests_c1": 3,
        "requests_c32": 4,
        "max_tokens": 4,
        "pairs": 5,
        "connections": 1,
        "unlimited_tenant": False,
        "engine_dtype": "float32",
        "engine": "stub",
        "stub_first_token_ms": 0.0,
        "stub_token_gap_ms": 0.0,
        "gateway_workers": 1,
        "engine_cores": 0,
        "proxy_cores": 0,
    }
    return argparse.Namespace(**{**base, **over})


@pytest.fixture
def fake_sides(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """measure() against fake sides and a fake /metrics page; returns the sides."""
    scrapes = iter(range(1000))

    def scrape(_url: str) -> dict[str, Histo]:
        n = float(next(scrapes))
        return {"auth": (n, n * 0.001, {0.001: n, math.inf: n})}

    monkeypatch.setattr(measure_mod, "side_client", fake_side_client)
    monkeypatch.setattr(measure_mod, "scrape_histograms", scrape)
    return SIDES


@pytest.fixture
def fake_results(fake_sides: list[str]) -> dict[str, Any]:
    """What measure() returns for ``bench_args()`` against the fake sides."""
    return measure_mod.measure(bench_args(), {"gateway_metrics": "unused"}, "sk", [1, 2])
