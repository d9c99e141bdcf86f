"""``gateway.metrics.child``: the cached series is the metric's own, so what is counted
through it is what the metric exports."""

from __future__ import annotations

from prometheus_client import REGISTRY

from gateway import metrics


def test_a_cached_child_is_the_metrics_own_series() -> None:
    labels = {"tenant": "t-child", "code": "OK", "model": "m-child", "version": "v1"}
    before = REGISTRY.get_sample_value("gateway_requests_total", labels) or 0.0
    first = metrics.child(metrics.REQUESTS, "t-child", "OK", "m-child", "v1")
    first.inc()
    again = metrics.child(metrics.REQUESTS, "t-child", "OK", "m-child", "v1")
    again.inc(2)
    assert again is first
    assert first is metrics.REQUESTS.labels("t-child", "OK", "m-child", "v1")
    assert REGISTRY.get_sample_value("gateway_requests_total", labels) == before + 3
    # the same label values of another metric are another series
    other = metrics.child(metrics.E2E, "m-child", "v1")
    assert other is metrics.E2E.labels("m-child", "v1")
