"""GGUF weights quantized as read (models/gguf_loader.py, models/gguf_file.py), against the
`gguf` package's own reader and dequantize: the header and rows read with pread equal
GGUFReader's, Q4 codes/scales/zeros dequantise to gguf's values, dense tensors decoded in row
tiles equal gguf's whole-tensor decode, and Q4 linears are packed without a dense copy."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_models_gguf import VOCAB_SIZE, _hf_reference, _permute, q4_k_bytes, write_tiny_gguf

import models
from models import gguf_file, gguf_loader, loader
from models.registry import get_family

pytestmark = pytest.mark.usefixtures("one_thread")
gguf = pytest.importorskip("gguf")
K_QUANT = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K divisible by 256


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path / "cache"))


def _dequantize(t) -> np.ndarray:
    """gguf's own decode of a GGUFReader tensor, [rows, columns] fp32 (the oracle)."""
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(reversed(t.shape.tolist()))
    )


def _read(path, quantization="auto", dtype=torch.float32):
    hf_config = loader._hf_config(gguf_loader.sidecar_folder(path))
    family = get_family(hf_config.model_type)
    with torch.device("meta"):
        model = family.Model(family.ModelArgs.from_hf_config(hf_config))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return gguf_loader.read_weights(path, expected, hf_config, dtype, quantization), hf_config


def test_header_and_rows_equal_gguf_reader(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", "Q4_1", types={"model.layers.0.mlp.up_proj.weight": "Q8_0"}
    )
    header = gguf_file.read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.fields["general.architecture"] == "llama"
    assert header.fields["llama.block_count"] == reader.fields["llama.block_count"].parts[-1][0]
    assert set(header.tensors) == {t.name for t in reader.tensors}
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in reader.tensors:
            info = header.tensors[t.name]
            assert (info.type_name, info.offset) == (t.tensor_type.name, t.data_offset)
            assert (
                info.shape == tuple(reversed(t.shape.tolist()))
                and info.row_bytes * info.num_rows == t.n_bytes
            )
            want = np.asarray(t.data).view(np.uint8)
            assert np.array_equal(gguf_file.read_rows(fd, info).view(np.uint8), want), t.name
            if len(info.shape) == 2:
                assert np.array_equal(gguf_file.read_rows(fd, info, 3, 7).view(np.uint8), want[3:7])
    finally:
        os.close(fd)


