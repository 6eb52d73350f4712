"""ops.paged_attention: decode attention read through the block table.

Oracle: ops.attention (masked SDPA) over keys gathered into a contiguous buffer, the path the
paged op replaces. On CUDA the Triton kernel must equal the torch reference (GPU-marked).
"""

import importlib.util

import pytest
import torch

from ops.attention import KeyLayout, attention
from ops.paged_attention import impl_for, paged_decode_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(b, hq, hkv, d, block_size, lens, *, dtype=torch.float32, device="cpu", seed=0):
    """Random pool, shuffled (non-contiguous) block tables and queries for rows of `lens` keys."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(max(lens), 1) // block_size)
    num_blocks = b * width + 3
    k_pool = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    v_pool = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width)
    q = torch.randn(b, hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k_pool.to(dtype=dtype, **to), v_pool.to(dtype=dtype, **to),
            tables.to(**to), torch.tensor(lens, **to), sinks.to(**to))  # fmt: skip


def _oracle(q, k_pool, v_pool, tables, lens, block_size, sm_scale, sinks, window):
    """Gather each row's keys to width S and run ops.attention with positions and a layout."""
    s = tables.shape[1] * block_size
    pos = torch.arange(s)
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, S]
    keys = k_pool[slots].transpose(1, 2)  # [B, Hkv, S, D]
    values = v_pool[slots].transpose(1, 2)
    q_pos = (lens - 1).clamp(min=0)[:, None]  # [B, 1]
    layout = KeyLayout.contiguous(lens)
    out = attention(q[:, :, None], keys, values, q_pos, layout, sm_scale=sm_scale, sinks=sinks,
                    window=window)  # fmt: skip
    return out[:, :, 0]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_reference_equals_gathered_masked_attention(window, with_sinks, hq, hkv):
    lens = [1, 7, 13, 4]
    q, kp, vp, tables, kv_lens, sinks = _case(4, hq, hkv, 16, 4, lens, seed=hq + hkv)
    sinks = sinks if with_sinks else None
    got = paged_decode_attention(q, kp, vp, tables, kv_lens, block_size=4, sm_scale=0.25,
                                 sinks=sinks, window=window)  # fmt: skip
    want = _oracle(q, kp, vp, tables, kv_lens, 4, 0.25, sinks, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_reads_only_the_window_and_gives_padding_rows_zero():
    q, kp, vp, tables, kv_lens, _ = _case(2, 2, 1, 8, 4, [9, 0])
    out = paged_decode_attention(q, kp, vp, tables, kv_lens, block_size=4, sm_scale=1.0, window=3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # kv_len 0: no key, output 0
    # keys outside the window (positions 0..5 of row 0) may hold anything
    slots = tables[0, :2].repeat_interleave(4) * 4 + torch.arange(8) % 4
    kp[slots[:6]] = float("nan")
    again = paged_decode_attention(q, kp, vp, tables, kv_lens, block_size=4, sm_scale=1.0, window=3)
    torch.testing.assert_close(again, out)


def test_bad_arguments_name_the_field():
    q, kp, vp, tables, kv_lens, _ = _case(2, 4, 2, 8, 4, [3, 5])
    with pytest.raises(ValueError, match="kv_lens"):
        paged_decode_attention(q, kp, vp, tables, kv_lens[:1], block_size=4, sm_scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, kp, vp, tables, kv_lens, block_size=4, sm_scale=1.0,
                               sinks=torch.zeros(3))  # fmt: skip
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kp, vp, tables[:1], kv_lens, block_size=4, sm_scale=1.0)


def test_cpu_uses_the_reference():
    assert impl_for(torch.device("cpu")) is paged_decode_attention


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 8, 64, [3000]), (8, 32, 8, 64, [1, 17, 300, 129, 0, 64, 2048, 5]),
                                   (3, 14, 2, 128, [40, 1, 77]),
                                   (40, 32, 8, 64, [0, 1, 77, 300, 2048] + [129] * 35)])  # fmt: skip
def test_triton_kernel_equals_the_reference(dtype, window, with_sinks, shape):
    b, hq, hkv, d, lens = shape
    case = _case(b, hq, hkv, d, 16, lens, dtype=dtype, device="cuda", seed=b)
    q, kp, vp, tables, kv_lens, sinks = case
    sinks = sinks if with_sinks else None
    kernel = impl_for(torch.device("cuda"))
    assert kernel is not paged_decode_attention  # Triton is there on the GPU machine
    args = dict(block_size=16, sm_scale=d**-0.5, sinks=sinks, window=window)
    out = torch.full_like(q, float("nan"))
    out = kernel(q, kp, vp, tables, kv_lens, **args)
    want = paged_decode_attention(q, kp, vp, tables, kv_lens, **args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    assert not out.isnan().any()
    if b * hkv >= 264:  # B * Hkv fills the GPU: one split, the first kernel writes the output
        from ops.paged_attention_triton import num_splits

        assert num_splits(b, hkv, tables.shape[1] * 16) == 1


def test_split_min_keys_names_the_variable_and_the_allowed_values(monkeypatch):
    from ops.paged_attention import split_min_keys

    monkeypatch.setenv("TORCH_RUNNER_ATTN_SPLIT_MIN_KEYS", "256")
    assert split_min_keys() == 256
    monkeypatch.setenv("TORCH_RUNNER_ATTN_SPLIT_MIN_KEYS", "100")
    with pytest.raises(ValueError, match="TORCH_RUNNER_ATTN_SPLIT_MIN_KEYS='100'.*64, 128"):
        split_min_keys()


SPLIT_CHECK = """
import torch
from ops.paged_attention import paged_decode_attention
from ops.paged_attention_triton import num_splits, paged_decode_attention as kernel
gen = torch.Generator().manual_seed(0)
b, hq, hkv, d, page, width = 1, 4, 2, 16, 16, 16  # a 256-key table, 200 keys used
q = torch.randn(b, hq, d, generator=gen)
kp = torch.randn(width * page + 1, hkv, d, generator=gen)
vp = torch.randn(width * page + 1, hkv, d, generator=gen)
tables = torch.randperm(width, generator=gen)[None].long()
kv_lens = torch.tensor([200])
args = dict(block_size=page, sm_scale=d**-0.5)
print("splits", num_splits(b, hkv, width * page))
got = kernel(q, kp, vp, tables, kv_lens, **args)
want = paged_decode_attention(q, kp, vp, tables, kv_lens, **args)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="CPU interpreter check",
)
@pytest.mark.parametrize("min_keys, splits", [("64", 4), ("256", 1)])
def test_split_min_keys_sets_the_split_count_and_keeps_the_output(min_keys, splits, monkeypatch):
    """Default: a 256-key table splits in four; 256 keys a split: one program a KV head, the
    output written by it (no merge); both equal the torch reference (fp32, interpreter)."""
    from triton_interpreter import run_in_interpreter

    monkeypatch.setenv("TORCH_RUNNER_ATTN_SPLIT_MIN_KEYS", min_keys)
    result = run_in_interpreter(SPLIT_CHECK, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert f"splits {splits}" in result.stdout
