"""The in-venv sides of bench.peers: our engine offline or over gRPC, and transformers.

    python -m bench.peerlib.ours_worker SIDE WORKLOADS.json OUT.json [--dtype auto]

SIDE is ``ours`` (LLMEngine in this process), ``ours-grpc`` (``python -m
engine_svc`` with the stack's default engine config as a subprocess, every
request of a workload a concurrent stream) or ``transformers`` (``generate()``,
static left-padded batches of up to 32). Each runs in its own process so one
side's threads, caches and allocator state never touch another's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

Request = tuple[list[int], int]


def run_ours(workloads: dict[str, Any], dtype: str, model_dir: str, device: str) -> dict[str, Any]:
    from engine_svc.core import EngineConfig, LLMEngine, SamplingParams
    from engine_svc.core.guided import GuidedSpec

    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype=dtype,
            device=device,
            kv_cache_memory_bytes=2 << 30,
            enable_prefix_caching=False,  # every prompt is computed, like the peers
        )
    )
    load_s = time.perf_counter() - t0
    n = 0

    def run(reqs: list[Request], schema: str = "") -> tuple[float, int]:
        nonlocal n
        guided = GuidedSpec("json_schema", schema) if schema else None
        start = time.perf_counter()
        for prompt, olen in reqs:
            n += 1
            params = SamplingParams(max_tokens=olen, ignore_eos=True, guided=guided)
            engine.add_request(f"p{n}", prompt, params)
        generated = 0
        while engine.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in engine.step())
        return time.perf_counter() - start, generated

    run([([1, 2, 3, 4, 5, 6, 7, 8], 8)])
    results = {}
    for name, wl in workloads.items():
        wall, generated = run(wl["requests"], wl.get("json_schema", ""))
        results[name] = {"wall_s": wall, "generated": generated}
    return {"load_s": load_s, "compute": engine.compute_description, "results": results}


async def _grpc_workload(
    address: str, reqs: list[Request], tag: str, schema: str = ""
) -> tuple[float, int]:
    import grpc

    from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    guided = common_pb2.GuidedDecoding(json_schema=schema) if schema else None

    generated = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)

        async def one(i: int, prompt: list[int], olen: int) -> None:
            nonlocal generated
            req = engine_pb2.EngineGenerateRequest(
                request_id=f"{tag}-{i}-{time.time_ns()}",
                prompt_token_ids=prompt,
                sampling=engine_pb2.EngineSamplingParams(
                    max_tokens=olen, ignore_eos=True, guided=guided
                ),
            )
            async for chunk in stub.Generate(req):
                generated += len(chunk.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs)))
        return time.perf_counter() - start, generated


def run_ours_grpc(workloads: dict[str, Any], dtype: str, device: str) -> dict[str, Any]:
    from bench.loadlib.spawn import Stack

    env = {"LLM_ENGINE_CORE_ENABLE_PREFIX_CACHING": "false", "LLM_ENGINE_CORE_DEVICE": device}
    if dtype != "auto":
        env["LLM_ENGINE_CORE_DTYPE"] = dtype
    services = Stack.alone(Path(tempfile.mkdtemp(prefix="peers-")))
    args = ["--metrics-port", "-1", "--log-level", "warning"]
    t0 = time.perf_counter()
    server = services.service("peer-engine", "engine_svc", args, env, 300)
    load_s = time.perf_counter() - t0
    try:
        asyncio.run(_grpc_workload(server.address, [([1, 2, 3, 4, 5, 6, 7, 8], 8)], "warm"))
        results = {}
        for name, wl in workloads.items():
            wall, generated = asyncio.run(
                _grpc_workload(server.address, wl["requests"], name, wl.get("json_schema", ""))
            )
            results[name] = {"wall_s": wall, "generated": generated}
    finally:
        services.stop()
    return {"load_s": load_s, "results": results}


def run_transformers(
    workloads: dict[str, Any], dtype: str, model_dir: str, device: str
) -> dict[str, Any]:
    from bench.engine_bench import HF

    torch_dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    t0 = time.perf_counter()
    hf = HF(Path(model_dir), torch_dtype, device)
    load_s = time.perf_counter() - t0
    hf.run([([1, 2, 3, 4, 5, 6, 7, 8], 8)])
    results = {}
    for name, wl in workloads.items():
        if "json_schema" in wl:
            continue  # generate() has no constrained decoding: no figure, not a wrong one
        wall, generated = hf.run([(p, n) for p, n in wl["requests"]])
        results[name] = {"wall_s": wall, "generated": generated}
    return {"load_s": load_s, "results": results}


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory of this process and of its (waited-for) children, MiB."""
    return {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["ours", "ours-grpc", "transformers"])
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    workloads = json.loads(Path(args.workloads).read_text())
    if args.side == "ours":
        out = run_ours(workloads, args.dtype, args.model_dir, args.device)
    elif args.side == "ours-grpc":
        out = run_ours_grpc(workloads, args.dtype, args.device)
    else:
        out = run_transformers(workloads, args.dtype, args.model_dir, args.device)
    out["peak_rss_mib"] = peak_rss_mib()
    Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
