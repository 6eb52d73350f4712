"""Ownership contracts: owned copies, zero-copy exports, persistent views, dtype round trips.

Oracles: the source torch tensor itself (values, data_ptr) and MLX's own view of its memory
(a write through torch is visible to MLX only if the storage is shared).
"""

from __future__ import annotations

import gc

import pytest
import torch

import bridge
from bridge import bridge_state

mx = pytest.importorskip("mlx.core")


@pytest.fixture(autouse=True)
def _fresh_bridge():
    bridge_state.set_capabilities(None)
    bridge.reset_stats()
    yield
    bridge_state.set_capabilities(None)


def _roundtrip_cases():
    yield torch.tensor([-1.5, 0.0, 3.25e38, -2.0e-38], dtype=torch.float32)
    yield torch.tensor([-1.5, 65504.0, 6.1e-5], dtype=torch.float16)
    yield torch.tensor([-1.5, 1.0e30, 3.0e-30], dtype=torch.bfloat16)  # out of float16 range
    yield torch.tensor([1.0 + 1e-12, -(2.0**-1000)], dtype=torch.float64)  # not float32-exact
    yield torch.tensor([-(2**7), 2**7 - 1], dtype=torch.int8)
    yield torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16)
    yield torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32)
    yield torch.tensor([-(2**63), 2**63 - 1, 2**53 + 1], dtype=torch.int64)
    yield torch.tensor([0, 255], dtype=torch.uint8)
    yield torch.tensor([True, False, True])
    yield torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64)


@pytest.mark.parametrize("t", list(_roundtrip_cases()), ids=lambda t: str(t.dtype))
def test_roundtrip_every_supported_dtype_is_lossless(t):
    array = bridge.torch_to_mlx(t)
    back = bridge.mlx_to_torch(array, "cpu")
    assert back.dtype == t.dtype and back.shape == t.shape
    assert back.tolist() == t.tolist()  # exact, element by element
    via_call = bridge.mlx_call(lambda a: a + 0 if a.dtype != mx.bool_ else a, t)
    assert via_call.dtype == t.dtype and via_call.tolist() == t.tolist()


def test_lazy_conjugate_and_odd_layouts_cross_by_value():
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    base = torch.arange(24.0).reshape(4, 6)
    cases = [z.conj(), z.conj().imag, base.T, base[1:3, ::2], torch.tensor(5.0), base[:0]]
    for t in cases:
        out = bridge.mlx_call(lambda a: a + 0, t)
        assert out.shape == t.shape and out.tolist() == t.resolve_conj().resolve_neg().tolist()
        assert bridge.torch_to_mlx(t).tolist() == t.resolve_conj().resolve_neg().tolist()


@pytest.mark.parametrize(
    "dtype", [torch.complex128, torch.float8_e4m3fn], ids=["complex128", "float8_e4m3fn"]
)
def test_unsupported_dtype_is_a_clear_error(dtype):
    t = torch.zeros(2, dtype=torch.float32).to(dtype)
    with pytest.raises(ValueError, match=rf"{dtype}.*allowed values: float32, float16, bfloat16"):
        bridge.torch_to_mlx(t)
    with pytest.raises(ValueError, match=rf"args\[0\] has dtype {dtype}"):
        bridge.mlx_call(lambda a: a, t)
    assert bridge.stats().imports == 0


def test_torch_to_mlx_is_independent_of_source_mutation_and_deletion():
    source = torch.arange(6, dtype=torch.float32)
    array = bridge.torch_to_mlx(source)
    source.mul_(100)  # the MLX copy must not see this
    del source
    gc.collect()
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    s = bridge.stats()
    assert (s.imports, s.copies, s.bytes_copied, s.evals) == (1, 1, 24, 1)


def test_torch_to_mlx_copies_even_where_import_could_be_zero_copy():
    """Owned means owned: with a zero-copy-capable table the owned path still copies.

    On this Linux build a zero-copy import raises, so the test also fails if the owned path
    ever asks MLX for `copy=False`.
    """
    real = bridge.capabilities()["cpu"]
    faked = bridge.DeviceCapabilities("cpu", "cpu", True, True, real.fence, True)
    bridge_state.set_capabilities({"cpu": faked})
    source = torch.ones(4)
    array = bridge.torch_to_mlx(source)
    source.zero_()
    assert array.tolist() == [1.0] * 4 and bridge.stats().zero_copy_imports == 0


def test_torch_to_mlx_preserves_cpu_float64():
    t = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    array = bridge.torch_to_mlx(t)
    assert array.dtype == mx.float64
    assert array.item() - 1.0 == pytest.approx(1e-12, rel=1e-3)


def test_mlx_to_torch_cpu_target_shares_mlx_storage():
    if not bridge.capabilities()["cpu"].export_zero_copy:
        pytest.skip("this MLX build copies on export")
    array = mx.zeros((4,), dtype=mx.float32)
    out = bridge.mlx_to_torch(array, "cpu")
    out[2] = 7.0  # a write through torch...
    assert array.tolist() == [0.0, 0.0, 7.0, 0.0]  # ...is seen by MLX: one storage
    s = bridge.stats()
    assert (s.exports, s.zero_copy_exports, s.copies) == (1, 1, 0)


