"""The decode q/k/v projection with rope and the paged KV write in the GEMV's epilogue
(`ops.linear_rope_kv`, the GEMV's rope mode in ops/quant/gemv_epilogue.py): the values of the
GEMV followed by the rope + KV-write kernel, bit for bit (q, and the k / v pool rows at each
token's slot, nothing else touched), for fp8 / int8 / bf16 weights, the FMA and tensor-core
loops, split-K, several rows; on CPU through Triton's interpreter (skipped where triton is not
installed, as in CI), on CUDA for real (`pytest -m gpu`); off CUDA it is the torch composition.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from gemv_weights import random_weight
from triton_interpreter import assert_interpreter_ok

import ops
from ops.rope import rope_kv_write

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, Hq, Hkv, D, K, tile, tensor-core loop): one pair a program, split-K, several rows, a tile
# wider than a head, the table's tile (None)
ROPE_CASES = [(1, 4, 2, 16, 128, (2, 64, 1, 1), False), (2, 4, 1, 8, 96, (4, 32, 1, 3), False),
              (1, 2, 2, 32, 128, (16, 64, 1, 1), True), (3, 4, 2, 16, 128, (16, 64, 1, 2), True),
              (3, 2, 1, 4, 64, (64, 32, 1, 1), False), (1, 8, 2, 8, 64, None, False)]  # fmt: skip


def rope_case(m, hq, hkv, d, k, kind, seed, device="cpu"):
    """x [m, k] bf16, a [q | k | v] weight (e4m3 / int8 with a per-channel scale, or bf16), rope
    rows at scattered positions (`rope_tables`' cos / signed sin), pools of 40 slots filled with
    noise and m distinct write slots."""
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x = torch.randn(m, k, generator=gen).bfloat16()
    w, s = random_weight(n, k, kind, gen)
    pos = torch.randint(0, 4000, (m,), generator=gen)
    angle = pos[:, None].float() * 1e4 ** (-torch.arange(0, d, 2).float() / d)[None]  # [m, d/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1).bfloat16()
    signed_sin = torch.cat([-angle.sin(), angle.sin()], -1).bfloat16()
    slots = torch.randperm(40, generator=gen)[:m]
    pools = [torch.randn(40, hkv, d, generator=gen).bfloat16() for _ in range(2)]
    moved = [t if t is None else t.to(device) for t in (x, w, s, cos, signed_sin, slots)]
    return *moved, *(p.to(device) for p in pools)


INTERPRETER_CHECK = """
import torch
from test_gemv_rope import ROPE_CASES, rope_case
from ops.fused.triton_kernels import rope_kv_write
from ops.quant.gemv_epilogue import RopeKvTarget
from ops.quant.gemv_triton import _workspaces, gemv
for i, (m, hq, hkv, d, k, cfg, dot) in enumerate(ROPE_CASES):
    for kind in ("fp8", "bf16", "int8"):
        if kind == "int8" and dot:
            continue
        x, w, s, cos, sin, slots, kp, vp = rope_case(m, hq, hkv, d, k, kind, seed=i)
        kp2, vp2 = kp.clone(), vp.clone()
        qkv = gemv(x, w, s, cfg, dot=dot)  # the GEMV, then the rope + KV-write kernel
        want = rope_kv_write(qkv.view(m, -1, d), cos, sin, kp, vp, slots, hq)
        got = gemv(x, w, s, cfg, dot=dot, rope=RopeKvTarget(cos, sin, slots, kp2, vp2, hq))
        assert got.shape == (m, hq * d), got.shape
        assert torch.equal(got.view(m, hq, d), want), (i, kind)
        assert torch.equal(kp2, kp) and torch.equal(vp2, vp), (i, kind)  # other slots kept
        assert not torch.equal(want, qkv.view(m, -1, d)[:, :hq])  # rope did turn q
if _workspaces:
    assert not _workspaces[torch.device("cpu")][1].any()  # the split calls reset their counters
x, w, s, cos, sin, slots, kp, vp = rope_case(1, 4, 2, 16, 128, "fp8", seed=0)
for bad, word in [(RopeKvTarget(cos, sin, slots, kp[:, :1], vp, 4), "Hkv"),
                  (RopeKvTarget(cos[:, :8], sin[:, :8], slots, kp, vp, 4), "rotate all"),
                  (RopeKvTarget(cos, sin, slots, kp.transpose(1, 2).contiguous().transpose(1, 2),
                                vp, 4), "contiguous")]:
    try:
        gemv(x, w, s, rope=bad)
        raise SystemExit("a mismatched rope target passed")
    except ValueError as e:
        assert word in str(e), e
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_rope_gemv_equals_the_gemv_then_the_rope_kv_kernel_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_off_cuda_linear_rope_kv_is_linear_then_rope_kv_write(kind, monkeypatch):
    """CPU, the switch on: the torch composition (linear, rotate, index_copy_ into the pools),
    bit for bit, for a dense and an int8 weight with a bias."""
    from ops.quant.int_linear import quantize_int8

    monkeypatch.setattr(importlib.import_module("ops.linear"), "_ROPE_MODE", ["on"])
    x, w, _, cos, sin, slots, kp, vp = rope_case(3, 4, 2, 16, 64, "bf16", seed=5)
    weight = quantize_int8(w) if kind == "int8" else w
    bias = torch.randn(w.shape[0]).bfloat16()
    kp2, vp2 = kp.clone(), vp.clone()
    want = rope_kv_write(ops.linear(x, weight, bias).view(3, -1, 16), cos, sin, kp, vp, slots, 4)
    got = ops.linear_rope_kv(x, weight, bias, cos, sin, kp2, vp2, slots, 4)
    assert torch.equal(got, want) and torch.equal(kp2, kp) and torch.equal(vp2, vp)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
@pytest.mark.parametrize("hq,hkv,d,k", [(32, 8, 64, 2048), (32, 8, 128, 4096), (4, 2, 16, 304)])
@pytest.mark.parametrize("m", [1, 2, 9])
def test_cuda_qkv_with_rope_in_the_epilogue_equals_the_gemv_then_the_rope_kv_kernel(
    kind, hq, hkv, d, k, m, monkeypatch
):
    """ops.linear_rope_kv with the switch on, on an Fp8Weight / Int8Weight / bf16 weight at
    decode rows (the Llama-1B / 8B q/k/v projections and a small one): q and both pools equal
    ops.linear followed by the rope + KV-write kernel bit for bit; the rope kernel ran exactly
    where ops.linear would not run the GEMV (9 rows, past the GEMV, take the two kernels)."""
    from ops.quant import fp8, int_linear

    linear_module = importlib.import_module("ops.linear")
    monkeypatch.setattr(linear_module, "_ROPE_MODE", ["on"])
    x, w, _, cos, sin, slots, kp, vp = rope_case(
        m, hq, hkv, d, k, "bf16", seed=m + d, device="cuda"
    )
    quantize = {"fp8": fp8.quantize_fp8, "int8": int_linear.quantize_int8}.get(kind)
    weight = quantize(w * 0.1) if quantize else w
    if quantize:
        takes_gemv = weight.gemv_args(x) is not None
    else:
        takes_gemv = m == 1 and linear_module._route_for(x, weight, None) is not None
    qkv = ops.linear(x, weight)
    kp2, vp2 = kp.clone(), vp.clone()
    want = rope_kv_write(qkv.view(m, -1, d), cos, sin, kp, vp, slots, hq)
    calls = []
    monkeypatch.setattr(
        linear_module, "rope_kv_write", lambda *a: calls.append(1) or rope_kv_write(*a)
    )
    got = ops.linear_rope_kv(x, weight, None, cos, sin, kp2, vp2, slots, hq)
    assert (not calls) == takes_gemv, (calls, takes_gemv)
    assert torch.equal(got, want)
    assert torch.equal(kp2, kp) and torch.equal(vp2, vp)
