"""Which native kernels get built (ops/cpu_native/build.py's ISA choice), and the AVX2 kernels on
a CPU that would build the AVX-512 ones: the kernel tests of test_ops_cpu_native.py run again in
a subprocess with TORCH_RUNNER_CPU_ISA=avx2, against the same oracles (reference math, fp64)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cpu_native import build

ROOT = Path(__file__).resolve().parents[1]


def test_isa_env_is_validated(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="allowed values: auto, avx512, avx2"):
        build.isa()
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="lacks avx512bw, avx512vl, avx512dq, avx512_vnni"):
        build.isa()
    monkeypatch.setenv(build.ISA_ENV, "auto")
    assert build.isa() == "avx2"
    monkeypatch.setattr(build, "cpu_flags", lambda: set(build.AVX512_CPU_FLAGS))
    assert build.isa() == "avx512"
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.isa() == "avx2"


@pytest.mark.slow
@pytest.mark.skipif(
    not build.has_avx2() or not set(build.AVX512_CPU_FLAGS) <= build.cpu_flags(),
    reason="the AVX2 kernels are the default build here (test_ops_cpu_native.py tests them)",
)
def test_avx2_kernels_on_an_avx512_cpu(tmp_path):
    env = {**os.environ, build.ISA_ENV: "avx2", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_ops_cpu_native.py"), "-k", "gemv or q8 or fused or attention"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
    built = (tmp_path / "ext").glob("torch_runner_native_avx2_*/native.so")
    assert list(built)  # the AVX2 build ran
