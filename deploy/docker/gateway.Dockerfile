# syntax=docker/dockerfile:1.7
# Gateway (llm.v1.Gateway + llm.v1.RateLimitAdmin). Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t llm-stack/gateway .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY common common
COPY ratelimit ratelimit
COPY tokenizer_svc tokenizer_svc
COPY gateway gateway
COPY llm_client llm_client
COPY deploy/__init__.py deploy/healthcheck.py deploy/
COPY config config
RUN pip install grpcio-tools mypy-protobuf googleapis-common-protos \
    && python scripts/gen_protos.py \
    && pip install -c constraints.txt . \
    && pip uninstall -y grpcio-tools mypy-protobuf

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin llm
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 \
    LLM_CONFIG=/app/config/stack.yaml \
    LLM_GATEWAY_HOST=0.0.0.0 LLM_GATEWAY_PORT=50051 LLM_GATEWAY_METRICS_PORT=9451 \
    LLM_GATEWAY_HTTP_PORT=8000
USER 10001:10001
EXPOSE 50051 9451 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-m", "deploy.healthcheck", "127.0.0.1:50051", "llm.v1.Gateway"]
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--log-format", "json"]
