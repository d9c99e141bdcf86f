#!/usr/bin/env bash
# The GPU check for a machine with an NVIDIA GPU and no package index at all: it
# downloads nothing and installs nothing. It runs our native engine on CUDA with the
# machine's own Python and torch (PYTHON, default python3) on the project's code as
# it lies in this working tree, and reports, for each step, whether it ran, passed,
# failed or was skipped, and why (a Python dependency of ours the machine lacks, no
# model directory, the budget spent). Exit 0 when every step that ran passed, 1 when
# one failed, 2 when no GPU is visible (the report says so; nothing else runs).
# Everything finishes inside GPU_CHECK_SECONDS (default 450: under 8 minutes).
#
#   bash deploy/gpu-check-offline.sh        # writes bench/reports/gpu-check-offline.json
#
# 1. gpu        nvidia-smi lists a GPU (else exit 2)
# 2. torch      the interpreter's torch, its CUDA version, and a CUDA device it can use
# 3. imports    which of the project's modules import here (the engine core, the
#               engine service with its generated llm.v1 stubs, pytest), each missing
#               dependency named in the report; a step whose modules fail is skipped
# 4. smoke      the engine core on CUDA: a tiny random Llama (bf16), greedy decode of
#               a batch, identical outputs twice, decode tokens per second
# 5. contract   the backend contract suite with the native backend on CUDA (pytest)
# 6. grpc       the engine gRPC suite with the native engine on CUDA, when a prepared
#               model directory is here (MODEL_DIR, default .cache/models/SmolLM2-135M-Instruct)
#
# GPU_CHECK_REPORT overrides the report's path.
# shellcheck disable=SC2329  # the functions below run through step (deploy/gpu-check-lib.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
NAME="gpu-check-offline"
DEADLINE_S=${GPU_CHECK_SECONDS:-450}
REPORT=${GPU_CHECK_REPORT:-bench/reports/gpu-check-offline.json}
LOGS=${GPU_CHECK_LOGS:-.cache/gpu-offline/logs}
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-.cache/models/SmolLM2-135M-Instruct}
mkdir -p "$LOGS"
# shellcheck source=deploy/gpu-check-lib.sh
. deploy/gpu-check-lib.sh

gpu_or_exit
fact python "$("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo "none: $PY")"
export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1 PIP_NO_INDEX=1

cuda_torch() {
  "$PY" -c 'import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda)
ok = torch.cuda.is_available()
print("device", torch.cuda.get_device_name(0) if ok else "none")
sys.exit(0 if ok else 1)'
}

# importable MODULE...: 0 when every module imports; the first failure on stdout
importable() {
  "$PY" - "$@" <<'PY'
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # a missing dependency, or a module that fails to load
        print(f"{name}: {type(e).__name__}: {e}")
        sys.exit(1)
PY
}

smoke() {
  "$PY" - <<'PY'
import json, os, tempfile, time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_svc.core import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
       "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
       "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
       "bos_token_id": 0, "eos_token_id": 1}
g = torch.Generator().manual_seed(0)
h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * 64
w = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
     "lm_head.weight": (cfg["vocab_size"], h)}
for n in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{n}."
    w |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
          p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
          p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
          p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
          p + "post_attention_layernorm.weight": (h,)}
tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.05)
           .to(torch.bfloat16).contiguous() for k, s in w.items()}
model = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
(model / "config.json").write_text(json.dumps(cfg))
save_file(tensors, str(model / "model.safetensors"))

def run() -> tuple[list[list[int]], float, int]:
    device = os.environ.get("SMOKE_DEVICE", "cuda")  # cpu: to try the step without a GPU
    engine = LLMEngine(EngineConfig(model_dir=str(model), device=device, dtype="bfloat16",
                                    scheduler=SchedulerConfig(max_num_seqs=32),
                                    tune_linear_paths=False))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for r in range(32):
        engine.add_request(f"r{r}", [5 + r, 17, 42, 8, 23], params)
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    secs = time.perf_counter() - t0
    return [outs[f"r{r}"] for r in range(32)], secs, sum(len(v) for v in outs.values())

first, _, _ = run()
second, secs, tokens = run()
assert first == second, "greedy decode differs between two runs"
assert all(len(o) == 64 for o in first), [len(o) for o in first]
print(json.dumps({"smoke_tokens": tokens, "smoke_seconds": round(secs, 3),
                  "smoke_tok_per_s": round(tokens / secs, 1)}))
PY
}

if step torch 60 cuda_torch; then
  fact torch "$(head -n 1 "$LOGS/torch.log")"
  torch_ok=1
else
  torch_ok=0
fi

declare -A why=()
check_imports() {  # check_imports GROUP MODULE...: records why the group cannot run
  local group=$1 out
  shift
  if out=$(importable "$@" 2>&1); then
    fact "imports_$group" "ok"
  else
    why[$group]=$(echo "$out" | tail -n 1)
    fact "imports_$group" "${why[$group]}"
  fi
}
if [ "$torch_ok" = 1 ]; then
  check_imports core torch safetensors yaml engine_svc.core.llm_engine
  check_imports tests pytest tests.unit.engine_svc.conftest
  check_imports service grpc llm.v1.engine_pb2 engine_svc.service engine_svc.__main__
else
  why[core]="torch cannot use a CUDA device (see the torch step)"
  why[tests]=${why[core]}
  why[service]=${why[core]}
fi

if [ -n "${why[core]:-}" ]; then skip smoke "${why[core]}"; else
  step smoke 150 smoke && fact smoke "$(tail -n 1 "$LOGS/smoke.log")"
fi

PYTEST=(-m pytest -q -p no:cacheprovider -x -W ignore::DeprecationWarning)
if [ -n "${why[core]:-}${why[tests]:-}" ]; then
  skip contract-native "${why[core]:-${why[tests]}}"
else
  step contract-native 200 env LLM_TEST_ENGINE_DEVICE=cuda \
    "$PY" "${PYTEST[@]}" tests/unit/engine_svc/backends/test_backend_contract.py -k native
fi

if [ -n "${why[core]:-}${why[tests]:-}${why[service]:-}" ]; then
  skip grpc-native "${why[core]:-${why[tests]:-${why[service]}}}"
elif [ ! -f "$MODEL_DIR/config.json" ]; then
  skip grpc-native "no prepared model at $MODEL_DIR (make model needs the network; carry it or set MODEL_DIR)"
else
  step grpc-native 200 env LLM_TEST_ENGINE_DEVICE=cuda LLM_MODEL_DIR="$MODEL_DIR" \
    "$PY" "${PYTEST[@]}" tests/integration/engine/test_engine_service.py -k native
fi

finish "$failed"
