"""Reading an in-memory OpenTelemetry metric reader in tests."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Metric name -> its data points, of what ``reader`` holds now (empty: nothing)."""
    data = reader.get_metrics_data()
    if data is None:
        return {}
    return {
        m.name: list(m.data.data_points)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
