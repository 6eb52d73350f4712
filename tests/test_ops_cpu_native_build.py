"""Building the native CPU kernels survives a build that was killed (ops/cpu_native/build.py).

torch's own build folder is guarded by a lock file that a killed build leaves behind; every later
process then waited on it forever (a CI run stopped mid-build hung the next one). Oracle: the
processes themselves, in a fresh TORCH_EXTENSIONS_DIR: a build killed with SIGKILL partway, then
two processes starting together, which must both finish within a time limit and compute what the
pure-torch reference computes, leaving one library and no private build folders.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.cpu_native import build

ROOT = Path(__file__).resolve().parents[1]
LOAD_AND_CHECK = """
import torch
from ops.cpu_native import build, reference
lib = build.native_ops()
assert lib is not None, "the native library did not load"
x = torch.randn(3, 200)
got, want = lib.quantize_q8(x), reference.quantize_q8(x)
assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
print("loaded", build.library_path(build.isa()))
"""


def _start(env, code):
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not build.has_avx2(), reason="needs an x86-64 CPU with AVX2")
def test_a_killed_build_neither_blocks_nor_poisons_the_next(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    killed = _start(env, LOAD_AND_CHECK)
    deadline = time.monotonic() + 120
    # kill it once the compiler is running: torch's lock file sits in its private build folder
    while not list(tmp_path.glob("torch_runner_native_*/build-*/lock")):
        assert killed.poll() is None, killed.communicate()
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(killed.pid, signal.SIGKILL)  # the interpreter and its ninja / compiler children
    killed.wait()
    assert not list(tmp_path.glob("*/native.so"))  # killed before it finished
    assert list(tmp_path.glob("*/build-*/lock"))  # what used to hang every later process

    both = [_start(env, LOAD_AND_CHECK) for _ in range(2)]  # one builds, the other waits
    outs = [p.communicate(timeout=400) for p in both]
    for p, (out, err) in zip(both, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.startswith("loaded"), out
    libs = list(tmp_path.glob("*/native.so"))
    assert len(libs) == 1 and f"loaded {libs[0]}" in outs[0][0]
    assert not list(tmp_path.glob("*/build-*"))  # the killed build's folder was cleared
