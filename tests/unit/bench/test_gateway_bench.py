"""bench.gateway_bench, the entry point: its flags and how main wires the modules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import gateway_bench
from bench.gatewaylib.sides import SIDES
from bench.gatewaylib.stock import STOCK_SIDES, StockRun, StubTiming


def test_the_flags_and_their_defaults() -> None:
    args = gateway_bench.parse_args([])
    assert (args.rounds, args.requests_c1, args.requests_c32, args.max_tokens) == (3, 16, 64, 16)
    assert (args.pairs, args.engine, args.engine_dtype, args.stub_first_token_ms) == (
        100,
        "model",
        "float32",
        0.0,
    )
    assert (args.engine_cores, args.proxy_cores, args.gateway_workers, args.connections) == (
        0,
        0,
        1,
        1,
    )
    assert args.unlimited_tenant is False
    assert args.stub_token_gap_ms == 0.0
    short = gateway_bench.parse_args(
        ["--engine", "stub", "--rounds", "1", "--pairs", "0", "--unlimited-tenant"]
    )
    assert (short.engine, short.rounds, short.pairs, short.unlimited_tenant) == (
        "stub",
        1,
        0,
        True,
    )
    with pytest.raises(SystemExit):
        gateway_bench.parse_args(["--engine", "vllm"])


def test_the_stock_engine_defaults_to_bfloat16_unless_a_dtype_is_named() -> None:
    assert gateway_bench.parse_args(["--engine", "stock-vllm"]).engine_dtype == "bfloat16"
    named = gateway_bench.parse_args(["--engine", "stock-vllm", "--engine-dtype", "float32"])
    assert named.engine_dtype == "float32"
    assert gateway_bench.parse_args(["--engine", "stub"]).engine_dtype == "float32"


def test_each_engine_has_its_sides_report_and_cpu_owners() -> None:
    stock = ["engine", "floor", "work", "gateway", "http", "smg", "smg-tenant"]
    assert gateway_bench.bench_sides("stock-vllm") == stock
    assert gateway_bench.bench_sides("model") == SIDES
    assert "smg" not in gateway_bench.bench_sides("stub")
    assert gateway_bench.report_name("stock-vllm") == "gateway_bench_stock_vllm"
    assert gateway_bench.bench_sides("stub-vllm") == gateway_bench.bench_sides("stock-vllm")
    assert gateway_bench.report_name("stub-vllm") == "gateway_bench_stub_vllm"
    assert gateway_bench.cpu_owners("stub-vllm") == gateway_bench.cpu_owners("stock-vllm")
    assert gateway_bench.report_name("model") == "gateway_bench"
    assert gateway_bench.cpu_owners("stock-vllm") == {
        "engine": "gateway",
        "floor": "floor",
        "work": "work",
        "gateway": "gateway",
        "http": "gateway",
        "smg": "smg",
        "smg-tenant": "smg-tenant",
    }
    assert gateway_bench.cpu_owners("model")["floor"] == "floor"
    assert gateway_bench.cpu_owners("model")["http"] == "gateway"


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.proc = type("P", (), {"pid": pid})()


class FakeStack:
    admin_key = "adm"
    stopped = False

    def __init__(self) -> None:
        self.procs = {"bench-gateway": FakeProc(101), "floor": FakeProc(202)}

    def stop(self) -> None:
        FakeStack.stopped = True


def test_main_starts_the_stack_measures_saves_and_stops(
    monkeypatch: pytest.MonkeyPatch, fake_results: dict[str, Any]
) -> None:
    seen: dict[str, Any] = {}
    addresses = {"gateway": "127.0.0.1:1", "gateway_metrics": "u"}

    def start_stack(log_dir: Path, *rest: Any) -> tuple[FakeStack, dict[str, str]]:
        seen["stack"] = rest
        return FakeStack(), addresses

    async def run_side(side: str, *_: Any) -> list[Any]:
        seen.setdefault("warmed", []).append(side)
        return []

    def measure(
        args: Any,
        addr: Any,
        key: str,
        ids: list[int],
        pids: dict[str, int],
        sides: list[str],
        proxies: dict[str, int],
    ) -> Any:
        seen["measure"] = (args.rounds, key, ids, pids)
        seen["sides"] = sides
        return fake_results

    monkeypatch.setattr(
        gateway_bench,
        "TextTokenizer",
        lambda _d: type("T", (), {"encode": staticmethod(lambda text: [7, 8, 9])})(),
    )
    monkeypatch.setattr(gateway_bench, "start_stack", start_stack)
    monkeypatch.setattr(gateway_bench, "make_key", lambda addr, admin, limited: f"sk-{limited}")
    monkeypatch.setattr(gateway_bench, "run_side", run_side)
    monkeypatch.setattr(gateway_bench, "measure", measure)
    monkeypatch.setattr(
        gateway_bench, "save_report", lambda name, report, draw: seen.update(report=report)
    )
    gateway_bench.main(["--engine", "stub", "--rounds", "1", "--unlimited-tenant"])
    assert seen["stack"][:2] == ("float32", "stub")
    assert seen["warmed"] == SIDES
    pids = {s: 202 if s == "floor" else 101 for s in SIDES}
    assert seen["measure"] == (1, "sk-False", [7, 8, 9], pids)
    assert seen["sides"] == SIDES
    assert seen["report"]["prompt_tokens"] == 3
    assert seen["report"]["results"] is fake_results
    assert FakeStack.stopped


@pytest.mark.parametrize(
    ("flags", "stub", "report"),
    [
        (["--engine", "stock-vllm"], None, "gateway_bench_stock_vllm"),
        (
            ["--engine", "stub-vllm", "--stub-first-token-ms", "100", "--stub-token-gap-ms", "20"],
            StubTiming(100.0, 20.0),
            "gateway_bench_stub_vllm",
        ),
    ],
)
def test_main_over_a_vllm_engine_measures_its_sides_and_closes_them(
    monkeypatch: pytest.MonkeyPatch,
    fake_results: dict[str, Any],
    flags: list[str],
    stub: StubTiming | None,
    report: str,
) -> None:
    """stock-vllm starts the stock server, stub-vllm the stub engine at the flags' pace;
    both measure the same seven sides and keep a report of their own."""
    seen: dict[str, Any] = {}
    addresses = {"gateway": "127.0.0.1:1", "gateway_metrics": "u", "smg": "http://x"}
    proxies = {"gateway": 11, "smg": 22, "floor": 33, "work": 44, "smg-tenant": 55}

    @contextlib.contextmanager
    def stock_stack(log_dir: Path, *rest: Any) -> Iterator[StockRun]:
        seen["stack"] = rest
        yield StockRun(FakeStack(), addresses, proxies, {"engine_dtype": "bfloat16"})  # type: ignore[arg-type]
        seen["closed"] = True

    async def run_side(side: str, *_: Any) -> list[Any]:
        seen.setdefault("warmed", []).append(side)
        return []

    def measure(*args: Any) -> Any:
        seen["measure"] = args[2:]
        return fake_results

    def save_report(name: str, report: dict[str, Any], draw: Any) -> None:
        seen.update(name=name, report=report)

    monkeypatch.setattr(
        gateway_bench,
        "TextTokenizer",
        lambda _d: type("T", (), {"encode": staticmethod(lambda text: [7, 8])})(),
    )
    monkeypatch.setattr(gateway_bench, "stock_stack", stock_stack)
    monkeypatch.setattr(gateway_bench, "make_key", lambda addr, admin, limited: f"sk-{admin}")
    monkeypatch.setattr(gateway_bench, "run_side", run_side)
    monkeypatch.setattr(gateway_bench, "measure", measure)
    monkeypatch.setattr(gateway_bench, "save_report", save_report)
    gateway_bench.main([*flags, "--rounds", "1", "--pairs", "0"])
    dtype = "bfloat16" if stub is None else "float32"  # the stub computes nothing
    assert seen["stack"] == (dtype, None, 1, None, stub, True)  # the tenant limited
    assert seen["warmed"] == STOCK_SIDES
    pids = {"engine": 11, "floor": 33, "work": 44, "gateway": 11, "http": 11, "smg": 22}
    pids["smg-tenant"] = 55
    assert seen["measure"] == ("sk-adm", [7, 8], pids, STOCK_SIDES, proxies)
    assert seen["name"] == report
    assert seen["report"]["engine"] == flags[1]
    held = seen["report"]["stub_first_token_ms"], seen["report"]["stub_token_gap_ms"]
    assert held == ((None, None) if stub is None else (100.0, 20.0))
    assert seen["closed"]
