"""Tiny checkpoints with a byte-level tokenizer, for engine tests.

The tiny models (tests/tiny_models.py) have a 256-token vocabulary; a byte-level BPE with no
merges has exactly 256 tokens, one per byte, so every multi-byte character spans several
tokens (which the incremental detokenizer must not split).
"""

from __future__ import annotations

from pathlib import Path

from tiny_models import build_tiny_model


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode()[b] for b in range(256))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def save_engine_checkpoint(model_type: str, directory: str | Path, *, seed: int = 0, **overrides):
    """Save a tiny seeded checkpoint plus the byte tokenizer; returns (path, HF reference model)."""
    directory = Path(directory)
    model = build_tiny_model(model_type, seed=seed, **overrides)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory, model
