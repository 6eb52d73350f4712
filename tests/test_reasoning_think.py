"""`<think>` reasoning parsers (qwen3, deepseek_r1): the split, streamed at every chunk boundary.

The oracle is the pieces each output is built from: `<think>` + REASONING + `</think>` + CONTENT
must come back as exactly those two fields, whole (`parse`) and streamed (`feed` + `finish`,
accumulated as the openai client does), wherever the chunks are cut.
"""

from __future__ import annotations

import pytest

from torch_runner.serve.parsing import ParsedMessage, accumulate
from torch_runner.serve.reasoning import REASONING_PARSERS, new_reasoning_parser
from torch_runner.serve.reasoning.think import ThinkParser, prompt_opens_think

REASONING = "The user greets me. <b>Be</b> brief: 2 < 3 and </thin is not a tag."
CONTENT = "Hello! <think> here is just text."

# (output text, parser, prompt text, expected reasoning, expected content)
CASES = {
    "tags in output": (
        "<think>" + REASONING + "</think>" + CONTENT,
        "qwen3",
        "",
        REASONING,
        CONTENT,
    ),
    "leading newline": (
        "\n<think>" + REASONING + "</think>" + CONTENT,
        "qwen3",
        "",
        REASONING,
        CONTENT,
    ),
    "template opened think": (
        REASONING + "</think>" + CONTENT,
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        REASONING,
        CONTENT,
    ),
    "thinking disabled": (
        CONTENT,
        "qwen3",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        None,
        CONTENT,
    ),
    "no tags": (CONTENT, "qwen3", "", None, CONTENT),
    "cut off while reasoning": ("<think>" + REASONING, "qwen3", "", REASONING, None),
    "r1 without opening tag": (
        REASONING + "</think>" + CONTENT,
        "deepseek_r1",
        "",
        REASONING,
        CONTENT,
    ),
    "r1 with opening tag": (
        "<think>" + REASONING + "</think>" + CONTENT,
        "deepseek_r1",
        "",
        REASONING,
        CONTENT,
    ),
    "not a tag at the start": ("<thinking>" + CONTENT, "qwen3", "", None, "<thinking>" + CONTENT),
    "only a partial tag": ("<thi", "qwen3", "", None, "<thi"),
}


def stream(parser, chunks: list[str]) -> ParsedMessage:
    return accumulate([parser.feed(chunk, []) for chunk in chunks] + [parser.finish()])


@pytest.mark.parametrize("case", CASES)
def test_parse_splits_reasoning_from_content(case):
    text, name, prompt, reasoning, content = CASES[case]
    parsed = new_reasoning_parser(name, prompt_text=prompt).parse(text, [])
    assert (parsed.reasoning_content, parsed.content) == (reasoning, content)
    assert parsed.tool_calls == []


@pytest.mark.parametrize("case", CASES)
def test_stream_equals_parse_at_every_split(case):
    text, name, prompt, reasoning, content = CASES[case]
    for cut in range(len(text) + 1):
        parser = new_reasoning_parser(name, prompt_text=prompt)
        streamed = stream(parser, [text[:cut], text[cut:]])
        assert (streamed.reasoning_content, streamed.content) == (reasoning, content), cut


@pytest.mark.parametrize(
    "case", ["tags in output", "template opened think", "r1 without opening tag"]
)
def test_stream_equals_parse_at_every_pair_of_splits(case):
    text, name, prompt, reasoning, content = CASES[case]
    for first in range(0, len(text) + 1, 3):
        for second in range(first, len(text) + 1):
            parser = new_reasoning_parser(name, prompt_text=prompt)
            streamed = stream(parser, [text[:first], text[first:second], text[second:]])
            assert (streamed.reasoning_content, streamed.content) == (reasoning, content)


def test_tag_pieces_are_never_sent_as_text():
    """One character per chunk: no delta ever carries a fragment of `<think>` or `</think>`."""
    text = "<think>" + REASONING + "</think>" + CONTENT
    parser = ThinkParser()
    deltas = [parser.feed(ch, []) for ch in text] + [parser.finish()]
    sent = [d.reasoning_content or "" for d in deltas] + [d.content or "" for d in deltas]
    assert "".join(d.reasoning_content or "" for d in deltas) == REASONING
    assert not any(piece.startswith("<think") or piece == "</" for piece in sent if piece)


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    # An earlier, closed block in the history does not count.
    assert not prompt_opens_think("<think>a</think>b<|im_start|>assistant\n")


def test_registry_names_follow_vllm():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "openai_gptoss"}
    with pytest.raises(ValueError, match="allowed: qwen3, deepseek_r1, openai_gptoss"):
        new_reasoning_parser("qwen")


def test_think_then_hermes_call_through_the_chain():
    """Qwen3 with tools: the reasoning parser runs first, its content goes to the hermes parser."""
    from torch_runner.serve.parsing import ChainedParser
    from torch_runner.serve.tool_parsers import get_tool_parser

    arguments = '{"city": "Paris"}'
    call = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"
    text = "<think>" + REASONING + "</think>\n\n" + call
    for cut in range(len(text) + 1):
        parser = ChainedParser(ThinkParser(), get_tool_parser("hermes")(None))
        streamed = stream(parser, [text[:cut], text[cut:]])
        assert streamed.reasoning_content == REASONING, cut
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [("get_weather", arguments)]
        assert (streamed.content or "").strip() == ""
    whole = ChainedParser(ThinkParser(), get_tool_parser("hermes")(None)).parse(text, [])
    assert (whole.reasoning_content, [c.name for c in whole.tool_calls]) == (
        REASONING,
        ["get_weather"],
    )
