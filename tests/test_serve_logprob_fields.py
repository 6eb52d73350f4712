"""Chat logprobs cover exactly `content` for every text tool parser, alone or behind `<think>`.

Oracle: the parser's own `parse` of the whole text. The tokens the labeler picks as content must
spell that content exactly, overall and chunk by chunk (each streamed chunk's content delta ==
its picked tokens' text), for seeded random chunkings, through the same `ChoiceRenderer` the
server streams with. Markers are one token each (Mistral's `[TOOL_CALLS]` / `[ARGS]` are
control tokens), every other character is a token; the end-of-turn token is never picked.
"""

from __future__ import annotations

import random

import pytest

from torch_runner.outputs import RequestOutput
from torch_runner.serve.chat_stream import ChoiceRenderer
from torch_runner.serve.generation import Choice, apply_output
from torch_runner.serve.logprob_fields import TokenLabeler
from torch_runner.serve.metrics import ChoiceTracker
from torch_runner.serve.parsing import ChainedParser, FirstCallOnly
from torch_runner.serve.reasoning.think import ThinkParser
from torch_runner.serve.tool_parsers.hermes import HermesToolParser
from torch_runner.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from torch_runner.serve.tool_parsers.mistral import MistralToolParser

EOS = 0
MARKERS = {1: "[TOOL_CALLS]", 2: "[ARGS]"}


class _Table:
    @staticmethod
    def text(token_id: int) -> str:
        return MARKERS.get(token_id) or (chr(token_id) if token_id else "")


def _tokens(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        marker = next((t for t, m in MARKERS.items() if text.startswith(m, i)), None)
        if marker is not None:
            ids.append(marker)
            i += len(MARKERS[marker])
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def _increments(text: str, sizes: list[int]):
    """Cumulative outputs of `sizes` tokens each, then the EOS that finishes the request."""
    ids, table, outputs, end = _tokens(text), _Table(), [], 0
    for size in [*sizes, 0]:
        end = min(len(ids), end + size)
        finished = size == 0
        out_ids = ids[:end] + ([EOS] if finished else [])
        output = RequestOutput(
            "r",
            [],
            out_ids,
            "".join(table.text(t) for t in ids[:end]),
            "",
            [],
            None,
            finished,
            "stop" if finished else None,
            0,
        )
        output.logprobs = [type("L", (), {"logprob": -1.0, "top_logprobs": []})() for _ in out_ids]
        outputs.append(output)
    choice = Choice(0, 0, "r", [], None, ChoiceTracker(0.0))
    return len(ids), [apply_output(choice, output, 0.0) for output in outputs]


CALL = '{"name": "get_time", "parameters": {"zone": "CET"}}'
CASES = {
    "llama3_json": (
        Llama3JsonToolParser,
        [
            CALL,
            f" {CALL}; {CALL}",
            f"{CALL} and then words",
            '{"no": "name"} so text',
            "plain answer {with braces}",
            "  trailing blanks  ",
            f'{CALL}; {{"x": 1}} tail',
            '{"name": "cut", "parameters": {"a"',
        ],
    ),
    "mistral": (
        MistralToolParser,
        [
            'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]',
            'ok [TOOL_CALLS]get_time[ARGS]{"zone": "CET"}[TOOL_CALLS]f[ARGS]{} after',
            "[TOOL_CALLS] not a call at all",
            'a [TOOL_CALLS][{"x": 1}] b',
            "no marker, [TOOL_ half a marker",
            '[TOOL_CALLS][{"name": "f", "arguments": {}}] trailing words',
        ],
    ),
    "think+hermes": (
        lambda: ChainedParser(ThinkParser(), HermesToolParser()),
        [
            '<think>let me see</think>Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>',
            "<think>only reasoning</think>  and an answer <tool_",
            '<think>a</think><tool_call>{"name": "f", "arguments": {"k": 1}}</tool_call> end',
            "no think at all <tool_call>hello</tool_call>",
            "<thi not a tag",
        ],
    ),
    "think+llama3_json": (
        lambda: ChainedParser(ThinkParser(starts_in_reasoning=True), Llama3JsonToolParser()),
        [f"reasoning first</think>{CALL}", "r</think>\n\njust text {x}"],
    ),
    "hermes, one call": (
        lambda: FirstCallOnly(HermesToolParser()),
        ['a <tool_call>{"name": "f", "arguments": {}}</tool_call> b <tool_call>{"name": "g"}'],
    ),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_content_logprobs_spell_the_content_at_any_chunking(family):
    make, texts = CASES[family]
    rng = random.Random(family)
    for text in texts:
        whole = make().parse(text, _tokens(text))
        want = whole.content or ""
        for trial in range(25):
            num_ids = len(_tokens(text))
            sizes = [1] * num_ids if trial == 0 else []
            while sum(sizes) < num_ids:
                sizes.append(rng.randint(1, 7))
            _, increments = _increments(text, sizes)
            parser = make()
            labeler = TokenLabeler(parser, _Table(), frozenset({EOS}))
            renderer = ChoiceRenderer(parser, labeler, lambda c: len(c.token_ids) - 1)
            picked = ""
            for rendered in map(renderer.render, increments):
                if rendered is None:
                    continue
                message, picks = rendered
                tokens = "".join(_Table.text(token_id) for token_id, _ in picks)
                assert (message.content or "") == tokens, (text, sizes)
                picked += tokens
            assert picked == want, (text, sizes)
            assert len(labeler.labels) == num_ids + 1  # every token decided by the end
