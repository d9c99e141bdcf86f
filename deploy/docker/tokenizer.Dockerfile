# syntax=docker/dockerfile:1.7
# Tokenizer service (llm.v1.Tokenizer). Build from the repository root:
#   docker build -f deploy/docker/tokenizer.Dockerfile -t llm-stack/tokenizer .
# Needs the prepared model at $LLM_MODEL_DIR (a volume; see deploy/compose.yaml).
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
COPY tokenizer_svc tokenizer_svc
COPY deploy/__init__.py deploy/healthcheck.py deploy/
COPY config config
RUN pip install grpcio-tools mypy-protobuf googleapis-common-protos \
    && python scripts/gen_protos.py \
    && pip install -c constraints.txt . \
    && pip uninstall -y grpcio-tools mypy-protobuf

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin llm \
    && mkdir /models && chown 10001:10001 /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 \
    LLM_CONFIG=/app/config/stack.yaml LLM_MODEL_DIR=/models/SmolLM2-135M-Instruct \
    LLM_TOKENIZER_HOST=0.0.0.0 LLM_TOKENIZER_PORT=50061 LLM_TOKENIZER_METRICS_PORT=9461 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
USER 10001:10001
EXPOSE 50061 9461
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-m", "deploy.healthcheck", "127.0.0.1:50061", "llm.v1.Tokenizer"]
ENTRYPOINT ["python", "-m", "tokenizer_svc"]
CMD ["--log-format", "json"]
