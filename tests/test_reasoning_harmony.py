"""gpt-oss harmony: the offline encoding, the output parser and the prompt renderer.

Outputs are built with openai-harmony's own renderer from known messages (the oracle: what each
message said), on the real o200k_harmony tokenizer rebuilt from quicktok-v1. Streaming is cut at
every token boundary and accumulated as the openai client does; it must equal the whole parse.
"""

from __future__ import annotations

import datetime
import json

import openai_harmony as harmony
import pytest
from transformers import AutoTokenizer

from torch_runner.serve.parsing import accumulate
from torch_runner.serve.reasoning import new_reasoning_parser
from torch_runner.serve.reasoning.harmony_encoding import (
    HarmonyUnavailableError,
    load_harmony_encoding,
    tiktoken_text,
)
from torch_runner.serve.reasoning.harmony_prompt import HarmonyPromptError, render_harmony_prompt

ASSISTANT = harmony.Role.ASSISTANT
REASONING = "User wants the weather in Paris. I should call get_weather. Ünïcode: 日本語."
ANSWER = "It is sunny in Paris, 21 °C."
ARGUMENTS = json.dumps({"city": "Paris", "unit": "celsius"})


def analysis(text):
    return harmony.Message.from_role_and_content(ASSISTANT, text).with_channel("analysis")


def final(text):
    return harmony.Message.from_role_and_content(ASSISTANT, text).with_channel("final")


def call(name, arguments):
    return (
        harmony.Message.from_role_and_content(ASSISTANT, arguments)
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("<|constrain|>json")
    )


def generated(encoding, messages, last="<|return|>"):
    """What the model generates after the prompt's `<|start|>assistant`: the rendered messages
    without that first `<|start|>assistant`, the last message ending in `<|return|>` (an answer)
    or `<|call|>` (a call), as gpt-oss's stop tokens end them."""
    ids = [t for m in messages for t in encoding.render(m)]
    assert ids[:2] == encoding.encode("<|start|>assistant", allowed_special="all")
    ids = ids[2:]
    if last == "<|return|>":
        ids[-1] = encoding.encode("<|return|>", allowed_special="all")[0]
    return ids


def stream(parser, chunks):
    return accumulate([parser.feed("", chunk) for chunk in chunks] + [parser.finish()])


def test_encoding_loads_offline_and_matches_the_tokenizer(harmony_encoding, harmony_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    text = "Hello, wörld! def f(x):\n    return x ** 2  # 日本語\n\n"
    assert harmony_encoding.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    stops = tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    assert sorted(harmony_encoding.stop_tokens_for_assistant_actions()) == sorted(stops)


def test_a_tokenizer_that_is_not_o200k_is_refused(harmony_tokenizer_dir, tmp_path, monkeypatch):
    from engine_helpers import byte_tokenizer

    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    with pytest.raises(HarmonyUnavailableError):
        load_harmony_encoding(byte_tokenizer())
    # The file written from the real tokenizer is byte for byte the published one.
    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    assert tiktoken_text(tokenizer).startswith("IQ== 0\nIg== 1\n")


CASES = {
    "reasoning then answer": ([analysis(REASONING), final(ANSWER)], "<|return|>"),
    "answer only": ([final(ANSWER)], "<|return|>"),
    "reasoning then call": ([analysis(REASONING), call("get_weather", ARGUMENTS)], "<|call|>"),
    "preamble then call": (
        [
            harmony.Message.from_role_and_content(ASSISTANT, "Checking.").with_channel(
                "commentary"
            ),
            call("get_weather", ARGUMENTS),
        ],
        "<|call|>",
    ),
}


def expected(messages):
    reasoning = "".join(m.content[0].text for m in messages if m.channel == "analysis")
    content = "".join(
        m.content[0].text for m in messages if m.channel != "analysis" and not m.recipient
    )
    calls = [
        (m.recipient.removeprefix("functions."), m.content[0].text) for m in messages if m.recipient
    ]
    return reasoning or None, content or None, calls


@pytest.mark.parametrize("case", CASES)
def test_parse_routes_each_channel(harmony_encoding, case):
    messages, last = CASES[case]
    ids = generated(harmony_encoding, messages, last)
    parsed = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding).parse("", ids)
    calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    assert (parsed.reasoning_content, parsed.content, calls) == expected(messages)
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize("case", CASES)
def test_stream_equals_parse_at_every_token_split(harmony_encoding, case):
    messages, last = CASES[case]
    ids = generated(harmony_encoding, messages, last)
    want = expected(messages)
    for cut in range(len(ids) + 1):
        parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
        streamed = stream(parser, [ids[:cut], ids[cut:]])
        calls = [(c.name, c.arguments) for c in streamed.tool_calls]
        assert (streamed.reasoning_content, streamed.content, calls) == want, cut
    parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
    deltas = [parser.feed("", [t]) for t in ids] + [parser.finish()]
    firsts = [piece for d in deltas for piece in d.tool_calls if piece.id]
    # OpenAI's order: a call's first delta carries its index, id and name, and no arguments yet.
    assert [(p.index, p.arguments) for p in firsts] == [(i, "") for i in range(len(want[2]))]


