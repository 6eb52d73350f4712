"""fp8 (e4m3) weights: checkpoints with per-tensor / per-channel / block scales, `quantization=fp8`.

Oracle: the fp8 weights dequantised with plain torch ops (fp8 -> fp32 times the scale) written as
an ordinary fp32 checkpoint (tests/fp8_checkpoints.py) and loaded by the same loader: on CPU the
reference path must give exactly its logits; transformers' model on the same weights checks the
pair. The CUDA `_scaled_mm` path is tested on the H200 (tests/test_cuda_quant_fp8_int.py).
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import rewrite, write_fp8_checkpoint
from tiny_models import VOCAB_SIZE, build_tiny_model

import models
import ops
from models.quantize import quantize_linears_fp8
from ops.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight, dequantize, quantize_fp8

pytestmark = pytest.mark.usefixtures("one_thread")
LAYOUTS = ("tensor", "channel", "block")


def ids(length=24, seed=1):
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def logits(loaded, tokens):
    model = loaded.model
    return model.compute_logits(model(tokens, torch.arange(tokens.shape[1])[None], None))


def test_per_channel_quantization_maps_each_row_max_to_448_and_rounds_within_e4m3():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    packed = quantize_fp8(w)
    assert packed.weight.dtype == FP8_DTYPE and packed.scale.shape == (48,)
    assert torch.equal(packed.weight.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    deq = dequantize(packed.weight, packed.scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, subnormals (below 2^-6) absolutely
    bound = torch.maximum(w.abs() * 2**-4, packed.scale[:, None] * 2**-10)
    assert ((deq - w).abs() <= bound + 1e-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_equals_the_dense_matmul_of_the_dequantised_weight(dtype):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    scale = torch.rand(2, 3) * 1e-3 + 1e-4  # 32x32 blocks
    q = (w / scale.repeat_interleave(32, 0).repeat_interleave(32, 1)).to(FP8_DTYPE)
    x = torch.randn(2, 3, 96).to(dtype)
    for weight in (quantize_fp8(w.to(dtype)), Fp8Weight(q, scale, dtype, block=(32, 32))):
        dense = weight.dequantize()
        assert dense.dtype == dtype
        assert torch.equal(ops.linear(x, weight), torch.nn.functional.linear(x, dense))


@torch.no_grad()
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_logits_equal_the_dequantised_checkpoint_exactly(tmp_path, layout, caplog):
    fp8_dir, dense_dir = write_fp8_checkpoint(tmp_path, layout)
    with caplog.at_level("WARNING"):
        loaded = models.load_model(fp8_dir, device="cpu", dtype="float32")
    assert "fp8 checkpoint on cpu" in caplog.text and "reference path" in caplog.text
    qkv = loaded.model.model.layers[0].self_attn.qkv_weight
    assert isinstance(qkv, Fp8Weight) and qkv.weight.dtype == FP8_DTYPE
    assert (qkv.block is not None) == (layout == "block")
    assert isinstance(loaded.model.lm_head.weight, torch.Tensor)  # not in the checkpoint's fp8
    oracle = models.load_model(dense_dir, device="cpu", dtype="float32")
    tokens = ids()
    want = logits(oracle, tokens)
    assert torch.equal(logits(loaded, tokens), want)
    # quantization=none: the same weights dequantised at load, the dense path
    dense = models.load_model(fp8_dir, device="cpu", dtype="float32", quantization="none")
    assert isinstance(dense.model.model.layers[0].self_attn.qkv_weight, torch.Tensor)
    assert torch.equal(logits(dense, tokens), want)
    # and the pair agrees with transformers on the dequantised weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dense_dir, attn_implementation="eager").eval()
    torch.testing.assert_close(want, hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_engine_greedy_on_an_fp8_checkpoint_equals_the_dequantised_one(tmp_path):
    from torch_runner import Engine, SamplingParams

    fp8_dir, dense_dir = write_fp8_checkpoint(tmp_path, "channel")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 45))]
    outs = [
        [o.token_ids for o in Engine(str(d), device="cpu", max_total_tokens=512).generate(
            prompts, params)]
        for d in (fp8_dir, dense_dir)
    ]  # fmt: skip
    assert outs[0] == outs[1]


@torch.no_grad()
@pytest.mark.parametrize("tied", [False, True])
def test_fp8_quantization_of_a_dense_model_equals_its_fake_quantised_weights(tied):
    """`quantize_linears_fp8` (what --quantization fp8 applies on a GPU), run on CPU where the
    reference path computes: equal to the model with each weight replaced by its dequantisation."""
    from models.loader import fuse_projections

    hf = build_tiny_model("llama", tie_word_embeddings=tied)
    dense = hf.state_dict()
    oracle = {k: v.clone() for k, v in dense.items()}
    for name, w in dense.items():
        if ".layers." in name and name.endswith("proj.weight") or name == "lm_head.weight":
            packed = quantize_fp8(w)
            oracle[name] = dequantize(packed.weight, packed.scale)
    tokens = ids()
    family = models.registry.get_family("llama")
    args = family.ModelArgs.from_hf_config(hf.config)

    def build(state):
        model = family.Model(args).eval()
        model.load_state_dict(state, strict=False)
        fuse_projections(model)
        return model

    model = build(dense)
    assert quantize_linears_fp8(model) == 3 * 4 + 1
    if tied:  # the head is an fp8 copy of the embedding, the lookup table stays dense
        oracle_head = quantize_fp8(dense["model.embed_tokens.weight"])
        assert isinstance(model.lm_head.weight, Fp8Weight)
        assert model.model.embed_tokens.weight.dtype == torch.float32
    ref = build(oracle)
    hidden = model(tokens, torch.arange(24)[None], None)
    assert torch.equal(hidden, ref(tokens, torch.arange(24)[None], None))
    head = oracle_head.dequantize() if tied else oracle["lm_head.weight"]
    assert torch.equal(model.compute_logits(hidden), hidden @ head.T)


def test_quantization_fp8_on_cpu_is_an_error_naming_the_flag_and_device(tmp_path):
    _, dense_dir = write_fp8_checkpoint(tmp_path, "channel")
    with pytest.raises(models.ModelLoadError, match="quantization='fp8'.*device cpu"):
        models.load_model(dense_dir, device="cpu", quantization="fp8")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"tensors": {"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(3)}},
         r"'model.layers.0.self_attn.o_proj.weight_scale' has shape \(3,\).*allowed"),
        ({"tensors": {"model.layers.1.mlp.up_proj.weight_scale": None}},
         "'model.layers.1.mlp.up_proj.weight' is fp8 but the checkpoint has no scale"),
        ({"tensors": {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128).to(
            torch.float8_e5m2)}}, "'model.layers.0.mlp.down_proj.weight' has dtype.*e5m2"),
        ({"config": {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}},
         "quantization_config.fmt='e5m2' is not supported; allowed: e4m3"),
        ({"config": {"quantization_config": {"quant_method": "compressed-tensors",
          "format": "float-quantized", "config_groups": {"g": {"weights": {
              "num_bits": 4, "type": "float", "strategy": "group"}}}}}},
         "compressed-tensors.*not supported"),
        ({"tensors": {"model.layers.0.self_attn.q_proj.weight_scale": torch.tensor(
            [float("nan")])}}, "'model.layers.0.self_attn.q_proj.weight_scale' must hold finite"),
    ],
)  # fmt: skip
def test_bad_fp8_checkpoints_are_one_error_naming_the_tensor_or_field(tmp_path, edit, match):
    fp8_dir, _ = write_fp8_checkpoint(tmp_path, "channel")
    rewrite(fp8_dir, edit.get("tensors"), edit.get("config"))
    with pytest.raises(models.ModelLoadError, match=match):
        models.load_model(fp8_dir, device="cpu", dtype="float32")


def test_a_block_scale_of_the_wrong_shape_names_the_tensor_and_the_blocks(tmp_path):
    fp8_dir, _ = write_fp8_checkpoint(tmp_path, "block")
    rewrite(fp8_dir, {"model.layers.2.mlp.gate_proj.weight_scale_inv": torch.ones(4, 4)})
    with pytest.raises(models.ModelLoadError, match=r"gate_proj.weight_scale_inv.*\(4, 2\).*32x32"):
        models.load_model(fp8_dir, device="cpu", dtype="float32")
