"""Packed MXFP4 experts (ops/quant): every backend against the dequantised-weight oracle.

The oracle is ops.moe.moe_gpt_oss over dense experts from models.mxfp4.dequantize_mxfp4 (itself
pinned to transformers' converter and a per-element decoder in test_models_mxfp4.py). The
Triton kernel runs on CUDA, or on the CPU through Triton's interpreter when triton is installed
(it is not a test dependency; the CUDA test runs on the GPU box).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from models.mxfp4 import dequantize_mxfp4
from ops.moe import moe_gpt_oss
from ops.quant import mxfp4
from ops.quant.mxfp4 import Mxfp4Experts, dequantize_rows, moe_gpt_oss_mxfp4

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 4, 64, 96, 2
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def random_packed(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(
        0, 256, (NUM_EXPERTS, rows, cols // 32, 16), dtype=torch.uint8, generator=gen
    )
    scales = torch.randint(
        119, 125, (NUM_EXPERTS, rows, cols // 32), dtype=torch.uint8, generator=gen
    )
    return Mxfp4Experts(blocks, scales)


def moe_case(num_tokens, dtype, device="cpu", seed=0):
    """(packed args, dense-oracle args) for one gpt-oss MoE call; same routing in both."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = (
        random_packed(2 * INTER, HIDDEN, seed + 1),
        random_packed(HIDDEN, INTER, seed + 2),
    )

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, router_w, router_b = rand(num_tokens, HIDDEN), rand(NUM_EXPERTS, HIDDEN), rand(NUM_EXPERTS)
    gate_up_b, down_b = rand(NUM_EXPERTS, 2 * INTER) * 0.1, rand(NUM_EXPERTS, HIDDEN) * 0.1

    def on_device(p):
        return Mxfp4Experts(p.blocks.to(device), p.scales.to(device))

    packed = (x, router_w, router_b, on_device(gate_up), gate_up_b, on_device(down), down_b)
    dense = (
        x, router_w, router_b, dequantize_mxfp4(gate_up.blocks, gate_up.scales, dtype).to(device),
        gate_up_b, dequantize_mxfp4(down.blocks, down.scales, dtype).to(device), down_b,
    )  # fmt: skip
    return packed, dense


def assert_close(got, want, dtype):
    """fp32: within 1e-5. bf16: within a few bf16 roundings (2^-8 each) of the output's scale,
    since the two sides round the matmul, bias and SwiGLU intermediates at different points."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=2**-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_rows_equals_the_reference_dequantiser(dtype):
    packed = random_packed(48, 96, seed=3)
    want = dequantize_mxfp4(packed.blocks, packed.scales, dtype)  # [E, C, R]
    assert torch.equal(mxfp4.dequantize(packed, dtype), want)
    assert torch.equal(dequantize_rows(packed.blocks[1], packed.scales[1], dtype), want[1].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_torch_packed_moe_equals_dequantised_reference_bit_for_bit(dtype, num_tokens):
    packed, dense = moe_case(num_tokens, dtype)
    got = moe_gpt_oss(*packed, top_k=TOP_K)  # ops.moe dispatches on the packed type
    assert torch.equal(got, moe_gpt_oss(*dense, top_k=TOP_K))


def test_row_tiles_bound_the_dequantised_temporaries(monkeypatch):
    """Tiles of 2 rows (instead of the whole expert) give the same result."""
    packed, dense = moe_case(5, torch.float32)
    seen = []
    real = mxfp4.dequantize_rows

    def spy(blocks, scales, dtype):
        seen.append(blocks.shape[0])
        return real(blocks, scales, dtype)

    monkeypatch.setattr(mxfp4, "TILE_ELEMENTS", 2 * INTER)  # 2 rows of down (in = INTER)
    monkeypatch.setattr(mxfp4, "dequantize_rows", spy)
    got = moe_gpt_oss_mxfp4(*packed, top_k=TOP_K)
    assert max(seen) == 3  # gate_up rows hold HIDDEN values: 3 rows per tile; down: 2
    assert_close(got, moe_gpt_oss(*dense, top_k=TOP_K), torch.float32)


def test_only_routed_experts_are_dequantised(monkeypatch):
    packed, _ = moe_case(1, torch.float32)
    calls = []
    real = mxfp4.dequantize_rows
    monkeypatch.setattr(
        mxfp4, "dequantize_rows", lambda b, s, d: calls.append(b.shape) or real(b, s, d)
    )
    moe_gpt_oss_mxfp4(*packed, top_k=TOP_K)
    assert len(calls) == 2 * TOP_K  # one gate_up and one down per routed expert, nothing else


def test_mismatched_scales_are_an_error_naming_the_shapes():
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blocks \(2, 4, 3, 16\) do not match scales \(2, 4, 2\)"):
        Mxfp4Experts(blocks, torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        Mxfp4Experts(blocks, torch.zeros(2, 4, 3))


TRITON_INTERPRETER_CHECK = """
import torch
from test_ops_quant_mxfp4 import TOP_K, moe_case
from ops.moe import moe_gpt_oss
from ops.quant.mxfp4_triton import moe_experts_mxfp4
# the interpreter's bf16 tl.dot is wrong (numpy has no bf16): the grouped bf16 path is GPU-only
BYTES = {"gemv": ((16, 4, 4, False), (16, 4, 4, False)), "grouped": (64, 2, 4, 3, False)}
cases = [(1, "gemv", torch.float32, None), (5, "gemv", torch.float32, None),
         (5, "gemv", torch.float32, BYTES["gemv"]), (1, "gemv", torch.bfloat16, None),
         (5, "gemv", torch.bfloat16, BYTES["gemv"]), (1, "grouped", torch.float32, None),
         (9, "grouped", torch.float32, None), (9, "grouped", torch.float32, BYTES["grouped"])]
