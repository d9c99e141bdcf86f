#!/usr/bin/env bash
# The GPU check for a machine with an NVIDIA GPU that can install TensorRT-LLM: the
# stock `trtllm-serve <model> --grpc` behind our gateway. Never run on the CPU-only
# machines this project is developed on (no GPU, and no TensorRT-LLM wheel for them).
# Exit 0 when every step passed, 1 when one failed or was skipped for a missing
# prerequisite, 2 when no GPU is visible (the report says so; nothing else runs).
# Everything finishes inside GPU_CHECK_SECONDS (default 450: under 8 minutes); with
# a cold pip cache the TensorRT-LLM download (gigabytes) may take most of that, and
# SKIP_INSTALL=1 reuses the venv a previous run built.
#
#   bash deploy/gpu-check.sh        # writes bench/reports/gpu-check.json
#
# What TensorRT-LLM needs, in order (its real wheels are on NVIDIA's index and only
# for CPython 3.10 and 3.12; PyPI holds stub sdists that cannot build here):
# 1. mpi        an MPI library (libmpi.so; apt's libopenmpi-dev when missing and root)
# 2. python     python3.12 (PYTHON312), a venv in .cache/gpu/trtllm
# 3. torch      the CUDA 13 torch (TORCH_SPEC, from download.pytorch.org/whl/cu130)
# 4. trtllm     TRTLLM_SPEC (default tensorrt-llm) from https://pypi.nvidia.com with
#               the cu130 index beside it, then smg-grpc-proto==0.4.28 (--no-deps):
#               the TrtllmService stubs its --grpc mode imports
# 5. project    the project's own venv (.venv; `make setup` when absent) for the
#               gateway, tokenizer and tests, and the model (`make model`)
# 6. fp8        the ModelOpt FP8 export of the model (deploy/quantize_fp8.py)
# 7. options    trtllm-serve's LLM-API options rendered from the stack's config
#               (deploy/trtllm_options.py: FP8 KV cache, chunked prefill, tp x pp = 1)
# 8. serve      trtllm-serve <fp8 dir> --grpc on a loopback port, up when it listens
# 9. gateway    tests/integration/deploy/test_gateway_over_trtllm_serve.py: our
#               gateway reaching it as trtllm://, streaming, greedy repeatability,
#               exact max_tokens, a cancel returning its lease, GetServerInfo's tp x pp
# shellcheck disable=SC2329  # the functions below run through step (deploy/gpu-check-lib.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
NAME="gpu-check"
DEADLINE_S=${GPU_CHECK_SECONDS:-450}
REPORT=${GPU_CHECK_REPORT:-bench/reports/gpu-check.json}
GPU=.cache/gpu
LOGS=${GPU_CHECK_LOGS:-$GPU/logs}
mkdir -p "$LOGS"
# shellcheck source=deploy/gpu-check-lib.sh
. deploy/gpu-check-lib.sh

gpu_or_exit

TRTLLM_SPEC=${TRTLLM_SPEC:-tensorrt-llm}
TORCH_SPEC=${TORCH_SPEC:-torch}
CU130=https://download.pytorch.org/whl/cu130
PYTHON312=${PYTHON312:-$(command -v python3.12 || true)}
TRT=$GPU/trtllm/bin/python
PY=.venv/bin/python
MODEL=.cache/models/SmolLM2-135M-Instruct
FP8=.cache/models/SmolLM2-135M-Instruct-FP8
OPTIONS=$GPU/trtllm-options.yaml
fact trtllm_spec "$TRTLLM_SPEC"
fact torch_spec "$TORCH_SPEC (cu130)"
export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1

