"""GGUF checkpoints loaded directly (models/gguf_loader.py), against transformers loading the same file.

Tiny llama GGUFs are written here with the `gguf` package the way llama.cpp's converter lays
them out (its tensor names, q/k rows permuted for rope, a byte-level gpt2 vocabulary); the
oracle is transformers' own GGUF loader (it dequantises every tensor to fp32).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tiny_models import VOCAB_SIZE, build_tiny_model

import models

pytestmark = pytest.mark.usefixtures("one_thread")
gguf = pytest.importorskip("gguf")
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """[N, K] -> Q4_K blocks [N, K / 256 * 144] (gguf-py cannot write Q4_K): per 32-value group
    a 6-bit scale and min relative to the super-block's f16 d and dmin, as llama.cpp lays them."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(g.min(-1), 0)
    scale = (g.max(-1) - lo) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-12)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-12)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    q = np.clip(np.round((g + (dmin.astype(np.float32) * m)[..., None]) / step[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(n, k // 256, 4, 2, 32)  # chunk c: groups 2c (low), 2c+1 (high)
    scales = np.concatenate(
        [sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
         (sc[..., 4:] & 0x0F) | (m[..., 4:] & 0x0F) << 4], axis=-1,
    )  # fmt: skip
    qs = (q[..., 0, :] | q[..., 1, :] << 4).reshape(n, k // 256, 128)
    blocks = [d.view(np.uint8), dmin.view(np.uint8), scales, qs]
    return np.concatenate(blocks, axis=-1).reshape(n, -1)


def write_tiny_gguf(
    path, linear_type: str, seed: int = 0, arch: str = "llama", types=None, **overrides
):
    """types: HF name -> GGML type of the linears stored otherwise than `linear_type`;
    overrides: config fields (Q4_K needs in_features divisible by 256)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = build_tiny_model(
        "llama", seed=seed, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), **overrides,
    )  # fmt: skip
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_tokenizer_model("gpt2")
    byte_chars = bytes_to_unicode()
    writer.add_token_list([byte_chars[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, value in hf.state_dict().items():
        arr = value.float().numpy()
        if ".q_proj." in name:
            arr = _permute(arr, cfg.num_attention_heads)
        elif ".k_proj." in name:
            arr = _permute(arr, cfg.num_key_value_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = (types or {}).get(name, linear_type)
        if (name.endswith("proj.weight") or name in (types or {})) and kind != "F32":
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            data = q4_k_bytes(arr) if kind == "Q4_K" else gguf.quants.quantize(arr, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path / "cache"))


def _hf_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
@pytest.mark.parametrize(
    ("linear_type", "packed_as"),
    [("F32", None), ("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")],
)
def test_gguf_logits_equal_transformers_loading_the_same_file(
    tmp_path, linear_type, packed_as, exact_fp32
):
    path = write_tiny_gguf(tmp_path / f"tiny-{linear_type}.gguf", linear_type)
    ours = models.load_model(path, device="cpu", dtype="float32")
    qkv = ours.model.model.layers[0].self_attn.qkv_weight
    assert getattr(qkv, "is_quantized", False) == (packed_as is not None)
    ids = torch.randint(3, VOCAB_SIZE, (1, 32), generator=torch.Generator().manual_seed(3))
    got = ours.model.compute_logits(ours.model(ids, torch.arange(32)[None], None))
    hf = _hf_reference(path)
    if linear_type == "Q8_0":  # re-quantized per channel: the oracle applies the same rounding
        from test_ops_quant_int import fake_quantize

        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(fake_quantize(module.weight, "int8"))
    # Q4: the file's codes and scales, exactly
    torch.testing.assert_close(got, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_gguf_quantization_none_serves_dequantised_weights(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    ours = models.load_model(path, device="cpu", dtype="float32", quantization="none")
    assert isinstance(ours.model.model.layers[0].self_attn.qkv_weight, torch.Tensor)
    ids = torch.randint(3, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(4))
    got = ours.model.compute_logits(ours.model(ids, torch.arange(16)[None], None))
    torch.testing.assert_close(got, _hf_reference(path)(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_folder_with_one_gguf_loads_and_the_tokenizer_has_the_chat_template(tmp_path):
    from torch_runner import Engine, SamplingParams

    write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    engine = Engine(str(tmp_path), device="cpu", dtype="float32", max_total_tokens=256)
    assert engine.tokenizer.chat_template == TEMPLATE
    assert engine.tokenizer("hi").input_ids[-2:] == [ord("h"), ord("i")]
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    hf = _hf_reference(tmp_path / "tiny.gguf")
    want = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out[0].token_ids == want[0, 3:].tolist()


def test_k_quant_types_are_dequantised_with_one_warning_naming_the_type(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0")
    with caplog.at_level(logging.WARNING, logger="models.gguf_loader"):
        ours = models.load_model(path, device="cpu", dtype="float32")
    warnings = [r.getMessage() for r in caplog.records if "Q5_0" in r.getMessage()]
    assert len(warnings) == 1
    assert isinstance(ours.model.model.layers[0].self_attn.qkv_weight, torch.Tensor)


def test_unsupported_gguf_architecture_is_an_error_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "F32", arch="llama")
    data = path.read_bytes().replace(b"llama", b"mamba", 1)  # general.architecture's value
    path.write_bytes(data)
    with pytest.raises(models.ModelLoadError, match="'mamba'"):
        models.load_model(path, device="cpu")


def test_a_folder_with_two_ggufs_is_an_error_naming_them(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", "F32")
    write_tiny_gguf(tmp_path / "b.gguf", "F32")
    with pytest.raises(models.ModelLoadError, match="a.gguf, b.gguf"):
        models.load_model(tmp_path, device="cpu")
