"""The one-kernel rope + paged KV write + attention (ops/paged_attend_fused_triton.py) against
the three kernels it replaces (ops/fused `rope_kv_write`, then ops/paged_attention_triton's
split and merge kernels) and against the torch reference (ops.rope's `rope_kv_write` torch
path, then ops.paged_attention.paged_decode_attention).

On CPU both Triton paths run in Triton's interpreter (skipped where triton is not installed, as
in CI): q and the pool bit for bit, and the output too (the interpreter runs both paths' fp32
math as the same numpy operations in the same order; on a GPU the output may differ in the last
fp32 bits, because the fused kernel is compiled without FMA contraction for rope's sake). On
CUDA (`pytest -m gpu`): the same comparisons at model-like shapes, and a CUDA-graph capture
replayed with changing kv_lens.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_interpreter import assert_interpreter_ok

from ops import paged_attention
from ops.paged_attention import ENV_FUSED_ATTEND, fused_attend_for, fused_attend_mode
from ops.rope import rope_tables

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (B, Hq, Hkv, D, ROT, table width in blocks of 4, kv_lens, window, sinks, dtype, splits):
# GQA groups 1 / 4 / 8, partial rotary, padding rows (kv_len 0), one split and several (a
# context shorter than one split, and one spanning them), windows, sinks
CASES = [
    (1, 4, 1, 64, 64, 64, [200], None, True, torch.float32, 4),
    (3, 2, 2, 64, 32, 32, [100, 0, 5], None, False, torch.float32, 2),
    (3, 4, 1, 64, 64, 64, [150, 0, 40], 80, True, torch.float32, 2),
    (3, 8, 2, 64, 64, 8, [20, 3, 0], None, True, torch.bfloat16, 1),
    (1, 4, 2, 64, 32, 64, [230], 100, True, torch.bfloat16, 2),
    (1, 8, 1, 64, 64, 64, [129], None, False, torch.bfloat16, 4),
]
BLOCK = 4  # keys per pool block


def attend_case(b, hq, hkv, d, rot, width, lens, dtype, *, device="cpu", seed=0):
    """Random unrotated qkv, rope rows at position kv_len - 1, pools of random history with NaN
    at the write slots, shuffled block tables; slots, kv_lens and tables are strided columns of
    one int64 buffer, as the graph decode passes them; padding rows use a scratch slot."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = b * width + 1  # the last block holds the scratch slot
    pools = [torch.randn(num_blocks * BLOCK, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    inputs = torch.zeros(b, 4 + width, dtype=torch.int64)
    inputs[:, 3] = num_blocks * BLOCK - 1
    blocks = torch.randperm(num_blocks - 1, generator=gen).view(b, width)
    for row, n in enumerate(lens):
        inputs[row, 2] = n
        if n:
            inputs[row, 4:] = blocks[row]
            inputs[row, 3] = blocks[row, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
    for pool in pools:
        pool[inputs[:, 3]] = float("nan")  # read before written: NaN in the output
    qkv = torch.randn(b, hq + 2 * hkv, d, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    positions = (inputs[:, 2:3] - 1).clamp(min=0)
    cos, sin = rope_tables(positions, inv_freq, 1.0, dtype)  # [B, 1, 1, D_rot]
    sinks = torch.randn(hq, generator=gen)
    inputs = inputs.to(device)
    tensors = [x.to(device) for x in (qkv, cos.reshape(b, rot), sin.reshape(b, rot), *pools)]
    return (*tensors, inputs[:, 3], inputs[:, 4:], inputs[:, 2]), sinks.to(device)


def run_path(path, case, hq, window, sinks):
    """(q, out, k_pool, v_pool) of one path on its own copy of the pools: "fused", "three"
    (the three kernels) or "torch" (the reference ops)."""
    if path == "torch":
        case = [x.cpu() for x in case]
        sinks = None if sinks is None else sinks.cpu()
    qkv, cos, sin, k_pool, v_pool, slots, tables, kv_lens = case
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    args = dict(block_size=BLOCK, sm_scale=qkv.shape[-1] ** -0.5, sinks=sinks, window=window)
    if path == "fused":
        from ops.paged_attend_fused_triton import fused_rope_attend

        q = torch.empty(qkv.shape[0], hq, qkv.shape[2], dtype=qkv.dtype, device=qkv.device)
        out = fused_rope_attend(qkv, cos, sin, k_pool, v_pool, slots, tables, kv_lens,
                                num_q_heads=hq, q_out=q, **args)  # fmt: skip
        return q, out, k_pool, v_pool
    if path == "three":
        from ops.fused.triton_kernels import rope_kv_write
        from ops.paged_attention_triton import paged_decode_attention
    else:
        from ops.paged_attention import paged_decode_attention
        from ops.rope import rope_kv_write
    q = rope_kv_write(qkv, cos, sin, k_pool, v_pool, slots, hq)
    return q, paged_decode_attention(q, k_pool, v_pool, tables, kv_lens, **args), k_pool, v_pool


INTERPRETER_CHECK = """
import torch
from test_fused_attend import CASES, attend_case, run_path
from ops.paged_attend_fused_triton import _counters
from ops.paged_attention_triton import num_splits
for i, (b, hq, hkv, d, rot, width, lens, window, with_sinks, dtype, splits) in enumerate(CASES):
    assert num_splits(b, hkv, min(width * 4, window or width * 4)) == splits, i
    case, sinks = attend_case(b, hq, hkv, d, rot, width, lens, dtype, seed=i)
    sinks = sinks if with_sinks else None
    for call in range(2):  # the second call: one token on, on the pools the first one left
        fused = run_path("fused", case, hq, window, sinks)
        three = run_path("three", case, hq, window, sinks)
        if splits > 1:  # every (row, KV head) counter back at 0 for the next call
            assert not _counters[torch.device("cpu")].any(), i
        names = ("q", "out", "k_pool", "v_pool")
        for name, got, want in zip(names, fused, three, strict=True):
            assert torch.equal(got, want), (i, call, name)  # the interpreter: bit for bit
        assert not fused[1].isnan().any(), (i, call)
        ref = run_path("torch", case, hq, window, sinks)
        for name, got, want in zip(names, fused, ref, strict=True):
            if dtype == torch.bfloat16 and name == "out":
                continue  # the interpreter's bf16 tl.dot is wrong (numpy has no bf16): GPU only
            if dtype == torch.float32 and name != "out":
                assert torch.equal(got, want), (i, call, name)
            else:  # the interpreter truncates fp32 -> bf16 (torch rounds); fp32 sums reorder
                tol = 1e-5 if dtype == torch.float32 else 2**-5
                scale = max(float(want.float().abs().max()), 1.0)
                close = (got.float() - want.float()).abs() <= tol * scale
                assert close.all(), (i, call, name)
        for row, n in enumerate(lens):
            if n == 0:
                assert not fused[1][row].isnan().any()  # padding rows: zeros or sink-only
        qkv, cos, sin, _, _, slots, tables, kv_lens = case
        kv_lens += (kv_lens > 0).long()  # the next token of each real row
        pos = (kv_lens - 1).clamp(min=0)
        page = tables.gather(1, (pos // 4)[:, None])[:, 0]
        slots.copy_(torch.where(kv_lens > 0, page * 4 + pos % 4, slots))
        case = (torch.randn_like(qkv.float()).to(dtype), cos.roll(1, 0), sin.roll(1, 0),
                fused[2], fused[3], slots, tables, kv_lens)
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_fused_kernel_equals_the_three_kernels_and_the_reference_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


def test_switch_names_the_variable_and_the_allowed_values(monkeypatch):
    monkeypatch.setattr(paged_attention, "_FUSED", {})
    monkeypatch.setenv(ENV_FUSED_ATTEND, "bogus")
    message = "TORCH_RUNNER_FUSED_ATTEND='bogus': allowed values are on, off"
    with pytest.raises(ValueError, match=message):
        fused_attend_mode()
    with pytest.raises(ValueError, match=message):  # read before any device or Triton check
        fused_attend_for(torch.device("cuda"))
    monkeypatch.setenv(ENV_FUSED_ATTEND, " OFF")
    assert fused_attend_mode() == "off"
    assert fused_attend_for(torch.device("cuda")) is None


def test_off_cuda_the_switch_is_not_read_and_nothing_is_fused(monkeypatch):
    monkeypatch.setattr(paged_attention, "_FUSED", {})
    monkeypatch.setenv(ENV_FUSED_ATTEND, "bogus")
    assert fused_attend_for(torch.device("cpu")) is None


GPU_CASES = [  # (B, Hq, Hkv, D, ROT, width in blocks of 4, kv_lens, window, sinks)
    (1, 32, 8, 128, 128, 1024, [3000], None, False),  # 32 splits
    (1, 64, 8, 64, 64, 512, [2047], 128, True),
    (3, 14, 2, 128, 64, 64, [200, 0, 7], None, True),
    (8, 32, 8, 64, 64, 16, [1, 17, 60, 0, 64, 33, 2, 5], None, False),
]


def _assert_fused_matches_three(fused, three, dtype):
    """q and the pools bit for bit; the output within fp32 rounding (no FMA contraction in the
    fused kernel, another merge layout), stored in dtype."""
    for name, got, want in zip(("q", "out", "k_pool", "v_pool"), fused, three, strict=True):
        if name == "out":
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            assert not got.isnan().any()
        else:
            assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", GPU_CASES)
def test_cuda_fused_equals_the_three_kernels(dtype, shape):
    b, hq, hkv, d, rot, width, lens, window, with_sinks = shape
    case, sinks = attend_case(b, hq, hkv, d, rot, width, lens, dtype, device="cuda", seed=b)
    sinks = sinks if with_sinks else None
    from ops.paged_attend_fused_triton import fused_rope_attend

    assert fused_attend_for(torch.device("cuda")) is fused_rope_attend  # on by default
    for _ in range(2):  # the counters reset: a second call is the same
        fused = run_path("fused", case, hq, window, sinks)
        _assert_fused_matches_three(fused, run_path("three", case, hq, window, sinks), dtype)
    ref = run_path("torch", case, hq, window, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused[1].cpu().float(), ref[1].float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_with_changing_kv_lens(dtype):
    from ops.paged_attend_fused_triton import _counters, fused_rope_attend

    b, hq, hkv, d, rot, width = 3, 16, 4, 128, 128, 128  # 512 keys: several splits
    case, sinks = attend_case(b, hq, hkv, d, rot, width, [300, 0, 9], dtype, device="cuda")
    qkv, cos, sin, k_pool, v_pool, slots, tables, kv_lens = case
    static = [x.clone() for x in (qkv, cos, sin)]
    pools = (k_pool.clone(), v_pool.clone())
    args = dict(num_q_heads=hq, block_size=BLOCK, sm_scale=d**-0.5, sinks=sinks, window=None)
    fused_rope_attend(*static, *pools, slots, tables, kv_lens, **args)  # makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_rope_attend(*static, *pools, slots, tables, kv_lens, **args)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step, new_lens in enumerate(([301, 0, 10], [64, 0, 1], [511, 0, 200])):
        kv_lens.copy_(torch.tensor(new_lens))
        pos = (kv_lens - 1).clamp(min=0)
        page = tables.gather(1, (pos // BLOCK)[:, None])[:, 0]
        slots.copy_(torch.where(kv_lens > 0, page * BLOCK + pos % BLOCK, slots))
        for x in static:
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(dtype))
        want = run_path("three", (*static, *pools, slots, tables, kv_lens), hq, None, sinks)
        graph.replay()
        torch.cuda.synchronize()
        _assert_fused_matches_three((want[0], out, *pools), want, dtype)
        assert not _counters[torch.device("cuda", 0)].any(), step


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_static_view_runs_the_fused_kernel_unless_switched_off(monkeypatch):
    from types import SimpleNamespace

    from torch_runner.runner.cuda_graphs import StaticPagedView

    b, hq, hkv, d = 2, 8, 2, 64
    case, sinks = attend_case(b, hq, hkv, d, 64, 64, [150, 3], torch.bfloat16, device="cuda")
    qkv, cos, sin, k_pool, v_pool, slots, tables, kv_lens = case
    results = {}
    for mode in ("on", "off"):
        monkeypatch.setattr(paged_attention, "_FUSED", {})
        monkeypatch.setenv(ENV_FUSED_ATTEND, mode)
        pool = SimpleNamespace(k_layers=[k_pool.clone()], v_layers=[v_pool.clone()],
                               block_size=BLOCK)  # fmt: skip
        view = StaticPagedView(pool, 0, slots, tables, kv_lens)
        out = view.attend_qkv(qkv, cos, sin, hq, sm_scale=d**-0.5, sinks=sinks)
        results[mode] = (out, pool.k_layers[0], pool.v_layers[0])
        assert (fused_attend_for(qkv.device) is None) == (mode == "off")
    assert torch.equal(results["on"][1], results["off"][1])
    assert torch.equal(results["on"][2], results["off"][2])
    torch.testing.assert_close(results["on"][0].float(), results["off"][0].float(), rtol=1e-2,
                               atol=1e-2)  # fmt: skip
