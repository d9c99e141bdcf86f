# syntax=docker/dockerfile:1.7
# TensorRT-LLM's stock gRPC server, as NVIDIA ships it. Build from the repository root:
#   docker build -f deploy/docker/trtllm-serve.Dockerfile -t llm-stack/trtllm-serve .
# and run it as `trtllm-serve <model dir> --grpc --backend pytorch --host 0.0.0.0
# --port 50071 --extra_llm_api_options <options.yaml>` (deploy/trtllm_options.py
# renders the options and the arguments; deploy/k8s-trtllm and
# deploy/compose.trtllm.yaml run it). Nothing of ours runs in the server: the
# image is NVIDIA's release image plus the smg-grpc-proto stubs its gRPC mode
# imports (pinned to the version the gateway's TrtllmService client is tested on,
# --no-deps so the image's grpcio and protobuf stay NVIDIA's) and
# deploy/quantize_fp8.py for the pods' FP8 export (ModelOpt comes with the image).
# Not slim and cannot be: the runtime is the CUDA stack.
# The tag: `--grpc` is in trtllm-serve's reference from 1.3.0rc7 on (read there);
# 1.2.x was not checked. Never built here (no container engine, no GPU).
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc7
FROM ${TRTLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-deps smg-grpc-proto==0.4.28 \
    && useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin llm
COPY deploy/quantize_fp8.py /opt/llm/quantize_fp8.py
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 50071
# trtllm-serve --grpc serves no grpc.health.v1: listening on the port = the model is loaded
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 50071), 2)"]
ENTRYPOINT ["trtllm-serve"]
