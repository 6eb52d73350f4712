"""ops.attention against a brute-force reference: visibility per (query, key) in Python, fp64 softmax."""

from __future__ import annotations

import importlib

import pytest
import torch

from ops.attention import KeyLayout, attention

# `ops.attention` is the dispatcher function; the module is reached through importlib
attention_module = importlib.import_module("ops.attention")

D = 8


def brute_force(q, k, v, q_positions, k_positions, valid, sm_scale, sinks, window):
    """Visibility listed key by key in plain Python from the contract's rule; softmax in fp64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    q_pos, k_pos, is_valid = q_positions.tolist(), k_positions.tolist(), valid.tolist()
    visible = torch.tensor(
        [
            [
                [
                    is_valid[b][j] and kp <= p and (window is None or kp > p - window)
                    for j, kp in enumerate(k_pos[b])
                ]
                for p in q_pos[b]
            ]
            for b in range(q.shape[0])
        ]
    )[:, None]  # [B, 1, N, S]
    kk = k.repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    vv = v.repeat_interleave(group, dim=1)
    logits = (q @ kk.transpose(-1, -2) * sm_scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double()[None, :, None, None].expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sink_col], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., : k.shape[2]]  # [B, Hq, N, S], sink dropped
    probs = torch.nan_to_num(probs)  # rows with no visible key and no sink: no reference value
    return probs @ vv


def _qkv(batch, num_heads, num_kv_heads, n, s, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_heads, n, D, generator=gen, dtype=dtype)
    k = torch.randn(batch, num_kv_heads, s, D, generator=gen, dtype=dtype)
    v = torch.randn(batch, num_kv_heads, s, D, generator=gen, dtype=dtype)
    sinks = torch.randn(num_heads, generator=gen, dtype=dtype)
    return q, k, v, sinks


WINDOWS = [None, 1, 8, 128]
GQA = [1, 4, 8]
QUERY_LENS = [1, 7, 300]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("has_sinks", [False, True])
@pytest.mark.parametrize("group", GQA)
@pytest.mark.parametrize("n", QUERY_LENS)
@pytest.mark.parametrize("prefix", [0, 37])
def test_attention_matches_brute_force_for_chunk_after_cached_prefix(
    window, has_sinks, group, n, prefix
):
    q, k, v, sinks = _qkv(1, group, 1, n, prefix + n, seed=n + prefix + group)
    sinks = sinks if has_sinks else None
    q_positions = torch.arange(prefix, prefix + n)[None]
    k_positions = torch.arange(prefix + n)[None]
    valid = torch.ones(1, prefix + n, dtype=torch.bool)
    want = brute_force(q, k, v, q_positions, k_positions, valid, 0.35, sinks, window)
    if prefix == 0:
        got = attention(q, k, v, q_positions, None, sm_scale=0.35, sinks=sinks, window=window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for is_tail in (False, True):
        layout = KeyLayout.contiguous(torch.tensor([prefix + n]), is_causal_tail=is_tail)
        got = attention(q, k, v, q_positions, layout, sm_scale=0.35, sinks=sinks, window=window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("has_sinks", [False, True])
def test_batched_decode_rows_with_different_cache_lengths_and_offsets(window, has_sinks):
    # row 0: full cache of 140; row 1: 9 keys; row 2: windowed cache whose key 0 is position 100
    kv_lens = torch.tensor([140, 9, 12])
    k_offsets = torch.tensor([0, 0, 100])
    q_positions = (k_offsets + kv_lens - 1)[:, None]  # [B, 1]
    q, k, v, sinks = _qkv(3, 8, 2, 1, 140, seed=3)
    sinks = sinks if has_sinks else None
    layout = KeyLayout(k_offsets, kv_lens)
    got = attention(q, k, v, q_positions, layout, sm_scale=0.2, sinks=sinks, window=window)
    k_positions = k_offsets[:, None] + torch.arange(140)
    valid = torch.arange(140) < kv_lens[:, None]
    want = brute_force(q, k, v, q_positions, k_positions, valid, 0.2, sinks, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_padding_rows_with_no_visible_key_give_finite_output():
    q, k, v, _ = _qkv(2, 4, 2, 3, 6)
    layout = KeyLayout(torch.tensor([0, 0]), torch.tensor([6, 0]))  # row 1: pure padding
    q_positions = torch.tensor([[3, 4, 5], [0, 0, 0]])
    out = attention(q, k, v, q_positions, layout, sm_scale=0.5)
    assert torch.isfinite(out).all()
    want = brute_force(
        q,
        k,
        v,
        q_positions,
        torch.arange(6).expand(2, 6),
        layout.kv_lens[:, None] > torch.arange(6),
        0.5,
        None,
        None,
    )
    torch.testing.assert_close(out[0].double(), want[0], atol=1e-5, rtol=1e-5)


def test_bf16_output_dtype_and_accuracy():
    q, k, v, sinks = _qkv(1, 4, 2, 7, 20, dtype=torch.bfloat16)
    layout = KeyLayout.contiguous(torch.tensor([20]))
    q_positions = torch.arange(13, 20)[None]
    out = attention(q, k, v, q_positions, layout, sm_scale=0.35, sinks=sinks, window=8)
    assert out.dtype == torch.bfloat16
    want = brute_force(
        q,
        k,
        v,
        q_positions,
        torch.arange(20)[None],
        torch.ones(1, 20, dtype=torch.bool),
        0.35,
        sinks,
        8,
    )
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_non_contiguous_inputs_match_contiguous():
    # the model's q is usually a transpose of [B, N, H, D]
    q, k, v, sinks = _qkv(2, 4, 2, 5, 5)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_t.is_contiguous()
    positions = torch.arange(5).expand(2, 5)
    a = attention(q, k, v, positions, None, sm_scale=0.3, sinks=sinks, window=2)
    b = attention(q_t, k_t, v, positions, None, sm_scale=0.3, sinks=sinks, window=2)
    torch.testing.assert_close(a, b)


def test_mask_is_built_once_per_step_and_window():
    q, k, v, _ = _qkv(2, 4, 2, 1, 10)
    layout = KeyLayout(torch.tensor([0, 0]), torch.tensor([10, 4]))
    q_positions = torch.tensor([[9], [3]])
    m1 = layout.mask(q_positions, 10, 4)
    assert layout.mask(q_positions, 10, 4) is m1
    assert layout.mask(q_positions, 10, None) is not m1
    attention(q, k, v, q_positions, layout, sm_scale=0.3, window=4)
    assert layout.mask(q_positions, 10, 4) is m1


@pytest.mark.parametrize(
    ("shape_q", "shape_k", "positions", "match"),
    [
        ((1, 4, 3, D), (1, 3, 3, D), (1, 3), "Hkv=3 must divide Hq=4"),
        ((1, 4, 3, D), (1, 2, 3, D), (1, 2), "q_positions must be"),
        ((1, 4, 3, D), (1, 2, 5, D), (1, 3), "S must equal N"),
    ],
)
def test_bad_shapes_name_the_field(shape_q, shape_k, positions, match):
    q, k = torch.randn(shape_q), torch.randn(shape_k)
    with pytest.raises(ValueError, match=match):
        attention(q, k, k, torch.zeros(positions, dtype=torch.long), None, sm_scale=1.0)


def test_bad_window_and_sinks_name_the_field():
    q = torch.randn(1, 4, 3, D)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match="window must be None or >= 1"):
        attention(q, q, q, pos, None, sm_scale=1.0, window=0)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq\]"):
        attention(q, q, q, pos, None, sm_scale=1.0, sinks=torch.zeros(3))


@pytest.mark.parametrize("window", [None, 1, 8])
@pytest.mark.parametrize("has_sinks", [False, True])
@pytest.mark.parametrize("prefix", [0, 11])
def test_portable_sdpa_path_matches_brute_force(monkeypatch, window, has_sinks, prefix):
    # MPS/CUDA have no CPU flash kernel: the portable path (SDPA, sinks as a key column) runs
    monkeypatch.setattr(attention_module, "CPU_FLASH", None)
    n = 13
    q, k, v, sinks = _qkv(2, 8, 2, n, prefix + n, seed=5)
    sinks = sinks if has_sinks else None
    q_positions = torch.arange(prefix, prefix + n).expand(2, n)
    k_positions = torch.arange(prefix + n).expand(2, prefix + n)
    kv_lens = torch.tensor([prefix + n, prefix + n])
    want = brute_force(q, k, v, q_positions, k_positions, k_positions >= 0, 0.3, sinks, window)
    layouts = [KeyLayout.contiguous(kv_lens), KeyLayout.contiguous(kv_lens, is_causal_tail=True)]
    if prefix == 0:
        layouts.append(None)
    for layout in layouts:
        got = attention(q, k, v, q_positions, layout, sm_scale=0.3, sinks=sinks, window=window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_causal_tail_layout_with_fewer_keys_than_queries_is_rejected():
    q, k = torch.randn(1, 4, 5, D), torch.randn(1, 2, 3, D)
    layout = KeyLayout.contiguous(torch.tensor([3]), is_causal_tail=True)
    with pytest.raises(ValueError, match="is_causal_tail needs the N=5 queries among the S=3"):
        attention(q, k, k, torch.arange(5)[None], layout, sm_scale=1.0)


@pytest.mark.parametrize("is_cpu_flash", [True, False])
@pytest.mark.parametrize("prefix", [0, 3, 29])
def test_long_windowed_chunk_blocked_by_window_matches_brute_force(
    monkeypatch, is_cpu_flash, prefix
):
    # N >= 2W and S >= 4W: the op scores blocks of W queries against 2W keys instead of N x S
    if not is_cpu_flash:
        monkeypatch.setattr(attention_module, "CPU_FLASH", None)
    n, window = 45, 6
    q, k, v, sinks = _qkv(2, 8, 2, n, prefix + n, seed=prefix)
    q_positions = torch.arange(prefix, prefix + n).expand(2, n)
    k_positions = torch.arange(prefix + n).expand(2, prefix + n)
    want = brute_force(q, k, v, q_positions, k_positions, k_positions >= 0, 0.3, sinks, window)
    layout = KeyLayout.contiguous(torch.tensor([prefix + n] * 2), is_causal_tail=True)
    for lay in [layout] if prefix else [layout, None]:
        got = attention(q, k, v, q_positions, lay, sm_scale=0.3, sinks=sinks, window=window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("n,s", [(40, 40), (24, 70), (1, 33)])
def test_cuda_causal_tail_with_sinks_and_window_equals_cpu(window, n, s):
    """bf16 on CUDA (the flash kernel with its log-sum-exp, no cuDNN) against fp32 on CPU."""
    from ops.attention import KeyLayout, attention

    gen = torch.Generator().manual_seed(n + s)
    q = torch.randn(2, 8, n, 64, generator=gen)
    k, v = torch.randn(2, 2, s, 64, generator=gen), torch.randn(2, 2, s, 64, generator=gen)
    sinks = torch.randn(8, generator=gen)
    pos = torch.arange(s - n, s).expand(2, n)
    layout = KeyLayout.contiguous(torch.full((2,), s), is_causal_tail=True)
    want = attention(q, k, v, pos, layout, sm_scale=0.125, sinks=sinks, window=window)
    cuda = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    layout_cuda = KeyLayout.contiguous(torch.full((2,), s, device="cuda"), is_causal_tail=True)
    got = attention(*cuda, pos.cuda(), layout_cuda, sm_scale=0.125, sinks=sinks.cuda(),
                    window=window)  # fmt: skip
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2)
