"""oneDNN-packed CPU matmul weights (`ops.pack_weight`, `pack_linear_weights`, the runner's
`weight_packing=auto`).

Contract: packing changes how the matrices are stored, not what the model computes. The oracle
is the same checkpoint loaded twice, one copy packed: logits agree to fp32 rounding, greedy
engine tokens are identical, the state dict keeps every HF name and shape, the dense copies of
packed matrices are freed, and dtypes this CPU cannot pack are left dense (never a crash).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import byte_tokenizer
from tiny_models import FAMILIES, VOCAB_SIZE, save_tiny_checkpoint
from torch import nn

import models
import ops
from models.layers import Attention, GatedMLP, pack_linear_weights
from torch_runner import Engine, SamplingParams

# the oneDNN packing is the torch kernels' path; the native ones (ops/cpu_native) wrap the weights
pytestmark = [
    pytest.mark.skipif(
        not ops.can_pack(torch.float32), reason="this torch build / CPU cannot pack fp32 weights"
    ),
    pytest.mark.usefixtures("torch_cpu_kernels"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    byte_tokenizer().save_pretrained(path)
    return path


def dense_bytes(model: nn.Module) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and not t.is_mkldnn:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 7)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_packed_linear_matches_dense(shape, has_bias):
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(11, 7, generator=gen), torch.randn(11, generator=gen)
    x = torch.randn(*shape, generator=gen)
    b = bias if has_bias else None
    want = F.linear(x, weight, b)
    torch.testing.assert_close(ops.linear(x, ops.pack_weight(weight), b), want)
    torch.testing.assert_close(ops.linear(x, weight, b), want)  # dense weights pass through
    strided = torch.randn(shape[0] * 2, *shape[1:], generator=gen)[::2]
    torch.testing.assert_close(
        ops.linear(strided, ops.pack_weight(weight), b), F.linear(strided, weight, b)
    )


def test_pack_weight_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        ops.pack_weight(torch.ones(4))


def test_packing_keeps_names_and_logits_and_frees_dense_copies(checkpoint):
    torch.set_num_threads(1)
    plain = models.load_model(checkpoint, device="cpu", dtype="float32").model
    packed = models.load_model(checkpoint, device="cpu", dtype="float32").model
    before = {k: tuple(v.shape) for k, v in packed.state_dict().items()}
    pack_linear_weights(packed)
    assert {k: tuple(v.shape) for k, v in packed.state_dict().items()} == before
    packed_bytes = 0
    for module in packed.modules():
        if isinstance(module, Attention):
            assert module.qkv_weight.is_mkldnn and module.o_proj.weight.is_mkldnn
            assert module.q_proj.weight.device.type == "meta"
            packed_bytes += (module.qkv_weight.numel() + module.o_proj.weight.numel()) * 4
        if isinstance(module, GatedMLP):
            assert module.gate_up_weight.is_mkldnn and module.down_proj.weight.is_mkldnn
            assert module.up_proj.weight.device.type == "meta"
            packed_bytes += (module.gate_up_weight.numel() + module.down_proj.weight.numel()) * 4
    assert packed_bytes and packed.lm_head.weight.is_mkldnn
    if plain.lm_head is not None:  # untied: the dense lm_head is freed too
        packed_bytes += plain.lm_head.weight.numel() * 4
    assert dense_bytes(packed) == dense_bytes(plain) - packed_bytes

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB_SIZE, (2, 9), generator=gen)
    positions = torch.arange(9).expand(2, -1)
    with torch.inference_mode():
        want = plain.compute_logits(plain(ids, positions))
        got = packed.compute_logits(packed(ids, positions))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_weight_packing_auto_equals_off(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 17, 3], [11, 4, 8, 30, 2, 7, 19]]
    outs = {}
    for packing in ("auto", "off"):
        engine = Engine(checkpoint, device="cpu", dtype="float32", weight_packing=packing,
                        max_total_tokens=512)  # fmt: skip
        assert engine.runner.is_packed == (packing == "auto")
        outs[packing] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outs["auto"] == outs["off"]


def test_unpackable_dtype_stays_dense(checkpoint):
    engine = Engine(checkpoint, device="cpu", dtype="bfloat16", max_total_tokens=512)
    assert engine.runner.is_packed == ops.can_pack(torch.bfloat16)
    out = engine.generate(
        [[5, 9, 17]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 4


def test_weight_packing_rejects_unknown_value():
    with pytest.raises(ValueError, match="weight_packing='onednn'.*auto, off"):
        Engine(None, device="cpu", weight_packing="onednn")


@pytest.mark.parametrize("rows", [1, 7])
def test_linear_add_is_linear_plus_residual_bit_for_bit(rows):
    """The packed path adds the residual inside the matmul (oneDNN post-op): same bits."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 160, generator=gen), torch.randn(96, generator=gen)
    x, residual = torch.randn(rows, 160, generator=gen), torch.randn(rows, 96, generator=gen)
    want = F.linear(x, weight, bias) + residual
    assert torch.equal(ops.linear_add(x, weight, bias, residual), want)
    if ops.can_pack(torch.float32):
        packed = ops.pack_weight(weight)
        want = ops.linear(x, packed, bias) + residual
        assert torch.equal(ops.linear_add(x, packed, bias, residual), want)
