"""bench.gatewaylib.stack: the engine modules and the bench tenant's key."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest

from bench.gatewaylib import stack
from bench.gatewaylib.limits import BENCH_LIMITS
from llm.v1 import admin_pb2
from tests.unit.bench.fakes import FakeAdmin


def test_every_engine_choice_is_a_runnable_module() -> None:
    assert set(stack.ENGINE_MODULES) == {"model", "stub"}
    for module in stack.ENGINE_MODULES.values():
        assert importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("limited", [True, False])
def test_make_key_gives_the_bench_tenant_its_limits_or_none(
    monkeypatch: pytest.MonkeyPatch, limited: bool
) -> None:
    admin = FakeAdmin()
    opened: list[Any] = []

    def client(address: str, ca_cert: bytes | None = None) -> Any:
        opened.append((address, ca_cert))
        return contextlib.nullcontext(admin)

    monkeypatch.setattr(stack, "admin_client", client)
    key = stack.make_key("127.0.0.1:1", "adm", limited)
    assert key == "sk-2"
    assert opened == [("127.0.0.1:1", None)]  # plaintext, to the gateway
    tenant = admin.calls[0][1]
    assert tenant.id == "bench"
    want = BENCH_LIMITS if limited else admin_pb2.LimitPolicy()
    assert tenant.limits == want


def test_the_bench_gateway_uses_the_engines_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The gateway bench starts the gateway without a model directory of its own, as it
    always has, so its figures compare across versions."""
    specs: list[Any] = []

    class Started(Exception):
        pass

    class FakeStack:
        def __init__(self, spec: Any) -> None:
            specs.append(spec)

        def start(self) -> Any:
            raise Started

    monkeypatch.setattr(stack, "Stack", FakeStack)
    with pytest.raises(Started):
        stack.start_stack(tmp_path, engine="stub")
    (spec,) = specs
    assert spec.gateway
    assert not spec.gateway_model_dir
    assert spec.engine_module == "bench.gatewaylib.stub_engine"
