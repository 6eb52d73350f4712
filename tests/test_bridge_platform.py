"""Platform contracts: lazy mlx import, probed capabilities, MPS rules (faked), the lock, crashes.

Process-killing cases (a negative-stride DLPack export, racing threads) run in subprocesses so
a regression shows up as a failed exit code instead of taking pytest down.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import bridge
from bridge import bridge_state, crossing

mx = pytest.importorskip("mlx.core")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_METAL = bool(torch.backends.mps.is_available() and mx.metal.is_available())
needs_metal = pytest.mark.skipif(not HAS_METAL, reason="needs Apple Metal + torch MPS")


@pytest.fixture(autouse=True)
def _fresh_bridge():
    bridge_state.set_capabilities(None)
    bridge.reset_stats()
    yield
    bridge_state.set_capabilities(None)


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TORCH_RUNNER_USE_MLX": "0"},
        cwd=REPO_ROOT,
        preexec_fn=_no_core_dump,  # the abort case must not spend seconds writing a core
    )


def test_import_bridge_does_not_import_mlx_until_first_use():
    proc = _run_python(
        """
        import sys
        import bridge
        bridge.stats(); bridge.reset_stats()
        assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules), "eager mlx"
        bridge.capabilities()
        assert "mlx.core" in sys.modules
        """
    )
    assert proc.returncode == 0, proc.stderr


def test_capabilities_match_raw_mlx_behaviour():
    caps = bridge.capabilities()
    try:  # the independent oracle: ask MLX directly
        mx.asarray(torch.ones(2), copy=False)
        raw_import_zero_copy = True
    except ValueError:
        raw_import_zero_copy = False
    array = mx.zeros((2,))
    mx.eval(array)
    torch.from_dlpack(array)[0] = 3.0
    raw_export_zero_copy = array.tolist()[0] == 3.0
    cpu = caps["cpu"]
    assert (cpu.import_zero_copy, cpu.export_zero_copy) == (
        raw_import_zero_copy,
        raw_export_zero_copy,
    )
    assert (cpu.fence, cpu.supports_float64, cpu.mlx_device) == ("none", True, "cpu")
    assert ("mps" in caps) == HAS_METAL


def _fake_mps_table():
    cpu = bridge.capabilities()["cpu"]
    mps = bridge.DeviceCapabilities("mps", "cpu", True, True, bridge_state.FENCE_MPS, False)
    return {"cpu": cpu, "mps": mps}


def test_float64_to_mps_target_is_rejected_before_eval():
    bridge_state.set_capabilities(_fake_mps_table())
    with pytest.raises(ValueError, match="output 0 is float64.*does not support"):
        bridge.mlx_to_torch(mx.ones((2,), dtype=mx.float64, stream=mx.cpu), "mps")
    x = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="output 0 is float64, which target device mps"):
        bridge.mlx_call(lambda a: a * 2, x, device="mps")
    assert bridge.stats().evals == 0 and bridge.stats().exports == 0


def test_float64_mps_input_is_rejected_before_fence(monkeypatch):
    fenced = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: fenced.append(1))
    # A CPU tensor stands in for an MPS one: the faked cpu entry carries the MPS rules.
    mps_rules = _fake_mps_table()["mps"]
    bridge_state.set_capabilities(
        {"cpu": bridge.DeviceCapabilities("cpu", "cpu", False, True, mps_rules.fence, False)}
    )
    with pytest.raises(ValueError, match="args\\[0\\] has dtype torch.float64, which cpu"):
        bridge.mlx_call(lambda a: a, torch.ones(2, dtype=torch.float64))
    assert fenced == []
    out = bridge.torch_to_mlx(torch.ones(2, dtype=torch.float32))
    assert fenced == [1] and out.tolist() == [1.0, 1.0]  # the owned copy fences too


def test_zero_copy_platform_borrows_without_copies(monkeypatch):
    """MPS ownership logic with a fake: zero-copy imports are requested, counted, and held.

    Linux MLX cannot wrap torch memory, so the fake `asarray(copy=False)` records the request
    and hands back a copy; what is checked is the bridge's routing and bookkeeping.
    """
    requests = []

    class _ZeroCopyMx:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def asarray(t, dtype=None, copy=None):
            requests.append(copy)
            return (
                mx.asarray(t, dtype=dtype)
                if copy is False
                else mx.asarray(t, dtype=dtype, copy=copy)
            )

    monkeypatch.setattr(crossing, "mlx_core", lambda: _ZeroCopyMx())
    monkeypatch.setattr(torch.mps, "synchronize", lambda: requests.append("fence"))
    rules = _fake_mps_table()["mps"]
    bridge_state.set_capabilities(
        {"cpu": bridge.DeviceCapabilities("cpu", "cpu", True, True, rules.fence, False)}
    )
    weight = torch.randn(4)
    (view,) = bridge.borrow_torch_tensors(weight)
    assert view.is_zero_copy and view.tensor.data_ptr() == weight.data_ptr()
    assert requests == ["fence", False]
    x = torch.randn(3, 4)
    out = bridge.mlx_call(lambda a, w: a * w, x, view)
    torch.testing.assert_close(out, x * weight)
    assert requests == ["fence", False, "fence", False]  # one fence, one borrow per call
    owned = bridge.torch_to_mlx(weight)  # owned copies even where borrowing is free
    assert requests[-1] is True and owned.tolist() == weight.tolist()
    s = bridge.stats()
    assert (s.zero_copy_imports, s.imports, s.copies, s.fences) == (2, 3, 1, 3)


def test_mps_target_unavailable_here_is_a_clear_error():
    if HAS_METAL:
        pytest.skip("MPS is available here")
    with pytest.raises(
        ValueError, match="device=mps cannot cross the MLX bridge.*allowed values: cpu"
    ):
        bridge.mlx_call(lambda a: a, torch.ones(2), device="mps")


def test_unknown_fence_kind_is_rejected():
    with pytest.raises(ValueError, match="fence='cuda.synchronize' is unknown; allowed values"):
        bridge_state.run_fence("cuda.synchronize")


@pytest.mark.timeout(60)
def test_lock_is_reentrant_for_nested_crossings():
    inner = torch.full((3,), 2.0)

    def op(a):
        nested = bridge.mlx_call(lambda b: b * 10, inner)  # crossing inside a crossing
        return a + mx.array(nested.numpy())

    out = bridge.mlx_call(op, torch.ones(3))
    assert out.tolist() == [21.0, 21.0, 21.0]


@pytest.mark.timeout(60)
def test_lock_serialises_entry_points():
    done = threading.Event()

    def worker():
        bridge.mlx_call(lambda a: a + 1, torch.ones(2))
        done.set()

    with bridge.BRIDGE_LOCK:
        thread = threading.Thread(target=worker)
        thread.start()
        time.sleep(0.3)
        assert not done.is_set()  # blocked while another holder crosses
    thread.join(timeout=30)
    assert done.is_set()


def test_raw_negative_stride_export_aborts_the_process():
    """Why the bridge checks strides: torch's DLPack importer aborts instead of raising."""
    raw = _run_python(
        """
        import mlx.core as mx, torch
        torch.from_dlpack(mx.arange(6).reshape(2, 3)[:, ::-1])
        """
    )
    if raw.returncode == 0:
        pytest.skip("this torch/MLX pair no longer aborts on negative strides")
    assert raw.returncode == -signal.SIGABRT