def test_not_a_gguf_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(models.ModelLoadError, match="bad.gguf: not a GGUF file"):
        gguf_file.read_header(path)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_blocks_dequantise_to_gguf_values(kind):
    w = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = q4_k_bytes(w) if kind == "Q4_K" else gguf.quants.quantize(w, qtype)
    codes, scales, zeros = gguf_file.int4_blocks(data, kind, w.shape)
    assert codes.dtype == np.uint8 and codes.max() <= 15 and scales.shape == (16, 512 // 32)
    got = (codes.reshape(16, -1, 32).astype(np.float32) - 8) * scales[..., None] + zeros[..., None]
    want = gguf.quants.dequantize(data, qtype)
    np.testing.assert_allclose(
        got.reshape(w.shape), want, rtol=1e-6, atol=1e-6 * np.abs(want).max()
    )


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_sources_dequantise_to_gguf_and_have_no_dense_copy(tmp_path, kind):
    path = write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", kind, **K_QUANT)
    (weights, sources, mode, _), cfg = _read(path)
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    linears = [n for n in sources if n.endswith("proj.weight")]
    assert mode == "int4" and len(linears) == 7 * cfg.num_hidden_layers
    assert not set(sources) & set(weights)  # never dense beside its codes
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, (codes, scales, zeros) in sources.items():
        want = _dequantize(reader[name_map.get_name(name, try_suffixes=(".weight",))])
        if ".q_proj." in name or ".k_proj." in name:  # the file's rows are permuted for rope
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            want = gguf_file.llama_unpermute(want, heads)
        got = (codes.float().reshape(codes.shape[0], -1, 32) - 8) * scales[..., None]
        torch.testing.assert_close((got + zeros[..., None]).reshape(codes.shape),
                                   torch.from_numpy(want), rtol=1e-6, atol=1e-6)  # fmt: skip


def test_dense_tensors_decoded_in_row_tiles_equal_gguf_decoding_whole(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    monkeypatch.setattr(gguf_file, "TILE_BYTES", 4 * 64 * 3)  # 3 rows a tile: a ragged last one
    (weights, sources, mode, head_mode), cfg = _read(path, dtype=torch.bfloat16)
    assert not sources and (mode, head_mode) == ("int8", "none")
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in weights.items():
        want = _dequantize(reader[name_map.get_name(name, try_suffixes=(".weight", ".bias"))])
        if ".q_proj." in name or ".k_proj." in name:
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            want = gguf_file.llama_unpermute(want, heads)
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.tensor(want).reshape(tensor.shape).bfloat16()), name


def test_llama_unpermute_inverts_the_converter_permutation():
    rows = np.arange(8 * 4 * 3).reshape(8 * 4, 3)
    assert np.array_equal(gguf_file.llama_unpermute(_permute(rows, 4), 4), rows)


@torch.no_grad()
def test_q4_k_file_serves_packed_int4_equal_to_transformers(tmp_path, exact_fp32):
    path = write_tiny_gguf(tmp_path / "tiny-q4k.gguf", "Q4_K", **K_QUANT)
    ours = models.load_model(path, device="cpu", dtype="float32")
    attn = ours.model.model.layers[0].self_attn
    assert attn.qkv_weight.is_quantized and attn.q_proj.weight.is_meta  # packed, never dense
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(5))
    got = ours.model.compute_logits(ours.model(ids, torch.arange(16)[None], None))
    torch.testing.assert_close(got, _hf_reference(path)(ids).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_q4_group_with_a_non_q4_part_is_re_quantized_from_dense(tmp_path, exact_fp32):
    """v_proj stored F32 beside Q4_0 q/k (as a Q4_K_M file's Q6_K parts): the fused q/k/v is
    quantized from the dense weights (today's rule), the Q4 gate/up/down from their codes."""
    from test_ops_quant_int import fake_quantize

    types = {f"model.layers.{i}.self_attn.v_proj.weight": "F32" for i in range(3)}  # every layer
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_0", types=types)
    ours = models.load_model(path, device="cpu", dtype="float32")
    layer = ours.model.model.layers[0]
    assert layer.self_attn.qkv_weight.is_quantized and layer.mlp.gate_up_weight.is_quantized
    hf = _hf_reference(path)
    for name, module in hf.named_modules():  # q/k/v re-quantized per group of 32, as we do
        if name.endswith(("q_proj", "k_proj", "v_proj")):
            module.weight.copy_(fake_quantize(module.weight, "int4"))
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(6))
    got = ours.model.compute_logits(ours.model(ids, torch.arange(16)[None], None))
    torch.testing.assert_close(got, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_quantize_rows_equals_quantizing_the_whole_matrix(monkeypatch, torch_cpu_kernels):
    from models import quantize
    from ops.quant.int_linear import quantize_int4, quantize_int8

    weight = torch.randn(100, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    monkeypatch.setattr(quantize, "TILE_BYTES", 4 * 64 * 24)  # 24-row tiles, the last one short
    tiled, whole = quantize.quantize_rows(weight, "int8", 32), quantize_int8(weight)
    assert torch.equal(tiled.qweight, whole.qweight) and torch.equal(tiled.scales, whole.scales)
    weight = weight[:96]
    tiled, whole = (
        quantize.quantize_rows(weight, "int4", 32),
        quantize_int4(weight, 32, keep_codes=True),
    )
    assert torch.equal(tiled.packed, whole.packed)
    assert torch.equal(tiled.scales_and_zeros, whole.scales_and_zeros)


@torch.no_grad()
def test_a_q4_lm_head_beside_q8_0_linears_is_packed_from_its_file_codes(tmp_path, exact_fp32):
    from test_ops_quant_int import fake_quantize

    path = write_tiny_gguf(tmp_path / "head.gguf", "Q8_0", types={"lm_head.weight": "Q4_0"})
    ours = models.load_model(path, device="cpu", dtype="float32")
    assert ours.model.lm_head.weight.is_quantized and hasattr(ours.model.lm_head.weight, "packed")
    hf = _hf_reference(path)  # the head: the file's Q4_0 values exactly; linears: int8 per row
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.weight.copy_(fake_quantize(module.weight, "int8"))
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(8))
    got = ours.model.compute_logits(ours.model(ids, torch.arange(16)[None], None))
    torch.testing.assert_close(got, hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
@torch.no_grad()
def test_cuda_packs_the_same_codes_as_cpu(tmp_path, kind):
    """On CUDA the codes go to the device before packing (its own int4 layout). Oracle: HF's fp32
    model of the file's dequantised values; the CUDA load's bf16 logits are no further from it
    than the CPU load's (x2: two different bf16 kernels), and wrong codes would be off by ~scale."""
    path = write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", kind, **K_QUANT)
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(9))
    reference = _hf_reference(path)(ids).logits.float()
    errors = []
    for device in ("cpu", "cuda"):
        ours = models.load_model(path, device=device, dtype="bfloat16")
        assert ours.model.model.layers[0].self_attn.qkv_weight.is_quantized
        x, pos = ids.to(device), torch.arange(16, device=device)[None]
        logits = ours.model.compute_logits(ours.model(x, pos, None)).float().cpu()
        errors.append((logits - reference).abs().max().item())
    scale = reference.abs().max().item()
    assert errors[0] < 0.1 * scale, errors  # the CPU load itself is close to the oracle
    assert errors[1] <= 2 * errors[0] + 0.01 * scale, (errors, scale)


def test_int8_as_read_equals_quantizing_the_dense_weights(tmp_path, monkeypatch):
    """Q8_0 linears in int8 mode are quantized per row as decoded (no dense copy): the same
    qweight and scales as quantize_int8 of the dense bf16 tensor, q/k rows un-permuted."""
    from ops.quant.int_linear import quantize_int8

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    monkeypatch.setattr(gguf_file, "TILE_BYTES", 4 * 64 * 5)  # 5-row tiles
    (dense, _, _, _), cfg = _read(path, dtype=torch.bfloat16)
    int8 = {}
    hf_config = loader._hf_config(gguf_loader.sidecar_folder(path))
    expected = {name: tuple(t.shape) for name, t in dense.items()}
    weights, _, mode, _ = gguf_loader.read_weights(
        path, expected, hf_config, torch.bfloat16, "auto", int8_into=int8
    )
    linears = {n for n in dense if n.endswith("proj.weight")}
    assert mode == "int8" and set(int8) == linears and not linears & set(weights)
    for name, (qweight, scales) in int8.items():
        want = quantize_int8(dense[name])
        assert torch.equal(qweight, want.qweight) and torch.equal(scales, want.scales), name
    model = models.load_model(path, device="cpu", dtype="bfloat16").model
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta  # never dense
    assert model.model.layers[0].self_attn.qkv_weight.is_quantized
