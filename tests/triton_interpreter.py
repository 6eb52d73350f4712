"""Run a Triton kernel in Triton's CPU interpreter (TRITON_INTERPRET=1) from a test.

Why the patch: Triton 3.6's interpreter holds a scalar argument as a 1-element numpy array and
turns it into a Python int with `int(array)`, which NumPy 2.4+ refuses for 1-d arrays; so any
loop bounded by a runtime argument (`range(0, K, BLOCK_K)`) failed in the interpreter. The patch
reads the array's one element instead; compiled kernels are untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys


def patch_scalar_index() -> None:
    """Call in the interpreter process before launching a kernel."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "is_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.is_patched = True
    interpreter._patch_lang_tensor = patched


def run_in_interpreter(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`script` in a fresh Python with TRITON_INTERPRET=1, this test folder and sys.path on its
    path, the patch above applied first."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    prelude = "from triton_interpreter import patch_scalar_index\npatch_scalar_index()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + script],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=timeout,
    )  # fmt: skip


def assert_interpreter_ok(script: str, timeout: int = 600) -> None:
    """Run `script` in the interpreter (run_in_interpreter); it must exit 0 and print "ok"."""
    result = run_in_interpreter(script, timeout)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