have_mpi() { ldconfig -p 2>/dev/null | grep -q 'libmpi\.so'; }
install_mpi() {
  have_mpi && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q --no-install-recommends libopenmpi-dev openmpi-bin
  else
    echo "no libmpi.so and no way to install it (apt-get as root): install Open MPI first"
    return 1
  fi
}
trtllm_venv() {
  { test -x "$TRT" || "$PYTHON312" -m venv "$GPU/trtllm"; } &&
    "$TRT" -m pip install -q --upgrade pip &&
    "$TRT" -m pip install -q --index-url "$CU130" "$TORCH_SPEC" &&
    "$TRT" -m pip install -q --extra-index-url https://pypi.nvidia.com \
      --extra-index-url "$CU130" "$TRTLLM_SPEC" &&
    "$TRT" -m pip install -q --no-deps smg-grpc-proto==0.4.28 &&
    "$TRT" -c 'import tensorrt_llm, torch, sys
print("tensorrt_llm", tensorrt_llm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)
sys.exit(0 if torch.cuda.is_available() and str(torch.version.cuda).startswith("13") else 1)'
}
project() {
  { test -x "$PY" || make setup; } && make model
}
render_options() {
  env LLM_ENGINE_CORE_KV_CACHE_DTYPE=fp8 LLM_ENGINE_CORE_KV_CACHE_MEMORY_FRACTION=0.5 \
    LLM_ENGINE_CORE_TENSOR_PARALLEL_SIZE=1 LLM_ENGINE_CORE_PIPELINE_PARALLEL_SIZE=1 \
    "$PY" -m deploy.trtllm_options --out "$OPTIONS" --expect-gpus 1 && cat "$OPTIONS"
}
SERVE_PID=""
PORT=""
start_serve() {  # trtllm-serve --grpc in the background, in a session of its own
  PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # the arguments deploy/trtllm_options.serve_args renders (deploy/k8s-trtllm runs the same)
  local args
  mapfile -t args < <("$PY" -c 'import sys
from deploy.trtllm_options import serve_args
print("\n".join(serve_args(sys.argv[1], int(sys.argv[2]), sys.argv[3], "127.0.0.1")))' \
    "$ROOT/$FP8" "$PORT" "$ROOT/$OPTIONS")
  setsid "$GPU/trtllm/bin/trtllm-serve" "${args[@]}" >"$LOGS/trtllm-serve.log" 2>&1 &
  SERVE_PID=$!
  echo "trtllm-serve pid $SERVE_PID on 127.0.0.1:$PORT: ${args[*]}"
}
listening() {  # ok once trtllm-serve listens (it opens the port after loading the model)
  until "$PY" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$PORT" 2>/dev/null; do
    kill -0 "$SERVE_PID" 2>/dev/null || { echo "trtllm-serve exited:"; tail -n 40 "$LOGS/trtllm-serve.log"; return 1; }
    sleep 2
  done
  echo "listening on 127.0.0.1:$PORT"
}
stop_serve() {
  [ -n "$SERVE_PID" ] || return 0
  kill -TERM -- "-$SERVE_PID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVE_PID" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$SERVE_PID" 2>/dev/null
}
trap stop_serve EXIT

ok=1
if [ -n "${SKIP_INSTALL:-}" ] && [ -x "$TRT" ]; then
  skip mpi "SKIP_INSTALL: the venv of a previous run"
  skip trtllm "SKIP_INSTALL: the venv of a previous run"
else
  step mpi 120 install_mpi || ok=0
  if [ -z "$PYTHON312" ]; then
    skip trtllm "no python3.12 (TensorRT-LLM's real wheels are for CPython 3.10 and 3.12 only; set PYTHON312)"
    ok=0
  elif [ "$ok" = 1 ]; then
    step trtllm 330 trtllm_venv || ok=0
  else
    skip trtllm "no MPI library (see the mpi step)"
  fi
fi
[ -x "$TRT" ] && fact trtllm "$(tail -n 1 "$LOGS/trtllm.log" 2>/dev/null)"
step project 240 project || ok=0

if [ "$ok" = 1 ]; then
  step fp8 120 "$TRT" deploy/quantize_fp8.py --model "$MODEL" --out "$FP8" --calib-size 64 &&
    step options 30 render_options &&
    start_serve &&
    step serve 240 listening &&
    step gateway 180 env LLM_STOCK_TRTLLM_ADDRESS="127.0.0.1:$PORT" \
      LLM_STOCK_TRTLLM_OPTIONS="$ROOT/$OPTIONS" LLM_REQUIRE_STOCK_TRTLLM=1 \
      "$PY" -m pytest -q -p no:cacheprovider tests/integration/deploy/test_gateway_over_trtllm_serve.py
else
  skip fp8 "TensorRT-LLM or the project is not installed (see above)"
fi
stop_serve
SERVE_PID=""
# a prerequisite that could not be met is a failed check, not a pass
[ "$ok" = 1 ] || failed=1
finish "$failed"
