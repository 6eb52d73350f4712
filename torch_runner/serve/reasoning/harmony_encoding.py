"""openai-harmony's gpt-oss encoding, loaded offline from the model folder's own tokenizer.

openai-harmony renders and parses harmony by token id, but it loads its BPE ranks from
`o200k_base.tiktoken`, which it downloads unless `TIKTOKEN_ENCODINGS_BASE` names a folder that
has it. gpt-oss's tokenizer.json holds the same ranks (ids 0..199997), so the file is written
from the model's tokenizer into a cache folder; openai-harmony checks its SHA-256, so a
tokenizer that is not o200k refuses to load instead of parsing wrongly. The special-token ids of
the two must agree too (checked here).
"""

from __future__ import annotations

import base64
import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

O200K_BASE_SIZE = 199998  # ranks of o200k_base; harmony's special tokens start here
TIKTOKEN_FILE = "o200k_base.tiktoken"
ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"
# openai-harmony's own check of the file (the published o200k_base.tiktoken).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


class HarmonyUnavailableError(RuntimeError):
    """The model speaks harmony but openai-harmony cannot load (missing package, wrong vocab)."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the byte-level BPE alphabet back to bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def tiktoken_text(tokenizer: Any) -> str:
    """The `o200k_base.tiktoken` body (base64 token, space, rank) from a byte-level BPE tokenizer."""
    decoder = _byte_decoder()
    pieces = tokenizer.convert_ids_to_tokens(list(range(O200K_BASE_SIZE)))
    lines = []
    for rank, piece in enumerate(pieces):
        if piece is None or any(ch not in decoder for ch in piece):
            raise HarmonyUnavailableError(
                f"token {rank} ({piece!r}) is not a byte-level BPE token: not an o200k vocabulary"
            )
        raw = bytes(decoder[ch] for ch in piece)
        lines.append(f"{base64.b64encode(raw).decode()} {rank}\n")
    return "".join(lines)


def _cache_dir() -> Path:
    base = os.environ.get("TORCH_RUNNER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_runner"
    )
    return Path(base) / "harmony"


def _write_vocab(tokenizer: Any) -> Path:
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TIKTOKEN_FILE
    if not path.exists():
        text = tiktoken_text(tokenizer)
        if hashlib.sha256(text.encode()).hexdigest() != O200K_BASE_SHA256:
            raise HarmonyUnavailableError(
                "the model's tokenizer is not o200k_harmony (its first 199,998 tokens differ)"
            )
        tmp = folder / f"{TIKTOKEN_FILE}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: concurrent servers never read half a file
    return folder


@lru_cache(maxsize=1)
def _load(folder: str) -> Any:
    import openai_harmony as harmony

    os.environ[ENCODINGS_ENV] = folder  # read by openai-harmony at load time only
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


_CHECKED: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, encoding)


def load_harmony_encoding(tokenizer: Any) -> Any:
    """openai-harmony's HARMONY_GPT_OSS encoding, without network; checked against `tokenizer`
    (once per tokenizer object: parsers are built per choice)."""
    known = _CHECKED.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    try:
        import openai_harmony  # noqa: F401
    except ImportError:
        raise HarmonyUnavailableError(
            "gpt-oss output needs the openai-harmony package: pip install openai-harmony"
        ) from None
    folder = os.environ.get(ENCODINGS_ENV)
    if not (folder and os.path.exists(os.path.join(folder, TIKTOKEN_FILE))):
        folder = str(_write_vocab(tokenizer))
    try:
        encoding = _load(folder)
    except Exception as exc:  # HarmonyError: hash mismatch (not o200k) or an unreadable file
        raise HarmonyUnavailableError(
            f"openai-harmony could not load o200k_harmony: {exc}"
        ) from None
    for name in HARMONY_SPECIALS:
        ours, theirs = (
            tokenizer.convert_tokens_to_ids(name),
            encoding.encode(name, allowed_special="all"),
        )
        if [ours] != theirs:
            raise HarmonyUnavailableError(
                f"the tokenizer's {name} is id {ours}, openai-harmony's is {theirs}"
            )
    _CHECKED[id(tokenizer)] = (tokenizer, encoding)
    return encoding
