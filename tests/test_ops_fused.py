"""The fused decode ops (ops/fused, behind ops.norm / ops.rope / ops.activation).

Oracles: off CUDA each op is the torch composition it replaces, and the decoder layer that
carries the residual stream through `ops.add_rms_norm` must give the unfused layer's values
bit for bit (CPU). On CUDA (GPU-marked) every Triton kernel is compared with the same op run on
the CPU copies of the same random inputs (the torch reference): rope and the pool write exactly,
the norm and activations within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import save_tiny_checkpoint

import models
import ops
import ops.fused
from ops.activation import clamped_swiglu, silu_mul
from ops.norm import add_rms_norm, rms_norm
from ops.rope import rope_kv_write, rope_tables, rotate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LIMIT, ALPHA = 7.0, 1.702


def hf_swiglu(h: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts activation (gate/up interleaved), written out."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=LIMIT)
    up = up.clamp(min=-LIMIT, max=LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_off_cuda_is_the_add_then_the_registered_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 5, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(64, generator=gen).to(dtype)
    normed, stream = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(stream, x + r) and torch.equal(stream, r + x)
    assert torch.equal(normed, rms_norm(x + r, w, 1e-5))
    first, same = add_rms_norm(x, None, w, 1e-5)  # the first layer: no residual yet
    assert same is x and torch.equal(first, rms_norm(x, w, 1e-5))
    with pytest.raises(ValueError, match="add_rms_norm: residual must have x's shape"):
        add_rms_norm(x, r[:, :1], w, 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm: weight must be \\[64\\]"):
        add_rms_norm(x, r, w[:8], 1e-5)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_carrying_the_residual_equals_the_unfused_layer_bit_for_bit(tmp_path, dtype):
    loaded = models.load_model(
        save_tiny_checkpoint("llama", tmp_path), device="cpu", dtype="float32"
    )
    model = loaded.model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 6, loaded.args.hidden_size, generator=gen).to(dtype)
    positions = torch.arange(6).expand(2, -1)
    rope = model.model.rotary.at(positions, dtype)
    x, residual = h, None
    for layer in model.model.layers:
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        mid = h + layer.self_attn(rms_norm(h, ln1.weight, ln1.eps), positions, rope, None)
        h = mid + layer.mlp(rms_norm(mid, ln2.weight, ln2.eps))  # the unfused block
        x, residual = layer(x, positions, rope, None, residual)
        assert torch.equal(x + residual, h)
    final = model.model.norm
    assert torch.equal(
        add_rms_norm(x, residual, final.weight, final.eps)[0], rms_norm(h, final.weight, final.eps)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_off_cuda_are_the_torch_expressions(dtype):
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(7, 2 * 48, generator=gen) * 4).to(dtype)
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(silu_mul(h), F.silu(gate) * up)
    assert torch.equal(clamped_swiglu(h, LIMIT, ALPHA), hf_swiglu(h))
    bias = torch.randn(3, 2 * 48, generator=gen).to(dtype)
    rows = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    assert torch.equal(clamped_swiglu(h, LIMIT, ALPHA, bias, rows), hf_swiglu(h + bias[rows]))
    with pytest.raises(ValueError, match="bias and bias_rows go together"):
        clamped_swiglu(h, LIMIT, ALPHA, bias, None)


def _rope_inputs(device, dtype, t=5, hq=8, hkv=2, d=64, rot=64, slots=40):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    positions = torch.randint(0, 4000, (t, 1), generator=gen)
    cos, sin = rope_tables(positions, inv_freq, 1.0, dtype)  # [T, 1, 1, D_rot]
    write = torch.randperm(slots, generator=gen)[:t]
    pools = [torch.full((slots, hkv, d), float("nan"), dtype=dtype) for _ in range(2)]
    tensors = [x.to(device) for x in (qkv, cos.reshape(t, rot), sin.reshape(t, rot), *pools)]
    inputs = torch.zeros(t, 4, dtype=torch.int64, device=device)  # like the graph's inputs
    inputs[:, 3] = write.to(device)
    return [*tensors, inputs[:, 3]], hq  # slots: a strided column, as the graph passes them


@pytest.mark.parametrize("rot", [64, 32])
def test_rope_kv_write_off_cuda_rotates_q_and_k_and_writes_k_v_to_their_slots(rot):
    (qkv, cos, sin, k_pool, v_pool, slots), hq = _rope_inputs("cpu", torch.float32, rot=rot)
    q = rope_kv_write(qkv, cos, sin, k_pool, v_pool, slots, hq)
    qk = rotate(qkv[:, None, : hq + 2], cos[:, None, None], sin[:, None, None])[:, 0]
    assert torch.equal(q, qk[:, :hq])
    assert torch.equal(k_pool[slots], qk[:, hq:]) and torch.equal(v_pool[slots], qkv[:, hq + 2 :])
    untouched = torch.ones(k_pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all()
    with pytest.raises(ValueError, match="rope_kv_write: qkv"):
        rope_kv_write(qkv[:, :-1], cos, sin, k_pool, v_pool, slots, hq)


def test_fused_kernels_are_cuda_only():
    assert ops.fused.kernels_for(torch.ones(2)) is None


# ---- the Triton kernels against the torch reference (the same op on the CPU copies) ----


def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    out, ref = out.cpu().float(), ref.float()
    assert not out.isnan().any()
    rel = (out - ref).norm() / ref.norm()
    assert rel < (3e-3 if dtype == torch.bfloat16 else 1e-6), rel
    if dtype == torch.bfloat16:  # each element within one bf16 rounding step of the reference
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 2048, 2880, 4096])
@pytest.mark.parametrize("has_residual", [True, False])
def test_add_rms_norm_kernel_equals_the_torch_op(dtype, hidden, has_residual):
    assert ops.fused.cuda_kernels() is not None  # Triton imports on the GPU machine
    for seed in range(2):  # fresh inputs per check
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(9, hidden, generator=gen).to(dtype) * 3
        r = torch.randn(9, hidden, generator=gen).to(dtype) if has_residual else None
        w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        ref_norm, ref_sum = add_rms_norm(x, r, w, 1e-5)
        cuda = [None if t is None else t.cuda() for t in (x, r, w)]
        out_norm, out_sum = add_rms_norm(cuda[0], cuda[1], cuda[2], 1e-5)
        assert torch.equal(out_sum.cpu(), ref_sum)  # the residual add rounds like torch's
        _close(out_norm, ref_norm, dtype)
        _close(rms_norm(cuda[0], None, 1e-6), rms_norm(x, None, 1e-6), dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [48, 2880, 8192])
def test_activation_kernels_equal_the_torch_ops(dtype, inter):
    for seed in range(2):
        gen = torch.Generator().manual_seed(10 + seed)
        h = (torch.randn(6, 2 * inter, generator=gen) * 5).to(dtype)
        bias = torch.randn(4, 2 * inter, generator=gen).to(dtype)
        rows = torch.randint(0, 4, (6,), generator=gen)
        _close(silu_mul(h.cuda()), silu_mul(h), dtype)
        _close(clamped_swiglu(h.cuda(), LIMIT, ALPHA), hf_swiglu(h), dtype)
        out = clamped_swiglu(h.cuda(), LIMIT, ALPHA, bias.cuda(), rows.cuda())
        _close(out, hf_swiglu(h + bias[rows]), dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("d", "rot", "hq", "hkv"), [(64, 64, 32, 8), (128, 128, 32, 8),
                                                      (64, 32, 8, 2), (64, 64, 64, 8)])  # fmt: skip
def test_rope_kv_write_kernel_equals_the_torch_op_exactly(dtype, d, rot, hq, hkv):
    (qkv, cos, sin, k_ref, v_ref, slots), _ = _rope_inputs("cpu", dtype, 7, hq, hkv, d, rot)
    ref = rope_kv_write(qkv, cos, sin, k_ref, v_ref, slots, hq)
    (qkv, cos, sin, k_pool, v_pool, slots), _ = _rope_inputs("cuda", dtype, 7, hq, hkv, d, rot)
    q = rope_kv_write(qkv, cos, sin, k_pool, v_pool, slots, hq)
    assert torch.equal(q.cpu(), ref)
    assert torch.equal(k_pool.cpu().nan_to_num(7.0), k_ref.nan_to_num(7.0))  # written rows
    assert torch.equal(v_pool.cpu().nan_to_num(7.0), v_ref.nan_to_num(7.0))  # and untouched
