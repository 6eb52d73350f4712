"""Building and loading the native kernels (the .cpp files below and their headers), and whether to use them.

Why built on first use: `torch.utils.cpp_extension.load` compiles the C++ files with ninja
into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) the first time (seconds), later
processes load the cached library. The kernels need AVX2 + FMA (x86-64); torch's own CPU
capability probe says whether this CPU has them. Where /proc/cpuinfo also lists AVX-512 BW / VL /
DQ / VNNI / BF16, linear512.h's and attention.h's AVX-512 parts are built in (vpdpbusd,
vdpbf16ps), as a library of its own name (TORCH_RUNNER_CPU_ISA=avx2 keeps the AVX2 build).
TORCH_RUNNER_CPU_KERNELS=torch keeps every CPU linear on torch's kernels (oneDNN / MKL /
`_weight_int*pack_mm`), the behaviour before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNEL_MODES = ("native", "torch")
KERNELS_ENV = "TORCH_RUNNER_CPU_KERNELS"
SOURCES = [
    Path(__file__).with_name(n)
    for n in ("linear_kernels.cpp", "pointwise_kernels.cpp", "decode_step.cpp")
]
HEADERS = [
    Path(__file__).with_name(n)
    for n in ("simd.h", "linear.h", "linear512.h", "pointwise.h", "attention.h")
]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for's threads
# linear512.h's kernels: AVX-512 BW / VL / DQ with VNNI (vpdpbusd) and BF16 (vdpbf16ps)
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
AVX512_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                 "-mavx512bf16", "-DTR_AVX512=1"]  # fmt: skip
ISAS = ("auto", "avx512", "avx2")
ISA_ENV = "TORCH_RUNNER_CPU_ISA"


def _headers_flag() -> str:
    """A define holding the headers' hash: torch rebuilds when a source or a flag changes, and
    it hashes only the sources, so an edited header changes this flag instead."""
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in HEADERS)).hexdigest()[:16]
    return f"-DTR_NATIVE_HEADERS={digest}"


def kernel_mode() -> str:
    """TORCH_RUNNER_CPU_KERNELS (default native), validated."""
    mode = os.environ.get(KERNELS_ENV, "native")
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"{KERNELS_ENV}={mode!r} is invalid; allowed values: {', '.join(KERNEL_MODES)}"
        )
    return mode


def has_avx2() -> bool:
    """True on an x86-64 CPU whose torch capability is AVX2 or better (AVX2 implies FMA there)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa() -> str:
    """Which kernels to build: "avx512" where the CPU has every AVX512_CPU_FLAGS flag, else "avx2".
    TORCH_RUNNER_CPU_ISA=avx2 forces the AVX2 kernels (for comparison); =avx512 on a CPU without
    those flags is an error, not a crash later."""
    want = os.environ.get(ISA_ENV, "auto")
    if want not in ISAS:
        raise ValueError(f"{ISA_ENV}={want!r} is invalid; allowed values: {', '.join(ISAS)}")
    flags = cpu_flags()
    missing = [f for f in AVX512_CPU_FLAGS if f not in flags]
    if want == "avx512" and missing:
        raise ValueError(f"{ISA_ENV}=avx512 but this CPU lacks {', '.join(missing)}")
    return "avx512" if not missing and want != "avx2" else "avx2"


def wants_native(device) -> bool:
    """True when CPU linears on `device` should take the native weight formats (ops/cpu_native)."""
    return torch.device(device).type == "cpu" and kernel_mode() == "native" and has_avx2()


@functools.cache
def native_ops():
    """torch.ops.torch_runner_native once the library is built and loaded, else None (said once:
    the weights then run the pure-torch reference of the same math, ops/cpu_native/reference.py)."""
    if not has_avx2():
        logger.warning("cpu_native: this CPU has no AVX2+FMA; linears run the torch reference")
        return None
    try:
        from torch.utils.cpp_extension import load

        kernels = isa()
        load(
            name=f"torch_runner_native_{kernels}",
            sources=[str(p) for p in SOURCES],
            extra_cflags=[
                *CFLAGS,
                *(AVX512_CFLAGS if kernels == "avx512" else []),
                _headers_flag(),
            ],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError, SystemExit) as exc:  # no compiler / ninja
        logger.warning(
            "cpu_native: building %s failed (%s); linears run the torch reference of the same "
            "math (slower, same results)",
            ", ".join(p.name for p in SOURCES),
            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
        )
        return None
    from ops.cpu_native import fake

    fake.register()  # fake impls: the compiled step traces them

    return torch.ops.torch_runner_native