for num_tokens, formulation, dtype, config in cases:
    packed, dense = moe_case(num_tokens, dtype, seed=num_tokens)
    x, rw, rb, gu, gub, dn, dnb = packed
    top_val, top_idx = torch.topk(torch.nn.functional.linear(x, rw, rb), TOP_K)
    scores = torch.softmax(top_val, -1)
    got = moe_experts_mxfp4(x, top_idx, scores, gu, gub, dn, dnb, 7.0, 1.702,
                            formulation=formulation, config=config)
    want = moe_gpt_oss(*(t.float() if t.is_floating_point() else t for t in dense), top_k=TOP_K)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16: the SwiGLU output and the MoE output are rounded (assert_close's bound)
        scale = want.abs().max()
        torch.testing.assert_close(got.float() / scale, want / scale, rtol=0, atol=2**-6)
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_triton_kernel_equals_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", TRITON_INTERPRETER_CHECK],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_cuda_packed_moe_equals_reference_without_host_sync(dtype, num_tokens):
    packed, dense = moe_case(num_tokens, dtype, device="cuda")
    want = moe_gpt_oss(*dense, top_k=TOP_K)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the packed path raises
    try:
        got = moe_gpt_oss(*packed, top_k=TOP_K)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("formulation", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 9, 70])
def test_cuda_kernels_equal_reference_in_both_formulations(formulation, dtype, num_tokens):
    from ops.quant.mxfp4_triton import moe_experts_mxfp4

    packed, dense = moe_case(num_tokens, dtype, device="cuda", seed=num_tokens)
    x, rw, rb, gu, gub, dn, dnb = packed
    top_val, top_idx = torch.topk(torch.nn.functional.linear(x, rw, rb), TOP_K)
    scores = torch.softmax(top_val, -1)
    got = moe_experts_mxfp4(x, top_idx, scores, gu, gub, dn, dnb, 7.0, 1.702,
                            formulation=formulation)  # fmt: skip
    want = moe_gpt_oss(*dense, top_k=TOP_K)
    assert_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [3, 40])
