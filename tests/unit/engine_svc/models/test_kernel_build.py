"""The CPU kernels build here, and their source compiles for every CPU tier we serve on.

The engine falls back to pure torch when its kernels do not build, which keeps it
serving but several times slower, and the kernel tests then skip themselves. These
tests make a broken build fail the suite instead: on this machine (a real build and
load), and for the ISA tiers this machine is not (a syntax-only compile per
``-march``, since each tier compiles different ``#if`` branches).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from engine_svc.models import cpu_kernels

COMPILER = cpu_kernels.find_compiler()
needs_compiler = pytest.mark.skipif(
    COMPILER is None or sys.platform != "linux",
    reason="the CPU kernels build only on Linux with a C++ compiler",
)
# One -march per branch set of the #ifs: AVX2 only; AVX-512 without BF16 (Ice Lake);
# AVX-512 with BF16 but no AMX (Cooper Lake); AVX-512 BF16 with AMX (Sapphire Rapids).
ISA_TIERS = ["haswell", "icelake-server", "cooperlake", "sapphirerapids"]


@needs_compiler
@pytest.mark.skipif(
    os.environ.get("LLM_ENGINE_CPU_KERNELS", "1") == "0", reason="kernels turned off"
)
def test_kernels_build_and_load_on_this_machine() -> None:
    library = cpu_kernels.build_ops_library()  # raises with the compiler's error
    assert library.is_file()
    assert cpu_kernels.ops_available(), "the kernels built but the engine could not load them"
    assert hasattr(torch.ops.llm_cpu, "rms_norm")


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA tiers are x86-64 ones")
def test_kernel_source_compiles_for_every_isa_tier() -> None:
    assert COMPILER is not None
    procs = {
        march: subprocess.Popen(
            cpu_kernels.syntax_check_command(COMPILER, march),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for march in ISA_TIERS
    }
    failures, unknown = {}, []
    for march, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode == 0:
            continue
        if "bad value" in err and "-march" in err:
            unknown.append(march)  # an older compiler that does not know this CPU
        else:
            errors = [line for line in err.splitlines() if "error" in line]
            failures[march] = "\n".join(errors[:10]) or err[-2000:]
    assert not failures, f"the kernel source does not compile for: {failures}"
    if unknown:
        pytest.skip(f"{COMPILER} does not know -march={', '.join(unknown)}")
