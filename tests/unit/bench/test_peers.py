"""bench.peers: every side gets the same workloads, and ratios use each peer's best dtype."""

from __future__ import annotations

import pytest

from bench.peers import best_of, figure, main, make_workloads, peak_rss, ratios, summarize


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


def test_an_unknown_workload_is_refused_before_any_side_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--sides", "ours", "--workloads", "W1,W9"])
    assert err.value.code == 2
    assert "unknown workload" in capsys.readouterr().err
