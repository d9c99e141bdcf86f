"""TensorRT-LLM's stock server, ``trtllm-serve <model> --grpc``, configured from the
stack's config: its LLM-API options file (the YAML ``--extra_llm_api_options``
reads, keys of TensorRT-LLM's ``LlmArgs``) and its command line.

The stack runs TensorRT-LLM as NVIDIA ships it (the gateway reaches it as
``trtllm://host:port``, protocol ``trtllm.TrtllmService``); nothing of ours runs
inside it. What the ``engine_core`` section says becomes:

    tensor_parallel_size, pipeline_parallel_size -> the same keys (GPUs = their product)
    scheduler.max_num_seqs                       -> max_batch_size (in-flight batch)
    scheduler.max_num_batched_tokens             -> max_num_tokens (tokens per iteration)
    max_model_len (0 = the model's)              -> max_seq_len
    kv_cache_memory_fraction                     -> kv_cache_config.free_gpu_memory_fraction
    enable_prefix_caching                        -> kv_cache_config.enable_block_reuse
    kv_cache_dtype (fp8 | auto)                  -> kv_cache_config.dtype
    always                                       -> enable_chunked_prefill: true,
                                                    scheduler_config.capacity_scheduler_policy:
                                                    GUARANTEED_NO_EVICT

In-flight batching is how TensorRT-LLM's executor always schedules; there is no
switch for it. FP8 weights come from the checkpoint itself (a ModelOpt FP8
export, deploy/quantize_fp8.py): TensorRT-LLM reads its quantization config.

    python -m deploy.trtllm_options [--config config/stack.yaml] --out options.yaml
    python -m deploy.trtllm_options --print-gpus     # tp x pp: the pod's GPU request
    python -m deploy.trtllm_options --out F --expect-gpus 2   # exit 2 unless tp x pp = 2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from common.config import load_config
from engine_svc.core.config import EngineConfig

KV_DTYPES = {"fp8": "fp8", "auto": "auto"}  # engine_core.kv_cache_dtype -> TensorRT-LLM's
OPTIONS_PATH = "/run/trtllm/options.yaml"  # where the pods and compose mount the file


def gpus(core: EngineConfig) -> int:
    """GPUs one trtllm-serve spans: tensor x pipeline parallel (the pod's GPU request)."""
    return core.tensor_parallel_size * core.pipeline_parallel_size


def render_options(core: EngineConfig) -> dict[str, Any]:
    """The LLM-API options for ``core``.

    Raises:
        ValueError: a value TensorRT-LLM cannot take, naming the ``engine_core`` key.
    """
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(core, key) < 1:
            raise ValueError(f"[engine_core] {key} must be >= 1, got {getattr(core, key)}")
    if core.kv_cache_dtype not in KV_DTYPES:
        raise ValueError(
            f"[engine_core] kv_cache_dtype {core.kv_cache_dtype!r}: trtllm-serve takes "
            f"{sorted(KV_DTYPES)} (its KV cache is in the model's dtype unless fp8)"
        )
    if not 0 < core.kv_cache_memory_fraction <= 1:
        raise ValueError(
            "[engine_core] kv_cache_memory_fraction must be in (0, 1], got "
            f"{core.kv_cache_memory_fraction}"
        )
    options: dict[str, Any] = {
        "tensor_parallel_size": core.tensor_parallel_size,
        "pipeline_parallel_size": core.pipeline_parallel_size,
        "max_batch_size": core.scheduler.max_num_seqs,
        "max_num_tokens": core.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "kv_cache_config": {
            "dtype": KV_DTYPES[core.kv_cache_dtype],
            "free_gpu_memory_fraction": core.kv_cache_memory_fraction,
            "enable_block_reuse": core.enable_prefix_caching,
        },
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
    }
    if core.max_model_len:
        options["max_seq_len"] = core.max_model_len
    return options


def serve_args(
    model_dir: str, port: int, options_path: str = OPTIONS_PATH, host: str = "0.0.0.0"
) -> list[str]:
    """``trtllm-serve``'s arguments (after the program name): the gRPC server on
    ``host:port`` with the PyTorch backend, the options file last (its values win
    over the command line's)."""
    return [
        model_dir,
        "--grpc",
        "--backend",
        "pytorch",
        "--host",
        host,
        "--port",
        str(port),
        "--extra_llm_api_options",
        options_path,
    ]


def load_core(config: Path | None) -> EngineConfig:
    """The ``engine_core`` section of a stack config file (``LLM_*`` env applies)."""
    return load_config(EngineConfig, "engine_core", path=config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--config", type=Path, help="stack config (default: LLM_CONFIG or the repo's)")
    ap.add_argument("--out", type=Path, help="write the options YAML here (default: stdout)")
    ap.add_argument("--print-gpus", action="store_true", help="print tp x pp and exit")
    ap.add_argument(
        "--expect-gpus",
        type=int,
        help="the GPUs the container reserves: refuse to render unless tp x pp equals it",
    )
    args = ap.parse_args(argv)
    try:
        core = load_core(args.config)
        if args.print_gpus:
            print(gpus(core))
            return 0
        if args.expect_gpus is not None and args.expect_gpus != gpus(core):
            raise ValueError(
                f"{args.expect_gpus} GPU(s) reserved but tensor_parallel_size x "
                f"pipeline_parallel_size = {core.tensor_parallel_size} x "
                f"{core.pipeline_parallel_size} = {gpus(core)}"
            )
        text = yaml.safe_dump(render_options(core), sort_keys=True)
    except ValueError as e:
        print(f"trtllm_options: {e}")
        return 2
    if args.out is None:
        print(text, end="")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"trtllm_options: wrote {args.out} ({gpus(core)} GPU(s): tp x pp)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
