#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, run the native engine on CUDA
# through the engine tests (unit + gRPC integration), and, if tensorrt_llm is
# installed, the TensorRT-LLM backend's tests too. Never run on the CPU-only
# development and CI machines; see README "What was never run here".
#
#   bash deploy/gpu-check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi missing or failing); nothing to do" >&2
  exit 2
fi
nvidia-smi -L

make setup
PY=.venv/bin/python
# The project pins the CPU wheel of torch; a GPU machine needs a CUDA build of the
# same version in the venv (pip install torch==2.13.0 --index-url <your CUDA index>).
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: torch in .venv has no CUDA support; install a CUDA build of torch==2.13.0" >&2
  exit 3
fi
$PY -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

export PYTHONPATH=$PWD LLM_TEST_ENGINE_DEVICE=cuda
status=0
echo "== native backend on CUDA: engine core + engine gRPC service =="
$PY -m pytest -q -p no:cacheprovider tests/unit/engine tests/integration/engine || status=1

if $PY -c 'import tensorrt_llm' >/dev/null 2>&1; then
  echo "== TensorRT-LLM backend =="
  $PY -m pytest -q -p no:cacheprovider -m trtllm tests/unit/engine_svc || status=1
else
  echo "== TensorRT-LLM not installed: trtllm backend skipped (pip install tensorrt-llm) =="
fi
exit $status
