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


def run_staggered(engine, prompts, params, arrive_at=()):
    """Outputs (token ids) of `prompts`: the first ones are added before any step, each later
    one before the step numbered in `arrive_at` (rows joining mid-flight); in prompt order."""
    rids, final, step = [], {}, 0
    upfront = len(prompts) - len(arrive_at)
    while len(rids) < len(prompts) or engine.has_unfinished():
        if len(rids) < len(prompts) and (len(rids) < upfront or step in arrive_at):
            rids.append(engine.add_request(None, prompts[len(rids)], params[len(rids)]))
            continue
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        step += 1
    return [final[r] for r in rids]


def hf_greedy(hf, prompt, max_tokens):
    """transformers' greedy continuation of `prompt` (no EOS stop)."""
    import torch

    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