def harmony_fields(encoding, ids):
    """openai-harmony's own StreamableParser over a (possibly cut) output, read as vLLM does:
    the ended messages, plus the open one's body once its `<|message|>` came; a header still
    open is nothing."""
    parser = harmony.StreamableParser(encoding, ASSISTANT)
    for token_id in ids:
        parser.process(token_id)
    messages = [(m.channel, m.recipient, m.content[0].text) for m in parser.messages]
    if parser.state == harmony.StreamState.CONTENT:
        messages.append((parser.current_channel, parser.current_recipient, parser.current_content))
    reasoning = "".join(t for c, r, t in messages if c == "analysis")
    content = "".join(t for c, r, t in messages if c != "analysis" and not r)
    calls = [(r.removeprefix("functions."), t) for c, r, t in messages if r]
    return reasoning or None, content or None, calls


@pytest.mark.parametrize("case", CASES)
def test_output_cut_anywhere_shows_no_header_words(harmony_encoding, case):
    """max_tokens may end the output inside a header (`<|start|>assistant<|channel|>final`):
    those words are protocol, never content. Every cut equals harmony's own parse."""
    ids = generated(harmony_encoding, *CASES[case])
    for cut in range(len(ids) + 1):
        parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
        parsed = stream(parser, [[t] for t in ids[:cut]])
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        want = harmony_fields(harmony_encoding, ids[:cut])
        assert (parsed.reasoning_content, parsed.content, calls) == want, cut
        assert "content" not in parser.token_fields or parsed.content, cut


def test_other_special_tokens_carry_no_text(harmony_encoding):
    """An end-of-text token after an answer (a grammar or EOS ending it) is not content."""
    ids = generated(harmony_encoding, [analysis(REASONING), final(ANSWER)], "<|end|>")
    ids += harmony_encoding.encode("<|endoftext|>", allowed_special="all")
    parsed = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding).parse("", ids)
    assert (parsed.reasoning_content, parsed.content) == (REASONING, ANSWER)


def test_two_parallel_calls_get_their_own_indexes(harmony_encoding):
    messages = [call("get_weather", ARGUMENTS), call("get_time", '{"tz": "CET"}')]
    ids = generated(harmony_encoding, messages[:1], "<|call|>") + list(
        harmony_encoding.render(messages[1])
    )
    parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
    parsed = stream(parser, [[t] for t in ids])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected(messages)[2]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_output_that_is_not_harmony_is_kept_as_content(harmony_encoding):
    text = "Plain words, no channels at all."
    ids = harmony_encoding.encode(text)
    parsed = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding).parse("", ids)
    assert (parsed.reasoning_content, parsed.content) == (None, text)
    for plain in ("tomorrow it rains", " totally plain"):  # begins like " to=", is not one
        plain_ids = harmony_encoding.encode(plain)
        parsed = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding).parse(
            "", plain_ids
        )
        assert (parsed.reasoning_content, parsed.content) == (None, plain)
    # It streams as it comes (no header to wait for), not all at the end.
    parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
    assert parser.feed("", ids[:3]).content == harmony_encoding.decode(ids[:3])
    # Valid reasoning, then a token where <|start|> must come: the rest becomes content.
    ids = generated(harmony_encoding, [analysis(REASONING)], "<|end|>") + ids
    for cut in range(len(ids) + 1):
        parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding)
        streamed = stream(parser, [ids[:cut], ids[cut:]])
        assert (streamed.reasoning_content, streamed.content) == (REASONING, text), cut


# ----------------------------------------------------------------------------- prompts

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
DAY = datetime.date(2026, 12, 1)


