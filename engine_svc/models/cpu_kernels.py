"""CPU kernels of the native engine, compiled once on the machine that runs them.

``csrc/`` holds torch operators (``torch.ops.llm_cpu.*``: RMSNorm,
add+RMSNorm, SiLU-and-mul, RoPE with the KV-cache write, paged decode and
prefill attention, the skinny, FP8, AMX, 4-bit and 8-bit GEMMs, argmax, the whole
decode step), one source per op family (``csrc/ops.h`` lists them) and their
registration alone in ``csrc/cpu_ops.cpp``. They build into one library with
the system C++ compiler and ``-march=native`` (less what the tier cap,
``cpu_tier``, takes away) against the installed torch,
cached under ``<cache>/kernels/<hash of every source, flags, torch and CPU>/``. They
run on torch's own OpenMP pool through ``at::parallel_for`` and link torch's
bundled libgomp, so there is one thread pool, never two.

No compiler, a failed build or ``LLM_ENGINE_CPU_KERNELS=0`` makes
``ops_available()`` False and the engine runs its pure-torch path, which
computes the same thing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import cache
from pathlib import Path

import torch

from common.config import cache_dir
from engine_svc.models import cpu_tier

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
C_FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    # reductions (dot products, sums) vectorize only when they may be reassociated
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-pthread",
]
_build_lock = threading.Lock()


def cpu_signature() -> str:
    """CPU model and ISA flags: a kernel built with -march=native is only valid there."""
    model, flags = platform.processor(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    return f"{platform.machine()} {model} {flags}"


def find_compiler() -> str | None:
    """The C++ compiler the kernels build with: ``$CXX``, else g++ or c++ on PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compile(cmd: list[str], lib: Path) -> Path:
    """Run ``cmd`` (which writes ``{out}``) into a temp file, then publish it atomically."""
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        tmp_lib = Path(tmp) / lib.name
        proc = subprocess.run(
            [str(tmp_lib) if c == "{out}" else c for c in cmd],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compile failed: {proc.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # concurrent builders never see half a file
    return lib


def ops_sources() -> list[Path]:
    """Every C++ source of the library (``csrc/*.cpp``), in a fixed order."""
    return sorted(CSRC.glob("*.cpp"))


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
    return h.hexdigest()[:16]


def _ops_command(compiler: str) -> list[str]:
    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    return [
        *_ops_compile_command(compiler),
        "-o",
        "{out}",
        *[f"-L{p}" for p in lib_dirs],
        *[f"-Wl,-rpath,{p}" for p in lib_dirs],
        # torch's own libgomp (same soname): the ops share torch's OpenMP pool
        "-lc10",
        "-ltorch_cpu",
        "-lgomp",
    ]


def _ops_compile_command(compiler: str, march: str = "native") -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [f"-march={march}" if f == "-march=native" else f for f in C_FLAGS]
    if march == "native":  # the tier cap (engine_core.cpu_isa) takes instruction sets away
        flags += cpu_tier.compile_flags(cpu_tier.native_tier(), cpu_tier.requested_cap())
    return [
        compiler,
        *flags,
        "-std=c++17",
        "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *includes,
        f"-I{CSRC}",
        *_unity_sources(),
    ]


def _unity_sources() -> list[str]:
    """The sources as one translation unit: every op family's file is ``-include``d into
    the registration file (``cpu_ops.cpp``), so torch's headers are parsed once. A
    build per file parses them once per file: about 3x the time of a first start."""
    main = CSRC / "cpu_ops.cpp"
    families = [f for f in ops_sources() if f != main]
    return [*(arg for f in families for arg in ("-include", str(f))), str(main)]


def syntax_check_command(compiler: str, march: str) -> list[str]:
    """The kernels' compile command for another CPU (``-march=march``), checking syntax only.

    Each ISA tier (AVX2; AVX-512; AVX-512 with BF16; with AMX) compiles different
    ``#if`` branches, and a machine builds only its own: this lets one machine check
    that the source still compiles for the others.
    """
    return [*_ops_compile_command(compiler, march), "-fsyntax-only"]


def build_ops_library() -> Path:
    """Compile the ``csrc/`` sources into one library against the installed torch (cached
    under a key of every source and header, by name and content, so an edit to any
    of them builds anew).

    Raises:
        RuntimeError: no C++ compiler, or the build failed.
    """
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    cmd = _ops_command(compiler)
    files = [f for f in sorted(CSRC.iterdir()) if f.suffix in (".cpp", ".h")]
    sources = [part for f in files for part in (f.name, f.read_bytes())]
    key = _digest(*sources, " ".join(cmd), torch.__version__, cpu_signature())
    lib = cache_dir() / "kernels" / f"cpu_ops-{key}" / "libllm_cpu_ops.so"
    if not lib.is_file():
        logger.info("compiling CPU kernels (once per machine, ~30 s): %s", lib)
    return _compile(cmd, lib)


_loaded_tier = [""]  # the tier the loaded library was built for


@cache
def _load_ops() -> bool:
    if os.environ.get("LLM_ENGINE_CPU_KERNELS", "1") == "0" or sys.platform != "linux":
        return False
    cap = cpu_tier.requested_cap()
    try:
        with _build_lock:
            torch.ops.load_library(str(build_ops_library()))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using the pure-torch path: %s", exc)
        return False
    _loaded_tier[0] = cpu_tier.capped(cpu_tier.native_tier(), cap)
    return True


def kernel_tier() -> str:
    """The CPU tier the kernels were built for (``cpu_tier``), loading them if not yet;
    empty when they are unavailable. A process loads them once: a later cap does not
    change it."""
    return _loaded_tier[0] if ops_available() else ""


def ops_available() -> bool:
    """True when ``torch.ops.llm_cpu`` is built and loaded."""
    return _load_ops()
