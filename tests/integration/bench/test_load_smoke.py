"""Seconds-long smoke runs of bench/load.py (run, sweep, fairness) and the capacity template.

They assert the structure of the reports and behaviour (bounds, breakdowns,
rejected requests never reaching the engine), never timings: the machines are
shared and slow.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import capacity, load
from common.procs import ManagedProcess
from common.redis_server import RedisServer

pytestmark = pytest.mark.integration

SMALL = [
    "--mix",
    "short_chat",
    "--max-prompt-tokens",
    "24",
    "--max-output-tokens",
    "3",
    "--no-progress",
    "--drain-timeout",
    "30",
]
ADMIN_KEY = "sk-llm-" + secrets.token_urlsafe(24)


def report(out: Path, name: str) -> dict[str, Any]:
    assert (out / f"load_{name}.png").stat().st_size > 5_000
    data: dict[str, Any] = json.loads((out / f"load_{name}.json").read_text())
    return data


@pytest.fixture(scope="module")
def gateway(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ManagedProcess]:
    redis = RedisServer().start()
    proc = ManagedProcess(
        name="bench-gateway",
        module="gateway",
        log_dir=tmp_path_factory.mktemp("bench-gw"),
        args=[
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--engines",
            engine_server.address,
            "--tokenizer",
            tokenizer_server.address,
            "--redis-url",
            redis.url,
            "--log-format",
            "json",
        ],
        env={"ADMIN_KEY": ADMIN_KEY, "LLM_GATEWAY_STATS_INTERVAL_S": "0.2"},
    )
    try:
        yield proc.start(timeout=90)
    finally:
        proc.stop()
        redis.close()


def test_run_against_engine_reports_every_section(
    engine_server: ManagedProcess, tmp_path: Path
) -> None:
    load.main(
        [
            "run",
            "--target",
            "engine",
            "--address",
            engine_server.address,
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--duration",
            "30",
            "--tenant",
            "name=gold,priority=CRITICAL,share=1",
            "--tenant",
            "name=free,priority=LOW,share=1",
            "--slo-ttft-ms",
            "600000",
            "--out-dir",
            str(tmp_path),
            "--name",
            "eng",
            *SMALL,
        ]
    )
    r = report(tmp_path, "eng")
    o = r["overall"]
    assert (o["num_requests"], o["num_ok"], o["errors_by_status"]) == (6, 6, {})
    assert o["total_output_tokens"] == 18  # ignore_eos: exactly max_tokens each
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert o[metric]["p50"] <= o[metric]["p95"] <= o[metric]["p99"] <= o[metric]["max"]
    assert o["goodput_req_s"] > 0
    assert set(r["per_tenant"]) == {"gold", "free"}
    assert set(r["per_priority"]) == {"CRITICAL", "LOW"}
    eng = r["engine"]
    assert eng["num_samples"] >= 2
    assert eng["num_engine_requests"] == 6
    assert {"t", "num_waiting", "kv_cache_usage"} <= set(eng["series"][0])
    m = r["machine"]  # what the figures depend on: CPU, its ISA flags, cores, load
    assert m["cores"] >= 1
    assert "avx512_bf16" in m["isa"]
    assert len(m["loadavg_before"]) == len(m["loadavg_at_save"]) == 3


def test_sweep_names_the_knee(engine_server: ManagedProcess, tmp_path: Path) -> None:
    common = [
        "--target",
        "engine",
        "--address",
        engine_server.address,
        "--duration",
        "1.5",
        "--num-requests",
        "3",
        "--rates",
        "2,4",
        "--refine",
        "0",
        "--out-dir",
        str(tmp_path),
        *SMALL,
    ]
    load.main(["sweep", *common, "--name", "easy", "--ttft-p95-target-ms", "600000"])
    easy = report(tmp_path, "easy")
    assert [p["offered"] for p in easy["points"]] == [2.0, 4.0]
    assert (easy["sustainable_rate"], easy["first_failing_rate"]) == (4.0, None)
    load.main(["sweep", *common, "--name", "hard", "--ttft-p95-target-ms", "0.001"])
    hard = report(tmp_path, "hard")
    assert len(hard["points"]) == 1  # the first step already fails: rising stops
    assert (hard["sustainable_rate"], hard["first_failing_rate"]) == (None, 2.0)


def test_fairness_through_the_gateway(
    gateway: ManagedProcess, engine_server: ManagedProcess, tmp_path: Path
) -> None:
    load.main(
        [
            "fairness",
            "--address",
            gateway.address,
            "--admin-key",
            ADMIN_KEY,
            "--engine-stats",
            engine_server.address,
            "--experiments",
            "a,c",
            "--phase-duration",
            "2",
            "--chat-rate",
            "2",
            "--flood-concurrency",
            "1",
            "--limited-rate",
            "10",
            "--limited-rpm",
            "1",
            "--out-dir",
            str(tmp_path),
            "--name",
            "fair",
            *SMALL,
        ]
    )
    r = report(tmp_path, "fair")
    a, c = r["experiments"]
    assert a["id"] == "a"
    assert a["idle_ms"] > 0
    assert a["loaded_ms"] > 0
    assert isinstance(a["holds"], bool)
    assert set(a["loaded"]["per_tenant"]) == {"chat", "flood"}
    tl = a["loaded_timeline"]  # per-tenant TTFT and service share over time, plotted
    assert set(tl["ttft_ms"]) == {"chat", "flood"}
    for i in range(len(tl["bins"])):
        total = sum(shares[i] for shares in tl["share"].values())
        assert total == pytest.approx(1.0) or total == 0.0
    assert (tmp_path / "load_fair_a_timeline.png").stat().st_size > 0
    assert c["num_rejected"] > 0
    assert c["num_admitted"] >= 1  # burst 1: the first request of the phase fits
    # rejected requests never reach an engine: it saw exactly the admitted ones
    assert c["engine_requests_seen"] == c["num_admitted"]
    assert c["no_engine_work_for_rejected"] is True


def test_capacity_measures_a_real_engine(model_dir: Path, tmp_path: Path) -> None:
    assert (
        capacity.main(
            [
                "--model-dir",
                str(model_dir),
                "--out",
                str(tmp_path),
                "--measure",
                "--measure-blocks",
                "2",
                "--measure-contexts",
                "16",
                "--measure-concurrency",
                "1",
                "--measure-max-seqs",
                "4",
                "--contexts",
                "256,1024",
                "--weight-dtype",
                "fp32",
            ]
        )
        == 0
    )
    rep = json.loads((tmp_path / "capacity.json").read_text())
    m = rep["measured"]
    assert m["kv_cache_bytes"] == 2 * 16 * 46080  # fp32 KV on CPU
    one, over = m["points"]
    assert one["num_requests"] == 1
    assert one["peak_blocks_used"] == one["predicted_peak_blocks"] == 1
    assert over["num_requests"] == 4  # 2 // 1 fit + 2
    assert over["peak_blocks_used"] <= 2
    assert 2 <= over["max_num_running"] <= 4
    assert (tmp_path / "capacity.png").stat().st_size > 10_000


def test_python_m_bench_capacity(tmp_path: Path, model_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.capacity",
            "--model-dir",
            str(model_dir),
            "--out",
            str(tmp_path),
            "--kv-dtype",
            "bf16,fp8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV B/token" in proc.stdout
    assert [
        b["kv_dtype"] for b in json.loads((tmp_path / "capacity.json").read_text())["budgets"]
    ] == ["bf16", "fp8"]
