"""Contracts of `mlx_call` / `mlx_call_multi`: results match torch, one fence, one eval, errors.

The oracle for every numeric result is the same computation in plain torch.
"""

from __future__ import annotations

import pytest
import torch

import bridge
from bridge import bridge_state, crossing

mx = pytest.importorskip("mlx.core")


@pytest.fixture(autouse=True)
def _fresh_bridge():
    bridge_state.set_capabilities(None)
    bridge.reset_stats()
    yield
    bridge_state.set_capabilities(None)


def test_mlx_call_rms_norm_matches_torch():
    x = torch.randn(3, 5, 16)  # [B, N, H]
    w = torch.rand(16) + 0.5
    out = bridge.mlx_call(lambda a, b, eps: mx.fast.rms_norm(a, b, eps), x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x, (16,), w, 1e-5)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_mlx_call_decorator_gives_function_of_torch_tensors():
    @bridge.mlx_call
    def scaled_add(a, b, *, scale):
        return a + scale * b

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    out = scaled_add(a, b, scale=2.5)
    torch.testing.assert_close(out, a + 2.5 * b)
    assert scaled_add.__name__ == "scaled_add"


def test_mlx_call_multi_decorator_returns_tuple_of_tensors():
    @bridge.mlx_call_multi
    def split_stats(a):
        return a.max(axis=-1), a.argmax(axis=-1)

    x = torch.randn(5, 7)
    values, indices = split_stats(x)
    ref_values, ref_indices = x.max(dim=-1)
    torch.testing.assert_close(values, ref_values)
    assert indices.dtype == torch.uint32  # MLX argmax returns uint32; the bridge keeps it
    assert torch.equal(indices.long(), ref_indices)


def test_mlx_call_multi_one_fence_one_eval_in_order(monkeypatch):
    """Fence before the op, ONE eval after it covering all outputs, then export."""
    events: list[str] = []
    faked = {
        "cpu": bridge.DeviceCapabilities("cpu", "cpu", False, True, bridge_state.FENCE_MPS, True)
    }
    bridge_state.set_capabilities(faked)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: events.append("fence"))
    real_eval = mx.eval

    class _Mx:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays):
            events.append(f"eval:{len(arrays)}")
            return real_eval(*arrays)

    monkeypatch.setattr(crossing, "mlx_core", lambda: _Mx())
    real_export = crossing.export_array
    monkeypatch.setattr(
        crossing, "export_array", lambda *a: (events.append("export"), real_export(*a))[1]
    )

    def op(a, b, c):
        events.append("op")
        return a + b, b * c, c - a

    x, y, z = (torch.randn(4) for _ in range(3))
    outs = bridge.mlx_call_multi(op, x, y, z)
    assert events == ["fence", "op", "eval:3", "export", "export", "export"]
    torch.testing.assert_close(outs[0], x + y)
    torch.testing.assert_close(outs[1], y * z)
    torch.testing.assert_close(outs[2], z - x)
    s = bridge.stats()
    assert (s.fences, s.evals, s.imports, s.exports) == (1, 1, 3, 3)


def test_cpu_inputs_need_no_fence(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(1))
    bridge.mlx_call(lambda a: a * 2, torch.ones(3))
    assert calls == [] and bridge.stats().fences == 0


def test_mlx_call_multi_preserves_cpu_float64():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    tiny = 1e-12  # lost in float32 (eps 1.2e-7), kept in float64 (eps 2.2e-16)
    plus, minus = bridge.mlx_call_multi(lambda a: (a + tiny, a - tiny), x)
    assert plus.dtype == torch.float64 and minus.dtype == torch.float64
    torch.testing.assert_close(plus - minus, torch.full_like(x, 2 * tiny), rtol=1e-3, atol=0)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta", "xpu"])
def test_invalid_target_fails_before_any_work(device):
    ran = []
    with pytest.raises(ValueError, match=r"device=.*allowed values: cpu"):
        bridge.mlx_call(lambda a: (ran.append(1), a)[1], torch.ones(2), device=device)
    assert ran == [] and bridge.stats() == bridge.BridgeStats()


def test_meta_input_fails_before_fence_and_names_the_argument(monkeypatch):
    fences = []
    monkeypatch.setattr(crossing, "run_fence", lambda kind: fences.append(kind))
    with pytest.raises(ValueError, match=r"args\[1\]\.device=meta"):
        bridge.mlx_call(lambda a, b: a, torch.ones(2), torch.ones(2, device="meta"))
    assert fences == [] and bridge.stats() == bridge.BridgeStats()


def test_op_must_return_mlx_arrays():
    with pytest.raises(TypeError, match="mlx_call op must return an mlx.core.array; got list"):
        bridge.mlx_call(lambda a: [a], torch.ones(2))
    with pytest.raises(TypeError, match="non-empty tuple/list"):
        bridge.mlx_call_multi(lambda a: (), torch.ones(2))
    with pytest.raises(TypeError, match="non-empty tuple/list"):
        bridge.mlx_call_multi(lambda a: a, torch.ones(2))
    with pytest.raises(TypeError, match="output 1 is ndarray"):
        bridge.mlx_call_multi(lambda a: (a, torch.ones(2).numpy()), torch.ones(2))
    with pytest.raises(TypeError, match="expected a callable"):
        bridge.mlx_call(3, torch.ones(2))


def test_outputs_are_detached_from_autograd():
    x = torch.randn(4, requires_grad=True)
    out = bridge.mlx_call(lambda a: a * 3, x)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, x.detach() * 3)
    assert x.requires_grad  # the caller's tensor is untouched


def test_negative_stride_output_is_materialised_and_counted():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flipped, plain = bridge.mlx_call_multi(lambda a: (a[:, ::-1], a + 0), x)
    assert torch.equal(flipped, x.flip(-1)) and torch.equal(plain, x)
    assert all(s > 0 for s in flipped.stride())
    s = bridge.stats()
    assert (s.evals, s.materializations) == (2, 1)  # one eval for all, one extra pass for one


def test_views_and_tensors_mix_as_inputs():
    w = torch.randn(6)
    (view,) = bridge.borrow_torch_tensors(w)
    x = torch.randn(2, 6)
    bridge.reset_stats()
    out = bridge.mlx_call(lambda a, b: a * b, x, view)
    torch.testing.assert_close(out, x * w)
    assert bridge.stats().imports == 1  # the view is not imported again


def test_op_without_tensors_runs_with_explicit_device():
    out = bridge.mlx_call(lambda: mx.arange(5), device="cpu")
    assert torch.equal(out, torch.arange(5, dtype=torch.int32))
