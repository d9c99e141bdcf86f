"""OpenTelemetry's GenAI semantic conventions: the metric instruments, by their names,
units and advisory bucket boundaries, and the attribute names spans and metrics share.

A server of model requests (the gateway, for its API clients) records
``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token`` and
``gen_ai.server.time_per_output_token``; a client of a model server (the gateway again,
for the engines it calls) records ``gen_ai.client.token.usage``. Instruments exist only
while OTLP metrics are on (``common.tracing.meter()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics

OPERATION = "gen_ai.operation.name"  # chat | text_completion
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
TOKEN_TYPE = "gen_ai.token.type"  # input | output
ERROR_TYPE = "error.type"

# advisory bucket boundaries the conventions give each instrument
_DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKENS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 67108864


@dataclass(frozen=True, slots=True)
class GenAiMetrics:
    """The GenAI instruments of one meter."""

    request_duration: metrics.Histogram
    time_to_first_token: metrics.Histogram
    time_per_output_token: metrics.Histogram
    token_usage: metrics.Histogram

    @classmethod
    def of(cls, meter: metrics.Meter) -> GenAiMetrics:
        return cls(
            *(
                meter.create_histogram(
                    name, unit=unit, description=doc, explicit_bucket_boundaries_advisory=list(b)
                )
                for name, unit, doc, b in _INSTRUMENTS
            )
        )


# name, unit, description, advisory buckets: in GenAiMetrics' field order
_INSTRUMENTS = (
    (
        "gen_ai.server.request.duration",
        "s",
        "Request arrival to the end of its response",
        _DURATION,
    ),
    ("gen_ai.server.time_to_first_token", "s", "Request arrival to the first output token", _TTFT),
    (
        "gen_ai.server.time_per_output_token",
        "s",
        "First token to the last, per output token after the first",
        _TPOT,
    ),
    (
        "gen_ai.client.token.usage",
        "{token}",
        "Prompt (input) and generated (output) tokens of a request",
        _TOKENS,
    ),
)


# the last meter and its instruments: held by reference, since an id() of a meter
# that was collected can be reused by the next one (whose records would then go to
# the old, shut-down provider's instruments)
_cache: list[tuple[metrics.Meter, GenAiMetrics]] = []


def instruments(meter: metrics.Meter | None) -> GenAiMetrics | None:
    """The GenAI instruments of ``meter`` (made once per meter); None without one."""
    if meter is None:
        return None
    if _cache and _cache[0][0] is meter:
        return _cache[0][1]
    got = GenAiMetrics.of(meter)
    _cache[:] = [(meter, got)]  # a new meter provider replaced the old one
    return got
