"""Building and loading the native kernels (the .cpp files below and their headers), and whether to use them.

Why built on first use: `torch.utils.cpp_extension.load` compiles the C++ files with ninja
into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) the first time (seconds), later
processes load the cached library. The kernels need AVX2 + FMA (x86-64); torch's own CPU
capability probe says whether this CPU has them. Where /proc/cpuinfo also lists AVX-512 BW / VL /
DQ / VNNI / BF16, linear512.h's and attention.h's AVX-512 parts are built in (vpdpbusd,
vdpbf16ps), as a library of its own name (TORCH_RUNNER_CPU_ISA=avx2 keeps the AVX2 build).
TORCH_RUNNER_CPU_KERNELS=torch keeps every CPU linear on torch's kernels (oneDNN / MKL /
`_weight_int*pack_mm`), the behaviour before.

Why not torch's own build folder: torch guards it with a lock *file* that a killed build leaves
behind, and every later process then waits on it forever. Here each build runs in a private
folder under an OS lock (fcntl.flock: released when its holder dies, however it dies); the
finished library is renamed into a folder named by the hash of everything that shapes it, which
later processes load without building or locking.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNEL_MODES = ("native", "torch")
KERNELS_ENV = "TORCH_RUNNER_CPU_KERNELS"
SOURCES = [
    Path(__file__).with_name(f"{n}.cpp")
    for n in (
        "linear_kernels",
        "pointwise_kernels",
        "decode_step",
        "greedy_kernels",
        "head_kernels",
    )
]
HEADERS = [
    Path(__file__).with_name(n)
    for n in ("simd.h", "linear.h", "linear512.h", "pointwise.h", "attention.h", "decode_plan.h")
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
        load_library(isa())
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


def loaded_ops():
    """torch.ops.torch_runner_native when this process has already loaded the library (native
    weights did), else None: for callers that use it only where it is there, never building it."""
    return native_ops() if native_ops.cache_info().currsize else None


def build_flags(kernels: str) -> list[str]:
    """The compiler flags of the `kernels` ("avx512" / "avx2") build."""
    return [*CFLAGS, *(AVX512_CFLAGS if kernels == "avx512" else []), _headers_flag()]


def library_path(kernels: str) -> Path:
    """Where the built library lives: a folder named by the hash of the sources, headers, flags,
    torch and Python versions, under TORCH_EXTENSIONS_DIR (torch's default root otherwise)."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha1()
    for part in [*(p.read_bytes() for p in SOURCES + HEADERS), *map(str.encode, build_flags(kernels)),
                 torch.__version__.encode(), sys.version.encode()]:  # fmt: skip
        digest.update(hashlib.sha1(part).digest())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"torch_runner_native_{kernels}_{digest.hexdigest()[:16]}" / "native.so"


def load_library(kernels: str) -> Path:
    """Load the `kernels` library into this process, building it first if no finished build is
    cached. Builds are serialised by an flock on the cache folder's lock file (a process that
    dies mid-build releases it); each runs in a fresh private folder, and only a finished
    library is renamed into place, so no reader ever sees a partial one."""
    final = library_path(kernels)
    if not final.is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / "build.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits only while a live process builds
            if not final.is_file():
                for stale in final.parent.glob("build-*"):  # left by a build that was killed
                    shutil.rmtree(stale, ignore_errors=True)
                return _build(kernels, final)
    torch.ops.load_library(str(final))
    return final


def _build(kernels: str, final: Path) -> Path:
    """Compile into a private folder (torch's load also loads the library), then publish it."""
    from torch.utils.cpp_extension import load

    private = Path(tempfile.mkdtemp(prefix="build-", dir=final.parent))
    try:
        load(name=f"torch_runner_native_{kernels}", sources=[str(p) for p in SOURCES],
             extra_cflags=build_flags(kernels), extra_ldflags=["-fopenmp"],
             build_directory=str(private), is_python_module=False, verbose=False)  # fmt: skip
        built = next(private.glob("*.so"), None)
        if built is None:
            raise RuntimeError(f"cpu_native: the build in {private} produced no library")
        os.replace(built, final)  # atomic; the loaded mapping stays valid
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return final