def test_threads_and_negative_strides_exit_cleanly():
    """Negative-stride exports, then two threads x 64 calls: the process must exit 0."""
    proc = _run_python(
        """
        import threading, torch, mlx.core as mx, bridge
        out = bridge.mlx_to_torch(mx.arange(6).reshape(2, 3)[:, ::-1])
        assert out.tolist() == [[2, 1, 0], [5, 4, 3]]
        x = torch.arange(6.0).reshape(3, 2)
        a, b = bridge.mlx_call_multi(lambda m: (m[::-1], m.T[::-1, ::-1]), x)
        assert a.tolist() == x.flip(0).tolist() and b.tolist() == x.T.flip(0, 1).tolist()
        bridge.reset_stats()
        errors = []
        def worker(seed):
            g = torch.Generator().manual_seed(seed)
            for i in range(64):
                x = torch.randn(8, 32, generator=g)
                w = torch.rand(32, generator=g)
                y, z = bridge.mlx_call_multi(
                    lambda a, b: (mx.fast.rms_norm(a, b, 1e-6), a[:, ::-1]), x, w
                )
                ref = torch.nn.functional.rms_norm(x, (32,), w, 1e-6)
                if not (torch.allclose(y, ref, atol=1e-5) and torch.equal(z, x.flip(1))):
                    errors.append((seed, i))
        threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        s = bridge.stats()
        assert not errors, errors
        # per call: one eval for both outputs + one materialisation pass for the flipped one
        assert (s.evals, s.materializations, s.exports, s.imports) == (256, 128, 256, 256), s
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@needs_metal
@pytest.mark.metal
def test_mps_import_is_zero_copy_after_fence():
    t = torch.arange(4, dtype=torch.float32, device="mps")
    (view,) = bridge.borrow_torch_tensors(t)
    t.add_(1)
    torch.mps.synchronize()
    assert view.is_zero_copy and view.array.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert bridge.stats().fences == 1


@needs_metal
@pytest.mark.metal
def test_mps_roundtrip_through_mlx_call():
    x = torch.randn(4, 8, device="mps")
    out = bridge.mlx_call(lambda a: a * 2, x)
    assert out.device.type == "mps"
    torch.testing.assert_close(out.cpu(), x.cpu() * 2)