def test_prompt_carries_effort_instructions_tools_and_history(harmony_encoding):
    """Against the conversation built directly with openai-harmony's API (the oracle)."""
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    ids = render_harmony_prompt(harmony_encoding, messages, TOOLS, "high", DAY)
    system = (
        harmony.SystemContent.new()
        .with_reasoning_effort(harmony.ReasoningEffort.HIGH)
        .with_conversation_start_date("2026-12-01")
    )
    developer = (
        harmony.DeveloperContent.new()
        .with_instructions("Answer in French.")
        .with_function_tools(
            [
                harmony.ToolDescription.new(
                    "get_weather", "Current weather of a city", TOOLS[0]["function"]["parameters"]
                )
            ]
        )
    )
    tool = harmony.Author.new(harmony.Role.TOOL, "functions.get_weather")
    oracle = harmony.Conversation.from_messages(
        [
            harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system),
            harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer),
            harmony.Message.from_role_and_content(harmony.Role.USER, "Weather in Paris?"),
            analysis("Need the tool."),
            call("get_weather", '{"city": "Paris"}').with_content_type("json"),
            harmony.Message.from_author_and_content(tool, '{"sky": "clear"}')
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    assert ids == harmony_encoding.render_conversation_for_completion(oracle, ASSISTANT)
    text = harmony_encoding.decode(ids)
    assert "Reasoning: high" in text and "Current date: 2026-12-01" in text
    assert "# Instructions\n\nAnswer in French." in text and "type get_weather = " in text
    assert "to=functions.get_weather<|channel|>commentary json<|message|>" in text
    assert text.endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sky": "clear"}'
        "<|end|><|start|>assistant"
    )


@pytest.mark.parametrize("effort", ["low", "medium", "high", None])
def test_reasoning_effort_reaches_the_system_message(harmony_encoding, effort):
    ids = render_harmony_prompt(harmony_encoding, [{"role": "user", "content": "hi"}], None, effort)
    text = harmony_encoding.decode(ids)
    assert f"Reasoning: {effort or 'medium'}\n" in text
    assert "<|start|>developer" not in text  # no instructions, no tools: no developer message


def test_bad_requests_name_the_field(harmony_encoding):
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(HarmonyPromptError, match="allowed values: low, medium, high") as info:
        render_harmony_prompt(harmony_encoding, user, None, "minimal")
    assert info.value.param == "reasoning_effort"
    orphan = [*user, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(HarmonyPromptError, match="call_9") as info:
        render_harmony_prompt(harmony_encoding, orphan)
    assert info.value.param == "messages"
    with pytest.raises(HarmonyPromptError) as info:
        render_harmony_prompt(harmony_encoding, user, [{"type": "function", "function": {}}])
    assert info.value.param == "tools"


def test_harmony_parser_is_also_vllms_openai_tool_parser(harmony_encoding):
    from torch_runner.serve.reasoning.harmony import HarmonyParser
    from torch_runner.serve.tool_parsers import get_tool_parser, tool_parser_names

    assert "openai" in tool_parser_names() and get_tool_parser("openai") is HarmonyParser
    ids = generated(
        harmony_encoding, [analysis(REASONING), call("get_weather", ARGUMENTS)], "<|call|>"
    )
    parsed = get_tool_parser("openai")(encoding=harmony_encoding).parse("", ids)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize(
    ("messages", "stops", "want"),
    [
        # stop inside the answer: the answer ends before it, the reasoning is whole
        ([analysis(REASONING), final(ANSWER)], ["sunny"], (REASONING, "It is ")),
        # stop inside the reasoning: nothing after it, not even the answer
        (
            [analysis(REASONING), final(ANSWER)],
            ["call get"],
            ("User wants the weather in Paris. I should ", None),
        ),
        # a stop string that never occurs (its prefix "It" does): everything
        ([analysis(REASONING), final(ANSWER)], ["It was"], (REASONING, ANSWER)),
    ],
)
def test_stop_strings_cut_the_parsed_fields(harmony_encoding, messages, stops, want):
    """The engine stops on the text, but fields come from tokens: the parser cuts them itself,
    whole and streamed at every split (a stop string split across chunks too)."""
    ids = generated(harmony_encoding, messages)
    for cut in range(len(ids) + 1):
        parser = new_reasoning_parser(
            "openai_gptoss", harmony_encoding=harmony_encoding, stop=stops
        )
        streamed = stream(parser, [ids[:cut], ids[cut:]])
        assert (streamed.reasoning_content, streamed.content) == want, cut
    parser = new_reasoning_parser("openai_gptoss", harmony_encoding=harmony_encoding, stop=stops)
    streamed = stream(parser, [[t] for t in ids])
    assert (streamed.reasoning_content, streamed.content) == want
    # Plain (non-harmony) output is cut the same way.
    plain = harmony_encoding.encode("Plain words, no channels at all.")
    parser = new_reasoning_parser(
        "openai_gptoss", harmony_encoding=harmony_encoding, stop=["no ch"]
    )
    assert stream(parser, [[t] for t in plain]).content == "Plain words, "


def test_include_stop_str_keeps_the_stop_string(harmony_encoding):
    ids = generated(harmony_encoding, [analysis(REASONING), final(ANSWER)])
    for cut in range(len(ids) + 1):
        parser = new_reasoning_parser(
            "openai_gptoss",
            harmony_encoding=harmony_encoding,
            stop=["sunny"],
            include_stop_str=True,
        )
        streamed = stream(parser, [ids[:cut], ids[cut:]])
        assert (streamed.reasoning_content, streamed.content) == (REASONING, "It is sunny"), cut
