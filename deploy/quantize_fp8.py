"""FP8 checkpoint for the TensorRT-LLM engine: NVIDIA Model Optimizer's post-training
quantization of a Hugging Face checkpoint (e4m3 weights and activation scales,
calibrated on a few hundred prompts), exported as a Hugging Face directory that
TensorRT-LLM loads with its FP8 GEMMs (``engine_core.model_dir`` points at it).

Needs an NVIDIA GPU with FP8 (compute capability >= 8.9) and
``pip install nvidia-modelopt[torch] transformers``; it has never run on the
CPU-only machines this project is developed on.

    python deploy/quantize_fp8.py --model .cache/models/SmolLM2-135M-Instruct \\
        --out /models/SmolLM2-135M-Instruct-FP8 [--calib-prompts prompts.txt]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "Explain how a paged KV cache works.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "Summarize the rules of chess in three sentences.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="where the FP8 checkpoint is written")
    ap.add_argument("--calib-prompts", help="a text file, one calibration prompt per line")
    ap.add_argument("--calib-size", type=int, default=256)
    args = ap.parse_args()

    import modelopt.torch.quantization as mtq  # type: ignore[import-not-found]
    import torch
    from modelopt.torch.export import export_hf_checkpoint  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    has_gpu = bool(torch.cuda.device_count())
    if not has_gpu or tuple(torch.cuda.get_device_capability(0)) < (8, 9):
        raise SystemExit("quantize_fp8: needs an NVIDIA GPU with FP8 (compute capability >= 8.9)")
    prompts = (
        Path(args.calib_prompts).read_text().splitlines() if args.calib_prompts else DEFAULT_PROMPTS
    )
    prompts = [p for p in prompts if p.strip()][: args.calib_size]
    tok = AutoTokenizer.from_pretrained(args.model)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model = model.to("cuda")

    def calibrate(m: torch.nn.Module) -> None:
        for text in prompts:
            ids = tok(text, return_tensors="pt").input_ids.cuda()
            m(ids)

    with torch.no_grad():
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=calibrate)
        export_hf_checkpoint(model, export_dir=args.out)
    tok.save_pretrained(args.out)
    print(f"FP8 checkpoint written to {args.out}")


if __name__ == "__main__":
    main()