def test_cuda_packed_moe_expert_parallel_part_equals_reference(num_tokens):
    """Experts [1, 3) of 4 on this rank: several slots of a token can point at local expert 0."""
    packed, dense = moe_case(num_tokens, torch.float32, device="cuda", seed=7)

    def local(args):
        x, rw, rb, gu, gub, dn, dnb = args
        if isinstance(gu, Mxfp4Experts):
            gu, dn = (Mxfp4Experts(p.blocks[1:3].contiguous(), p.scales[1:3].contiguous())
                      for p in (gu, dn))  # fmt: skip
        else:
            gu, dn = gu[1:3].contiguous(), dn[1:3].contiguous()
        return x, rw, rb, gu, gub[1:3].contiguous(), dn, dnb[1:3].contiguous()

    got = moe_gpt_oss(*local(packed), top_k=TOP_K, expert_start=1)
    want = moe_gpt_oss(*local(dense), top_k=TOP_K, expert_start=1)
    assert_close(got, want, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_packed_moe_replays_in_a_cuda_graph():
    packed, dense = moe_case(4, torch.bfloat16, device="cuda")
    static_x = packed[0].clone()
    args = (static_x, *packed[1:])
    for _ in range(2):  # warm-up compiles the kernels outside the capture
        moe_gpt_oss(*args, top_k=TOP_K)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_gpt_oss(*args, top_k=TOP_K)
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    want = moe_gpt_oss(new_x, *dense[1:], top_k=TOP_K)
    assert_close(static_out, want, torch.bfloat16)


HAS_MLX = importlib.util.find_spec("mlx") is not None


@pytest.mark.skipif(not HAS_MLX, reason="mlx not installed")
def test_checkpoint_layout_is_mlx_mxfp4_layout():
    """mx.dequantize of the checkpoint bytes viewed as uint32 equals our decoder, and
    mx.quantize of those values gives back the same scales and the same values."""
    import mlx.core as mx
    import numpy as np

    from ops.mlx.mxfp4 import _as_mlx_weight

    packed = random_packed(8, 64, seed=5)
    want = dequantize_rows(packed.blocks, packed.scales, torch.float32).numpy()  # [E, R, C]
    weight = _as_mlx_weight(mx.array(packed.blocks.numpy()))
    scales = mx.array(packed.scales.numpy())
    got = mx.dequantize(weight, scales, group_size=32, bits=4, mode="mxfp4")
    assert np.array_equal(np.array(got.astype(mx.float32)), want)
    requant, rescales = mx.quantize(mx.array(want), group_size=32, bits=4, mode="mxfp4")
    assert np.array_equal(np.array(rescales), packed.scales.numpy())
    back = mx.dequantize(requant, rescales, group_size=32, bits=4, mode="mxfp4")
    assert np.array_equal(np.array(back.astype(mx.float32)), want)  # codes differ only in -0/+0


@pytest.mark.skipif(not HAS_MLX, reason="mlx not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlx_packed_moe_equals_dequantised_reference(dtype, monkeypatch):
    from ops.mlx.moe import moe_gpt_oss as moe_gpt_oss_mlx

    packed, dense = moe_case(6, dtype)
    got = moe_gpt_oss_mlx(*packed, top_k=TOP_K)
    want = moe_gpt_oss(*dense, top_k=TOP_K)
    if dtype == torch.float32:  # MLX's CPU qmm sums in another order: relative to the output scale
        scale = want.abs().max().item()
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-5)
    else:
        assert_close(got, want, dtype)
    assert got.dtype == dtype


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_top_k_softmax_equals_torch_topk_softmax(dtype):
    """Same experts (ties included: two experts share weights) and scores within rounding."""
    from ops.routing_triton import top_k_softmax

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 2880, generator=gen).to("cuda", dtype)
    w = (torch.randn(32, 2880, generator=gen) * 0.02).to("cuda", dtype)
    b = torch.randn(32, generator=gen).to("cuda", dtype)
    w[5], b[5] = w[4], b[4]  # exact ties between experts 4 and 5
    logits = torch.nn.functional.linear(x, w, b)
    idx, scores = top_k_softmax(logits, 4)
    top_val, top_idx = torch.topk(logits, 4)
    got, order = idx.long().sort(-1)  # slot order among equal logits is free
    want, want_order = top_idx.sort(-1)
    assert torch.equal(got, want)
    want_scores = torch.softmax(top_val.float(), -1).gather(1, want_order)
    torch.testing.assert_close(scores.gather(1, order), want_scores, rtol=0, atol=1e-2)
