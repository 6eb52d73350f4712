"""Every MLX op equals its torch reference: fp32 within 1e-5, bf16 within 1e-2, any strides."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("mlx.core")

import bridge  # noqa: E402
from ops.attention import KeyLayout  # noqa: E402

ref = {n: importlib.import_module(f"ops.{n}") for n in ("attention", "norm", "rope", "moe")}
mlx = {n: importlib.import_module(f"ops.mlx.{n}") for n in ("attention", "norm", "rope", "moe")}

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want):
    """Elementwise within TOL, measured in units of the output's scale (max(1, max |want|)).

    bf16 keeps 8 mantissa bits, so an output near 9 has a 0.0625 ulp: an absolute 1e-2 would
    demand better than bf16 can represent there.
    """
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(1.0, want.float().abs().max().item())
    worst = (got.float() - want.float()).abs().max().item()
    assert worst <= TOL[want.dtype] * scale, f"max |mlx - torch| = {worst:.3g} (scale {scale:.3g})"


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _transposed(t):
    """Same values, non-contiguous: a [B, N, H, D + 3] buffer viewed as [B, H, N, D]."""
    buf = torch.zeros(t.shape[0], t.shape[2], t.shape[1], t.shape[3] + 3, dtype=t.dtype)
    buf[..., : t.shape[3]] = t.transpose(1, 2)
    out = buf[..., : t.shape[3]].transpose(1, 2)
    assert not out.is_contiguous()
    return out


CASES = {
    # name: (B, N, S, k_offsets, kv_lens, q_positions, is_causal_tail)
    "prefill_no_cache": (1, 9, 9, None, None, [list(range(9))], False),
    "chunk_after_prefix_tail": (1, 5, 20, [0], [20], [list(range(15, 20))], True),
    "ragged_decode": (3, 1, 20, [0, 0, 40], [20, 6, 11], [[19], [5], [50]], False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("has_sinks", [False, True])
@pytest.mark.parametrize("is_strided", [False, True])
def test_mlx_attention_equals_torch(dtype, case, window, has_sinks, is_strided):
    b, n, s, offsets, lens, positions, is_tail = CASES[case]
    q = _randn(b, 8, n, 16, dtype=dtype, seed=1)
    k = _randn(b, 2, s, 16, dtype=dtype, seed=2)
    v = _randn(b, 2, s, 16, dtype=dtype, seed=3)
    if is_strided:
        q, k, v = _transposed(q), _transposed(k), _transposed(v)
    sinks = _randn(8, dtype=dtype, seed=4) if has_sinks else None
    q_positions = torch.tensor(positions)
    layout = None
    if offsets is not None:
        layout = KeyLayout(torch.tensor(offsets), torch.tensor(lens), is_causal_tail=is_tail)
    kwargs = {"sm_scale": 0.25, "sinks": sinks, "window": window}
    want = ref["attention"].attention(q, k, v, q_positions, layout, **kwargs)
    _close(mlx["attention"].attention(q, k, v, q_positions, layout, **kwargs), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_weight", [False, True])
@pytest.mark.parametrize("is_strided", [False, True])
def test_mlx_norms_equal_torch(dtype, has_weight, is_strided):
    x = _randn(6, 5, 64, dtype=dtype, scale=3.0)
    if is_strided:
        x = x.transpose(0, 1)
    weight = _randn(64, seed=1).abs() + 0.5 if has_weight else None
    bias = _randn(64, seed=2) if has_weight else None
    _close(mlx["norm"].rms_norm(x, weight, 1e-5), ref["norm"].rms_norm(x, weight, 1e-5))
    _close(
        mlx["norm"].layer_norm(x, weight, bias, 1e-5),
        ref["norm"].layer_norm(x, weight, bias, 1e-5),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dims", [32, 16])
@pytest.mark.parametrize("is_strided", [False, True])
def test_mlx_rope_equals_torch(dtype, rotary_dims, is_strided):
    q = _randn(2, 4, 5, 32, dtype=dtype, seed=1)
    k = _randn(2, 2, 5, 32, dtype=dtype, seed=2)
    if is_strided:
        q, k = _transposed(q), _transposed(k)
    positions = torch.tensor([[0, 1, 2, 3, 4], [700, 701, 3, 9000, 5]])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
    want = ref["rope"].apply_rope(q, k, positions, inv_freq, 1.2)
    got = mlx["rope"].apply_rope(q, k, positions, inv_freq, 1.2)
    # bf16 angles at position 9000 differ in the last cos/sin ulp: compare in fp32 units
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_mlx_moe_gpt_oss_equals_torch(dtype, num_tokens):
    e, h, i = 8, 32, 24
    x = _randn(num_tokens, h, dtype=dtype, seed=1)
    weights = [
        _randn(e, h, dtype=dtype, seed=2),
        _randn(e, dtype=dtype, seed=3),
        _randn(e, h, 2 * i, dtype=dtype, seed=4, scale=0.3),
        _randn(e, 2 * i, dtype=dtype, seed=5),
        _randn(e, i, h, dtype=dtype, seed=6, scale=0.2),
        _randn(e, h, dtype=dtype, seed=7),
    ]
    want = ref["moe"].moe_gpt_oss(x, *weights, top_k=3)
    _close(mlx["moe"].moe_gpt_oss(x, *weights, top_k=3), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_mlx_moe_qwen3_equals_torch(dtype, norm_topk_prob):
    e, h, i = 8, 32, 16
    x = _randn(6, h, dtype=dtype, seed=1)
    gate = _randn(e, h, dtype=dtype, seed=2)
    gate_up = _randn(e, 2 * i, h, dtype=dtype, seed=3, scale=0.3)
    down = _randn(e, h, i, dtype=dtype, seed=4, scale=0.3)
    kwargs = {"top_k": 2, "norm_topk_prob": norm_topk_prob}
    want = ref["moe"].moe_qwen3(x, gate, gate_up, down, **kwargs)
    _close(mlx["moe"].moe_qwen3(x, gate, gate_up, down, **kwargs), want)
    # same values through non-contiguous views: tokens strided, experts stored transposed
    x_s = torch.zeros(6, 2 * h, dtype=dtype)
    x_s[:, ::2] = x
    up_s = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_s[:, ::2].is_contiguous() and not up_s.is_contiguous()
    _close(mlx["moe"].moe_qwen3(x_s[:, ::2], gate, up_s, down, **kwargs), want)


def test_each_mlx_op_is_one_crossing():
    q = _randn(1, 4, 3, 16)
    bridge.reset_stats()
    mlx["attention"].attention(q, q, q, torch.arange(3)[None], None, sm_scale=0.25)
    mlx["rope"].apply_rope(q, q, torch.arange(3)[None], torch.rand(8), 1.0)
    assert bridge.stats().evals == 2


def test_island_runs_several_ops_in_one_crossing():
    from bridge import mlx_call_multi
    from ops.mlx.attention import sdpa_mx
    from ops.mlx.norm import rms_norm_mx
    from ops.mlx.rope import apply_rope_mx

    x = _randn(1, 4, 6, 16)
    weight = _randn(16, seed=1).abs()
    positions = torch.arange(6)[None]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))

    def block(x, weight, positions, inv_freq):
        h = rms_norm_mx(x, weight, 1e-5)
        q, k = apply_rope_mx(h, h, positions, inv_freq, 1.0)
        return (sdpa_mx(q, k, h, "causal", scale=0.25),)

    bridge.reset_stats()
    (got,) = mlx_call_multi(block, x, weight, positions, inv_freq)
    assert bridge.stats().evals == 1
    h = ref["norm"].rms_norm(x, weight, 1e-5)
    q, k = ref["rope"].apply_rope(h, h, positions, inv_freq, 1.0)
    _close(got, ref["attention"].attention(q, k, h, positions, None, sm_scale=0.25))


def test_mlx_moe_accepts_borrowed_weight_views_and_imports_only_the_tokens():
    e, h, i = 8, 32, 16
    x = _randn(6, h, seed=1)
    weights = [
        _randn(e, h, seed=2),
        _randn(e, 2 * i, h, seed=3, scale=0.3),
        _randn(e, h, i, seed=4, scale=0.3),
    ]
    views = bridge.borrow_torch_tensors(*weights)
    kwargs = {"top_k": 2, "norm_topk_prob": True}
    bridge.reset_stats()
    got = mlx["moe"].moe_qwen3(x, *views, **kwargs)
    assert bridge.stats().imports == 1  # x only; the experts were borrowed once, above
    _close(got, ref["moe"].moe_qwen3(x, *weights, **kwargs))


def test_mlx_attention_padding_rows_are_finite_and_bad_shapes_fail_before_crossing():
    q = _randn(2, 4, 3, 16, seed=1)
    k = _randn(2, 2, 6, 16, seed=2)
    layout = KeyLayout(torch.tensor([0, 0]), torch.tensor([6, 0]))  # row 1: pure padding
    positions = torch.tensor([[3, 4, 5], [0, 0, 0]])
    got = mlx["attention"].attention(q, k, k, positions, layout, sm_scale=0.5)
    assert torch.isfinite(got).all()
    want = ref["attention"].attention(q, k, k, positions, layout, sm_scale=0.5)
    _close(got[0], want[0])
    bridge.reset_stats()
    with pytest.raises(ValueError, match="Hkv=3 must divide Hq=4"):
        k3 = k[:, :1].expand(2, 3, 6, 16)
        mlx["attention"].attention(q, k3, k3, positions, layout, sm_scale=1.0)
    assert bridge.stats().imports == 0
