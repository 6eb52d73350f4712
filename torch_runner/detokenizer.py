"""Incremental detokenization and stop-string handling for streamed output.

Decoding one token at a time splits multi-byte characters (a byte-level BPE token can hold half
of a UTF-8 sequence) and loses the leading space some tokenizers attach to the previous token.
So, as vLLM does, each step decodes a short sliding window of ids twice: `ids[prefix:read]`
(already emitted) and `ids[prefix:]`; the difference is the new text, emitted only when it does
not end in U+FFFD (an incomplete character). The window starts on the last prompt tokens so the
first generated token decodes in context.

Stop strings are not emitted: the text is cut where the first one starts, and while streaming
the longest tail that could still become a stop string is held back.
"""

from __future__ import annotations

from functools import partial

CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token
TRIM_AT = 64  # drop ids before the decode window once it has moved this far


class IncrementalDetokenizer:
    """Turns appended token ids into text increments that never split a character."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast tokenizer with no space clean-up decodes exactly as its Rust backend does; the
        # backend directly skips transformers' per-call argument conversion (~60% of a decode)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            backend = tokenizer
        # bound once: a decode is ~1.5 us, a Python wrapper frame around it was another ~0.4
        self._decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset >= TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is left, incomplete characters included (as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) occurring in `text` at or after `search_from`."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, search_from))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def holdback_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