def test_mlx_to_torch_evaluates_lazy_graph_once():
    lazy = mx.arange(5).astype(mx.float32) * 2  # not evaluated yet
    out = bridge.mlx_to_torch(lazy)
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and bridge.stats().evals == 1


def test_exported_tensor_outlives_the_mlx_array():
    array = mx.arange(1000).astype(mx.float32)
    out = bridge.mlx_to_torch(array)
    del array
    gc.collect()
    mx.clear_cache()
    torch.testing.assert_close(out, torch.arange(1000, dtype=torch.float32))


def test_mlx_to_torch_materialises_negative_strides():
    flipped = mx.arange(6).reshape(2, 3)[:, ::-1]
    out = bridge.mlx_to_torch(flipped)
    assert out.tolist() == [[2, 1, 0], [5, 4, 3]] and min(out.stride()) >= 0
    assert bridge.stats().materializations == 1


def test_mlx_to_torch_rejects_non_arrays_and_bad_devices():
    with pytest.raises(TypeError, match="expected mlx.core.array"):
        bridge.mlx_to_torch(torch.ones(2))
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        bridge.mlx_to_torch(mx.ones((2,)), "gpu0")
    with pytest.raises(ValueError, match="device=cuda cannot cross the MLX bridge"):
        bridge.mlx_to_torch(mx.ones((2,)), "cuda")


def test_view_holds_tensor_and_array_and_keeps_storage_alive():
    weight = torch.randn(3, 4)
    expected = weight.clone()
    (view,) = bridge.borrow_torch_tensors(weight)
    ptr = weight.data_ptr()
    del weight
    gc.collect()
    assert view.tensor.data_ptr() == ptr and not view.tensor.requires_grad
    assert torch.equal(view.tensor, expected)
    assert view.array.tolist() == expected.tolist()
    assert view.is_zero_copy == bridge.capabilities()["cpu"].import_zero_copy


def test_view_matches_detects_replaced_weight():
    weight = torch.randn(4, 4)
    (view,) = bridge.borrow_torch_tensors(weight)
    assert view.matches(weight)
    assert view.matches(weight.detach())  # same storage and layout
    assert not view.matches(weight.clone())  # same values, new storage
    assert not view.matches(weight.t())  # same storage, other stride
    assert not view.matches(weight.view(16))  # other shape
    assert not view.matches(weight.view(torch.int32))  # other dtype
    assert not view.matches(weight[1:])  # other data_ptr
    assert not view.matches("weight")
    param = torch.nn.Parameter(weight)
    (pview,) = bridge.borrow_torch_tensors(param)
    param.data = torch.randn(4, 4)  # a loader swapping the weight in place
    assert not pview.matches(param)


def test_borrow_validates_every_device_before_the_single_fence(monkeypatch):
    fences = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: fences.append(1))
    real = bridge.capabilities()["cpu"]
    fenced = bridge.DeviceCapabilities("cpu", "cpu", False, True, bridge_state.FENCE_MPS, True)
    bridge_state.set_capabilities({"cpu": fenced})
    good = [torch.ones(2), torch.zeros(3)]
    with pytest.raises(ValueError, match=r"tensors\[2\]\.device=meta"):
        bridge.borrow_torch_tensors(*good, torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match=r"tensors\[1\] is list"):
        bridge.borrow_torch_tensors(good[0], [1.0])
    assert fences == []
    views = bridge.borrow_torch_tensors(*good, torch.full((2,), 5.0))
    assert fences == [1] and len(views) == 3 and views[2].array.tolist() == [5.0, 5.0]
    bridge.borrow_torch_tensors(*good, synchronize=False)
    assert fences == [1] and bridge.stats().fences == 1
    assert real.fence == bridge_state.FENCE_NONE  # the real CPU entry needs no fence


def test_view_of_a_copy_stops_matching_after_an_in_place_write():
    """On copy platforms MLX holds the values at borrow time: a later in-place write to the
    torch weight (same storage, same layout) must make the view stale; zero-copy views keep
    matching because MLX reads the very storage that was written."""
    weight = torch.randn(4, 4)
    (view,) = bridge.borrow_torch_tensors(weight)
    with torch.no_grad():
        weight.mul_(2.0)
    sees_write = torch.equal(torch.tensor(view.array.tolist()), weight)
    assert view.matches(weight) == sees_write == view.is_zero_copy
    assert view.matches(weight) or not view.matches(weight.detach())  # views share the counter


def test_view_of_an_inference_tensor_copy_never_matches():
    with torch.inference_mode():
        weight = torch.randn(4, 4)
    (view,) = bridge.borrow_torch_tensors(weight)
    assert view.matches(weight) == view.is_zero_copy
