#!/usr/bin/env bash
# The project into the venv of an engine that pins its own dependencies (vLLM):
# the project without its dependencies (the engine's pins stay), then
# what the engine service and the tests need beside the engine, with the gRPC add-ons
# matched to the grpcio the engine brought (and the tracing API the services import;
# the OpenTelemetry SDK and exporter load only once an OTLP endpoint is set).
#
#   bash scripts/project_into_venv.sh .cache/peers/vllm
set -euo pipefail
venv=${1:?usage: project_into_venv.sh VENV}
cd "$(dirname "$0")/.."
"$venv/bin/pip" install -q --no-deps -e .
grpc=$("$venv/bin/python" -c 'import grpc; print(".".join(grpc.__version__.split(".")[:2]))')
"$venv/bin/pip" install -q "grpcio-health-checking==$grpc.*" "grpcio-reflection==$grpc.*" \
  "structlog>=24.1" "pytest>=8,<10" "pytest-timeout>=2.3,<3" "pytest-asyncio>=0.24,<2" \
  "hypothesis>=6.100,<7" "opentelemetry-api>=1.20,<2"
