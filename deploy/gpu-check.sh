#!/usr/bin/env bash
# The GPU check: one prepared script for a machine with an NVIDIA GPU and access to
# the package registries. Sized for one H200: about 8 minutes once the pip cache is
# warm (the first install of TensorRT-LLM and vLLM adds their download). It has never
# run on the CPU-only machines this project is developed on; where no GPU is visible
# it says so and exits 2.
#
#   bash deploy/gpu-check.sh                 # from anywhere; SKIP_INSTALL=1 reuses venvs
#
# 1. install   the project's venv (make setup: on Linux x86_64 the registry's
#              torch==2.13.0 is its CUDA build); TensorRT-LLM in .cache/gpu/trtllm and
#              vLLM's CUDA build in .cache/gpu/vllm (each pins its own torch), this
#              project beside each (scripts/project_into_venv.sh)
# 2. model     SmolLM2-135M-Instruct as a Hugging Face directory (make model) and its FP8
#              checkpoint (deploy/quantize_fp8.py, NVIDIA Model Optimizer)
# 3. contract  the backend contract suite with the native engine on CUDA and with
#              TensorRT-LLM on the bf16 and the FP8 checkpoint; the engine gRPC suite
#              with the native engine on CUDA
# 4. peers     bench.peers W1-W3 on the GPU: ours offline, ours over gRPC served by
#              TensorRT-LLM, vLLM bf16, transformers bf16
# 5. report    bench/reports/gpu-check.json (each step: status, seconds, log) beside the
#              peers report bench/reports/gpu-peers.{json,png}
#
# Versions: TRTLLM_SPEC (default tensorrt-llm, from NVIDIA's index) and VLLM_SPEC
# (default vllm==0.32.0, the version the CPU peer benchmark pins).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi missing or failing); nothing to do" >&2
  exit 2
fi
nvidia-smi -L

TRTLLM_SPEC=${TRTLLM_SPEC:-tensorrt-llm}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.32.0}
GPU=.cache/gpu
LOGS=$GPU/logs
mkdir -p "$LOGS" bench/reports
PY=.venv/bin/python
TRT=$GPU/trtllm/bin/python
VLLM=$GPU/vllm/bin/python
MODEL=.cache/models/SmolLM2-135M-Instruct
FP8=.cache/models/SmolLM2-135M-Instruct-FP8
PYTEST=(-m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning
        -W ignore::FutureWarning -W ignore::UserWarning)
export PYTHONPATH=$ROOT
STEPS=()  # "name status seconds log" per step
failed=0

# step NAME CMD...: run CMD with its output in $LOGS/NAME.log, record how it went
step() {
  local name=$1; shift
  local log=$LOGS/$name.log t0 rc
  t0=$(date +%s)
  echo "== $name ($(date +%T))"
  "$@" >"$log" 2>&1
  rc=$?
  local s=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then echo "   ok in ${s}s"; else
    echo "   FAILED (exit $rc) in ${s}s; last lines of $log:"; tail -n 15 "$log"; failed=1; fi
  STEPS+=("$name $rc $s $log")
}

venv_with() {  # venv_with DIR PIP-ARGS...: a venv holding what PIP-ARGS install + the project
  local dir=$1; shift
  { test -x "$dir/bin/python" || python3 -m venv "$dir"; } &&
    "$dir/bin/pip" install -q --upgrade pip &&
    "$dir/bin/pip" install -q "$@" &&
    bash scripts/project_into_venv.sh "$dir"
}

cuda_torch() {
  $PY -c 'import torch, sys; print("torch", torch.__version__, torch.version.cuda);
sys.exit(0 if torch.cuda.is_available() else 1)'
}

if [ -z "${SKIP_INSTALL:-}" ]; then
  step install-project make setup
  step install-trtllm venv_with "$GPU/trtllm" --extra-index-url https://pypi.nvidia.com \
    "$TRTLLM_SPEC" "nvidia-modelopt[torch]" matplotlib tqdm
  step install-vllm venv_with "$GPU/vllm" "$VLLM_SPEC"
fi
step cuda-torch cuda_torch

step model make model
step model-fp8 "$TRT" deploy/quantize_fp8.py --model "$MODEL" --out "$FP8" --calib-size 64

step contract-native env LLM_TEST_ENGINE_DEVICE=cuda \
  $PY "${PYTEST[@]}" tests/unit/engine_svc/backends/test_backend_contract.py -k native
step grpc-native env LLM_TEST_ENGINE_DEVICE=cuda \
  $PY "${PYTEST[@]}" tests/integration/engine/test_engine_service.py -k native
step contract-trtllm-bf16 "$TRT" "${PYTEST[@]}" tests/unit/engine_svc/backends/test_backend_contract.py \
  tests/unit/engine_svc/backends/test_trtllm_adapter.py -k "trtllm and not fake"
step contract-trtllm-fp8 env LLM_TEST_TRTLLM_MODEL_DIR="$ROOT/$FP8" \
  "$TRT" "${PYTEST[@]}" tests/unit/engine_svc/backends/test_backend_contract.py -k "trtllm and not fake"

# our sides in TensorRT-LLM's venv, so the gRPC side can serve with it
step peers "$TRT" -m bench.peers --device cuda --workloads W1,W2,W3 \
  --sides ours,ours-grpc,vllm-bf16,transformers-bf16 --grpc-backend trtllm \
  --vllm-python "$VLLM" --out gpu-peers

{
  echo "{\"gpu\": \"$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)\","
  echo " \"trtllm_spec\": \"$TRTLLM_SPEC\", \"vllm_spec\": \"$VLLM_SPEC\", \"steps\": ["
  sep=""
  for s in "${STEPS[@]}"; do
    read -r name rc secs log <<<"$s"
    printf '%s  {"step": "%s", "exit": %s, "seconds": %s, "log": "%s"}' \
      "$sep" "$name" "$rc" "$secs" "$log"
    sep=$',\n'
  done
  echo "]}"
} >bench/reports/gpu-check.json
echo "report: bench/reports/gpu-check.json (peers: bench/reports/gpu-peers.json, .png)"
exit $failed
