"""MXFP4 gpt-oss experts: dequantisation, a real-layout checkpoint, and experts kept packed.

Oracles: a pure-Python per-element decoder written from the format description (low nibble =
even element, scale 2^(s-127), FP4 E2M1 table), transformers' own `convert_moe_packed_tensors`,
and transformers loading the same MXFP4 folder (it dequantises on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import VOCAB_SIZE, build_tiny_model

import models
from models.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_weights

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_fp4(code: int) -> float:
    magnitude = E2M1[code & 0b111]
    return -magnitude if code & 0b1000 else magnitude


def random_mxfp4(shape_blocks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape_blocks, dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 132, shape_blocks[:-1], dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_dequantize_matches_per_element_reference():
    blocks, scales = random_mxfp4((2, 3, 2, 16))  # [E, R, G, 16] -> dense [E, 64, 3]
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (2, 64, 3)
    for e in range(2):
        for r in range(3):
            for g in range(2):
                scale = 2.0 ** (int(scales[e, r, g]) - 127)
                for j in range(16):
                    byte = int(blocks[e, r, g, j])
                    col = g * 32 + 2 * j
                    assert got[e, col, r].item() == decode_fp4(byte & 0x0F) * scale
                    assert got[e, col + 1, r].item() == decode_fp4(byte >> 4) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((4, 96, 3, 16), seed=1)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_blocks_without_scales_is_an_error_naming_the_tensor():
    blocks, _ = random_mxfp4((1, 2, 1, 16))
    with pytest.raises(ValueError, match="experts.down_proj_scales"):
        dequantize_mxfp4_weights({"experts.down_proj_blocks": blocks}, torch.float32)


def write_mxfp4_gpt_oss(directory, seed=0, **overrides):
    """A tiny gpt-oss folder laid out like the real checkpoints: experts as _blocks/_scales."""
    reference = build_tiny_model("gpt_oss", seed=seed, **overrides)
    reference.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {}
    for i, (name, value) in enumerate(reference.state_dict().items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            num_experts, cols, rows = value.shape  # dense [E, C, R] = transposed [R, C] matrices
            blocks, scales = random_mxfp4((num_experts, rows, cols // 32, 16), seed=seed + i)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@torch.no_grad()
def test_mxfp4_checkpoint_matches_transformers_dequantised_model(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_mxfp4_gpt_oss(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = models.load_model(path, device="cpu", dtype="float32", moe_weights="dequantized")
    for layer_idx, hf_layer in enumerate(hf.model.layers):
        our_experts = ours.model.model.layers[layer_idx].mlp.experts
        assert torch.equal(our_experts.gate_up_proj, hf_layer.mlp.experts.gate_up_proj.float())
        assert torch.equal(our_experts.down_proj, hf_layer.mlp.experts.down_proj.float())
    ids = torch.randint(3, VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(2))
    want = hf(ids).logits
    got = ours.model.compute_logits(ours.model(ids, torch.arange(64)[None], None))
    assert (got - want).abs().max().item() < 1e-4


def _logits(loaded, ids):
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return loaded.model.compute_logits(loaded.model(ids, positions, None))


def _tensor_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@torch.no_grad()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_experts_equal_the_dequantised_reference(tmp_path, dtype):
    path = write_mxfp4_gpt_oss(tmp_path)
    packed = models.load_model(path, device="cpu", dtype=dtype)
    dense = models.load_model(path, device="cpu", dtype=dtype, moe_weights="dequantized")
    experts = packed.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not hasattr(experts, "gate_up_proj")  # no dense copy anywhere
    ids = torch.randint(3, VOCAB_SIZE, (2, 48), generator=torch.Generator().manual_seed(4))
    got, want = _logits(packed, ids), _logits(dense, ids)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)  # the CPU path multiplies exactly as the reference does


def test_packed_model_weights_are_the_checkpoint_size(tmp_path):
    """Resident weights of the packed model are the checkpoint's bytes (same dtype: fp32 tiny
    model); the dequantised reference is larger by the expanded experts."""
    path = write_mxfp4_gpt_oss(tmp_path)
    on_disk = (path / "model.safetensors").stat().st_size
    packed = models.load_model(path, device="cpu", dtype="float32").model
    dense = models.load_model(path, device="cpu", dtype="float32", moe_weights="dequantized").model
    assert _tensor_bytes(packed) <= 1.1 * on_disk
    assert _tensor_bytes(dense) > 1.5 * on_disk


def test_scales_of_the_wrong_shape_are_an_error_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file

    path = write_mxfp4_gpt_oss(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(models.ModelLoadError, match="model.layers.1.mlp.experts.down_proj_blocks"):
        models.load_model(path, device="cpu", dtype="float32")


def test_unknown_moe_weights_value_is_an_error_listing_the_allowed(tmp_path):
    path = write_mxfp4_gpt_oss(tmp_path)
    with pytest.raises(models.ModelLoadError, match="moe_weights='int3'.*packed, dequantized"):
        models.load_model(path, device="cpu", moe_weights="int3")


def test_engine_greedy_with_packed_experts_equals_transformers(tmp_path):
    from engine_helpers import byte_tokenizer, hf_greedy
    from transformers import AutoModelForCausalLM

    from torch_runner import Engine, SamplingParams

    path = write_mxfp4_gpt_oss(tmp_path)
    byte_tokenizer().save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = Engine(str(path), device="cpu", dtype="float32", max_total_tokens=512, block_size=4)
    prompts = [[5, 6, 7], list(range(20, 45))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_experts_on_cuda_equal_the_dequantised_reference(tmp_path):
    """Each layer's MoE of the packed model on CUDA (the Triton kernel) against the same layer of
    the dequantised model, on the same hidden states."""
    path = write_mxfp4_gpt_oss(tmp_path)
    packed = models.load_model(path, device="cuda", dtype="float32").model
    dense = models.load_model(path, device="cuda", dtype="float32", moe_weights="dequantized").model
    gen = torch.Generator(device="cuda").manual_seed(5)
    for ours, ref in zip(packed.model.layers, dense.model.layers):
        assert ours.mlp.experts.gate_up_proj_blocks.is_cuda
        hidden = torch.randn(2, 24, packed.args.hidden_size, device="cuda", generator=gen)
        want = ref.mlp(hidden)
        scale = want.abs().max().item()
        torch.testing.assert_close(ours.mlp(hidden) / scale, want / scale, rtol=0, atol=1e-5)
