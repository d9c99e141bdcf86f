# syntax=docker/dockerfile:1.7
# Engine service, TensorRT-LLM backend (NVIDIA GPU, FP8). Build from the repository root:
#   docker build -f deploy/docker/engine-trtllm.Dockerfile -t llm-stack/engine-trtllm .
# The base is NVIDIA's TensorRT-LLM release image (CUDA, torch, tensorrt_llm);
# it is not slim and cannot be: the runtime is the CUDA stack. Our code adds
# only pure-Python dependencies on top, never a second torch. The backend is
# chosen by config (`engine.backend: trtllm`, see deploy/k8s/configmap.yaml).
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.2.0
FROM ${TRTLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY common common
COPY tokenizer_svc tokenizer_svc
COPY engine_svc engine_svc
COPY engine_tools engine_tools
COPY deploy/__init__.py deploy/healthcheck.py deploy/
COPY config config
# the project's base dependencies only (pure Python; torch and the CUDA stack are the
# base image's, never a second copy); the base image's own pins win (no constraints)
RUN pip install grpcio-tools mypy-protobuf googleapis-common-protos \
    && python scripts/gen_protos.py \
    && pip install . \
    && pip uninstall -y grpcio-tools mypy-protobuf \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin llm
ENV PYTHONPATH=/app PYTHONUNBUFFERED=1 \
    LLM_CONFIG=/app/config/stack.yaml LLM_MODEL_DIR=/models/SmolLM2-135M-Instruct \
    LLM_ENGINE_HOST=0.0.0.0 LLM_ENGINE_PORT=50071 LLM_ENGINE_METRICS_PORT=9471 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
USER 10001:10001
EXPOSE 50071 9471
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-m", "deploy.healthcheck", "127.0.0.1:50071", "llm.v1.Engine"]
ENTRYPOINT ["python", "-m", "engine_svc"]
CMD ["--log-format", "json"]
