# syntax=docker/dockerfile:1.7
# Envoy at the edge: the official image plus the container variant of
# deploy/envoy/envoy.yaml (rendered here, never kept as a second copy) and
# the descriptor set for the gRPC-JSON transcoder. Build from the repository root:
#   docker build -f deploy/docker/envoy.Dockerfile -t llm-stack/envoy .
# The public listener is TLS only. No certificate is baked in: mount tls.crt and
# tls.key (PEM) at /etc/envoy/tls, readable by uid 101 (Kubernetes: the
# kubernetes.io/tls Secret llm-edge-tls; compose: the directory $TLS_DIR).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ENVOY_IMAGE=envoyproxy/envoy:v1.40.0

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN pip install grpcio-tools mypy-protobuf googleapis-common-protos "pyyaml>=6,<7"
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY deploy/__init__.py deploy/
# the renderer and launcher import these (standard library and PyYAML, installed above)
COPY common/__init__.py common/addresses.py common/config.py common/pgroup.py common/
COPY deploy/envoy deploy/envoy
RUN python scripts/gen_protos.py \
    && python -m deploy.envoy.config --preset container -o /out/envoy.yaml \
    && cp build/llm_v1.pb /out/llm_v1.pb

FROM ${ENVOY_IMAGE}
COPY --from=build /out/envoy.yaml /out/llm_v1.pb /etc/envoy/
# 101 is the image's own "envoy" user
USER 101:101
# 8080 public, TLS: gRPC, OpenAI HTTP, HTTP/JSON admin API; 9902 /stats/prometheus
# and /ready (plaintext, for probes and Prometheus inside the cluster).
# The admin interface is a unix socket (0600) inside the container; the health
# check asks the stats listener's /ready, which proxies to it.
EXPOSE 8080 9902
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9902 && printf 'GET /ready HTTP/1.1\\r\\nHost: envoy\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["/usr/local/bin/envoy"]
CMD ["-c", "/etc/envoy/envoy.yaml", "--log-level", "info", "--disable-hot-restart"]
