"""Optional C kernels for CPU, compiled once with the system C compiler.

The decode attention kernel reads K/V straight through the block table, so
the per-layer gather copy that the SDPA path needs disappears. It is plain C
(no torch headers, compiles in about a second), loaded with ctypes and cached
under ``<cache>/kernels/<source hash>/``. No compiler, a failed build or
``LLM_ENGINE_CPU_KERNELS=0`` leaves ``decode_kernel()`` returning None and the
SDPA path in charge.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from common.config import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
CFLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-std=gnu11",
    "-pthread",
]

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


def _build(source: Path, out_dir: Path) -> Path:
    lib = out_dir / "libpaged_attention.so"
    if lib.is_file():
        return lib
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        subprocess.run(
            [compiler, *CFLAGS, str(source), "-o", str(tmp_lib), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never see half a file
    return lib


@cache
def _load() -> ctypes.CDLL | None:
    if os.environ.get("LLM_ENGINE_CPU_KERNELS", "1") == "0":
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    try:
        lib = ctypes.CDLL(str(_build(SOURCE, cache_dir() / "kernels" / digest)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel unavailable, using SDPA: %s", exc)
        return None
    fn = lib.paged_decode_attention
    fn.argtypes = [_ptr] * 6 + [_i64] * 7 + [_f32, _int]
    fn.restype = None
    return lib


def decode_kernel_available() -> bool:
    """True when the compiled decode kernel can be used."""
    return _load() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_ctx: int,
) -> torch.Tensor:
    """Decode attention over block tables with the C kernel (fp32, CPU).

    Args:
        q: [B, H, D] fp32 queries (made contiguous here).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] fp32, contiguous.
        block_tables: [B, max_blocks] int64, contiguous.
        context_lens: [B] int64 tokens to attend per sequence.
        max_ctx: the largest context length.

    Returns:
        [B, H, D] fp32 attention output.
    """
    lib = _load()
    assert lib is not None
    q = q.contiguous()
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        block_size,
        block_tables.shape[1],
        max_ctx,
        d**-0.5,
        torch.get_num_threads(),
    )
    return out
