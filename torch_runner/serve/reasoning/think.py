"""`<think>...</think>` reasoning (Qwen3, DeepSeek-R1): text inside the tags is `reasoning_content`.

Streaming holds back a suffix that could still grow into a tag ("<thi"), so a tag split across
chunks at any position is never sent as text. Output begins inside the reasoning when the chat
template already opened `<think>` at the end of the prompt (Qwen3 with thinking on, DeepSeek-R1),
or always for `deepseek_r1`, which vLLM defines as "reasoning until `</think>`"; a `<think>` the
model writes itself at the very start of its output (leading whitespace aside) opens reasoning
too, and is the only one that does. Reasoning
cut off by max_tokens stays reasoning; everything after `</think>` is content, as vLLM sends it.
"""

from __future__ import annotations

from torch_runner.serve.parsing import DeltaMessage, ParsedMessage

THINK_START = "<think>"
THINK_END = "</think>"
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def prompt_opens_think(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open `<think>` block (the template started it)."""
    start = prompt_text.rfind(THINK_START)
    return start >= 0 and prompt_text.find(THINK_END, start) < 0


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ThinkParser:
    """One per choice; `starts_in_reasoning` when the prompt left `<think>` open."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.starts_in_reasoning = starts_in_reasoning
        self.state = _START
        self.pending = ""
        self.num_fed = 0  # characters fed so far
        self.content_from: int | None = None  # offset in the fed text where content begins

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        self.num_fed += len(delta_text)
        return self._consume(self.pending + delta_text, is_final=False)

    def finish(self) -> DeltaMessage:
        return self._consume(self.pending, is_final=True)

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        parser = ThinkParser(self.starts_in_reasoning)
        deltas = [parser.feed(text, token_ids), parser.finish()]
        reasoning = "".join(d.reasoning_content or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        return ParsedMessage(content=content or None, reasoning_content=reasoning or None)

    def _consume(self, text: str, is_final: bool) -> DeltaMessage:
        reasoning = content = ""
        if self.state == _START:
            head = text.lstrip()
            if head.startswith(THINK_START):
                text, self.state = head[len(THINK_START) :], _REASONING
            elif THINK_START.startswith(head) and not is_final:
                self.pending = text  # still could be "<think>": wait for more
                return DeltaMessage()
            else:
                self.state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self.state == _REASONING:
            end = text.find(THINK_END)
            if end >= 0:
                reasoning, text, self.state = text[:end], text[end + len(THINK_END) :], _CONTENT
            else:
                keep = 0 if is_final else _partial_tag_length(text, THINK_END)
                reasoning, text = text[: len(text) - keep], text[len(text) - keep :]
        if self.state == _CONTENT:
            if self.content_from is None:  # `text` is always a suffix of what was fed
                self.content_from = self.num_fed - len(text)
            content, text = text, ""
        self.pending = text
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
