"""bench.peers: every side gets the same workloads, and ratios use each peer's best dtype."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from bench.peers import (
    best_of,
    figure,
    main,
    make_workloads,
    peak_rss,
    plot,
    ratios,
    side_command,
    structured_cost,
    summarize,
)


def test_workloads_are_the_issue_shapes_and_the_same_every_time() -> None:
    wl = make_workloads()
    assert wl == make_workloads()  # fixed seed: every side and round sees the same tokens
    assert [len(r) for r in (wl["W1"]["requests"], wl["W2"]["requests"])] == [32, 32]
    assert all(len(p) == 32 and n == 128 for p, n in wl["W1"]["requests"])
    assert all(64 <= len(p) <= 512 and n == 128 for p, n in wl["W2"]["requests"])
    assert [(len(p), n) for p, n in wl["W3"]["requests"]] == [(32, 128)]
    assert [len(p) for p, _ in wl["W4-2048"]["requests"]] == [2048]
    assert all(n == 1 for _, n in wl["W4-512"]["requests"])


def _run(w1_wall: float, w4_wall: float) -> dict[str, object]:
    return {
        "results": {
            "W1": {"wall_s": w1_wall, "generated": 4096},
            "W4-512": {"wall_s": w4_wall, "generated": 1},
        },
        "peak_rss_mib": {"self": 300.0, "children": 900.0},
    }


def test_the_json_workload_is_w1_under_a_schema_no_request_can_finish_early() -> None:
    import json

    import jsonschema  # type: ignore[import-untyped]

    wl = make_workloads()
    assert wl["W1-json"]["requests"] == wl["W1"]["requests"]
    schema = json.loads(wl["W1-json"]["json_schema"])
    short = {"items": ["abcd"] * 63}
    with pytest.raises(jsonschema.ValidationError):  # 63 items: not yet complete
        jsonschema.validate(short, schema)
    jsonschema.validate({"items": ["abcd"] * 64}, schema)
    # 64 strings of >= 4 characters are far more than W1's 128 tokens
    assert len(json.dumps({"items": ["abcd"] * 64})) > 4 * 128


def test_structured_cost_per_side_and_a_side_without_the_workload() -> None:
    wl = {k: v for k, v in make_workloads().items() if k in ("W1", "W1-json")}
    both = {
        "results": {
            "W1": {"wall_s": 4.0, "generated": 4096},
            "W1-json": {"wall_s": 5.0, "generated": 4096},
        }
    }
    plain_only = {"results": {"W1": {"wall_s": 8.0, "generated": 4096}}}
    table = summarize(wl, {"ours": [both], "transformers-bf16": [plain_only]})  # type: ignore[arg-type]
    assert set(table["transformers-bf16"]) == {"W1"}  # no figure rather than a wrong one
    cost = structured_cost(table)
    assert cost == {"ours": pytest.approx(0.2)}


def test_medians_ratios_and_best_dtype() -> None:
    wl = {k: v for k, v in make_workloads().items() if k in ("W1", "W4-512")}
    runs = {
        "ours": [_run(4.0, 0.25), _run(8.0, 0.5), _run(5.0, 0.3)],
        "vllm-bf16": [_run(8.192, 0.5)],
        "vllm-fp32": [_run(16.384, 1.0)],
    }
    table = summarize(wl, runs)  # type: ignore[arg-type]
    assert table["ours"]["W1"] == pytest.approx(4096 / 5.0)  # the median round
    assert table["ours"]["W4-512"] == pytest.approx(512 / 0.3)  # prompt tokens for W4
    assert figure("W1", wl["W1"], {"wall_s": 2.0, "generated": 10}) == 5.0
    assert best_of(table, "vllm") == "vllm-bf16"
    assert best_of(table, "transformers") is None
    r = ratios(table)
    assert set(r) == {"ours / vllm-bf16"}
    assert r["ours / vllm-bf16"]["W1"] == pytest.approx((4096 / 5.0) / 500.0)
    assert peak_rss(runs)["ours"] == 900.0  # type: ignore[arg-type]


def test_a_run_without_w1_picks_the_best_dtype_by_its_first_workload() -> None:
    table = {"vllm-bf16": {"W2": 90.0, "W3": 10.0}, "vllm-fp32": {"W2": 60.0, "W3": 30.0}}
    assert best_of(table, "vllm") == "vllm-bf16"
    assert best_of(table, "transformers") is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "W1,W9"], "unknown workload"),
        # vLLM is its own side; the engine service has the native backend only
        (["--grpc-backend", "vllm"], "unrecognized arguments: --grpc-backend"),
    ],
    ids=["unknown-workload", "no-grpc-backend"],
)
def test_bad_arguments_are_refused_before_any_side_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--sides", "ours", *argv])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_each_side_runs_its_own_worker_with_the_run_s_dtype_and_device() -> None:
    args = argparse.Namespace(vllm_python=Path("/v/bin/python"), model_dir="/m", device="cuda")
    wl, out = Path("/t/wl.json"), Path("/t/out.json")
    grpc = side_command("ours-grpc-fp32", wl, out, args)
    assert grpc[:4] == [sys.executable, "-m", "bench.peerlib.ours_worker", "ours-grpc"]
    opts = dict(zip(grpc[6::2], grpc[7::2], strict=True))
    assert opts == {"--dtype": "float32", "--model-dir": "/m", "--device": "cuda"}
    vllm = side_command("vllm-bf16", wl, out, args)
    assert vllm[0] == "/v/bin/python"
    assert vllm[1].endswith("bench/peerlib/vllm_worker.py")
    assert vllm[vllm.index("--dtype") + 1] == "bfloat16"


def test_noise_fall_is_quiet_over_noisy_and_a_noisy_run_is_never_a_best_dtype() -> None:
    from bench.peerlib.noise import falls

    table = {
        "ours-grpc": {"W2": 200.0, "W3": 90.0},
        "ours-grpc+noise": {"W2": 50.0, "W3": 45.0},
        "vllm-bf16": {"W2": 300.0},
        "vllm-bf16+noise": {"W2": 150.0, "W3": 20.0},
        "vllm-fp32": {"W2": 100.0},
    }
    assert falls(table, "+noise") == {
        "ours-grpc": {"W2": 4.0, "W3": 2.0},
        "vllm-bf16": {"W2": 2.0},  # no quiet W3: no fall for it
    }
    table["vllm-fp32+noise"] = {"W2": 900.0}  # a noisy figure above every quiet one
    assert best_of(table, "vllm") == "vllm-bf16"


def test_the_burner_takes_a_core_and_is_stopped_by_its_pid() -> None:
    import os
    import time

    from bench.peerlib.noise import burner, last_cpu

    with burner(last_cpu()) as facts:
        pid = next(
            int(p) for p in os.listdir("/proc") if p.isdigit() and _is_burner(int(p), os.getpid())
        )
        assert os.sched_getaffinity(pid) == {last_cpu()}
        time.sleep(0.5)
    assert facts["cpu_s"] > 0  # it ran (a busy machine may give it less than a whole core)
    assert facts["pin"] == last_cpu()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def _is_burner(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return int(stat[1]) == parent and b"while True" in cmd


def test_the_chart_leaves_out_a_side_that_failed(tmp_path: Path) -> None:
    facts = {"isa": {"avx2": True}, "cpu": "test CPU", "cores": 2}
    failed = {"W1": 0.0, "W2": 0.0}
    plot({"ours-grpc": failed}, facts, tmp_path / "none.png")  # log scale of nothing
    assert not (tmp_path / "none.png").exists()
    plot({"ours-grpc": failed, "vllm-bf16": {"W1": 500.0, "W2": 250.0}}, facts, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
