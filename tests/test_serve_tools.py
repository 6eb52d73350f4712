"""Tool calling over real HTTP with the official openai client, on the tiny checkpoint.

Its chat template knows no tools, so the server uses the default tool prompt and the hermes
parser. The random model's free output is never a call, so a valid call proves the grammar
(`required`, named) or the parser (`auto`, with a regex response_format making the model write a
hermes block) did it. Oracles: `jsonschema` for arguments, the client's own stream accumulator
(`client.chat.completions.stream`) for stream == non-stream, and a request without tools for
`none`.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_fixtures import API_KEY, MODEL_NAME, ThreadedServer, save_serve_checkpoint
from test_serve_auto_tools import TIME as TIME_SCHEMA
from test_serve_auto_tools import WEATHER as WEATHER_SCHEMA

pytestmark = pytest.mark.slow  # a real HTTP server; CI still runs it

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
HERMES_REGEX = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("serve_tools") / "tiny")
    process = ThreadedServer(path, max_total_tokens=8192)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


END_LIST = {"93": 30}  # byte tokenizer: id 93 is "]"; the grammar allows it only to end the list


def _create(client, **kwargs):
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0)
    return client.chat.completions.create(**{**args, **kwargs})


def _calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_valid_calls(message):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_gives_valid_calls(client):
    reply = _create(
        client, tool_choice="required", temperature=1.0, seed=0, n=4, logit_bias=END_LIST
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _assert_valid_calls(choice.message)


def test_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = _create(client, tool_choice=choice, temperature=1.0, seed=1, n=3)
    for item in reply.choices:
        _assert_valid_calls(item.message)
        assert [c.function.name for c in item.message.tool_calls] == ["get_time"]
        assert item.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client):
    reply = _create(
        client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3, n=3
    )
    for choice in reply.choices:
        assert len(choice.message.tool_calls) == 1
        _assert_valid_calls(choice.message)


def test_auto_parses_a_hermes_call_the_model_wrote(client):
    reply = _create(
        client, tool_choice="auto", response_format={"type": "regex", "regex": HERMES_REGEX}
    )
    [choice] = reply.choices
    assert choice.message.content == "Sure."
    assert choice.finish_reason == "tool_calls"
    _assert_valid_calls(choice.message)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_auto_text_stays_content(client):
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0
    )
    reply = _create(client, max_tokens=20)  # tool_choice defaults to auto with tools
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content  # random bytes, never a <tool_call> block
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool prompt was added


def test_none_offers_no_tools(client):
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0
    )
    reply = _create(client, tool_choice="none", max_tokens=20)
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "tool_choice, extra",
    [
        ("required", {"logit_bias": END_LIST}),
        ({"type": "function", "function": {"name": "get_weather"}}, {}),
        ("auto", {"response_format": {"type": "regex", "regex": HERMES_REGEX}}),
    ],
)
def test_stream_accumulates_to_the_non_streamed_answer(client, tool_choice, extra):
    whole = _create(client, tool_choice=tool_choice, **extra)
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0)
    with client.chat.completions.stream(**args, tool_choice=tool_choice, **extra) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    assert _calls(streamed.choices[0].message) == _calls(whole.choices[0].message)


def test_stream_deltas_have_openai_shape(server):
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [
        piece
        for line in lines
        for choice in json.loads(line[6:])["choices"]
        for piece in choice["delta"].get("tool_calls") or []
    ]
    first, rest = pieces[0], pieces[1:]
    assert set(first) == {"index", "id", "type", "function"}, first
    assert first["type"] == "function" and first["function"]["name"] in SCHEMAS
    for piece in rest:  # one call: later pieces carry only argument fragments
        assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
    assert len(pieces) > 3


def test_two_turn_round_trip(client):
    first = _create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),  # the assistant turn exactly as returned
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments)


def _bad(client, match: str, param: str, **kwargs):
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, **kwargs)
    error = info.value.body
    assert error["param"] == param, error
    assert match in error["message"], error
    return error


@pytest.mark.parametrize(
    "tools, param, match",
    [
        ([{"type": "function"}], "tools.0.function", "required"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type", "function"),
        (
            [{"type": "function", "function": {"name": "has space"}}],
            "tools.0.function.name",
            "invalid",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools.0.function.parameters",
            "",
        ),
        (
            [{"type": "function", "function": {"name": "f", "bogus": 1}}],
            "tools.0.function.bogus",
            "",
        ),
        (TOOLS + [TOOLS[0]], "tools.2.function.name", "defined twice"),
    ],
)
def test_malformed_tool_definitions_are_400_naming_the_field(client, tools, param, match):
    _bad(client, match, param, tools=tools)


def test_bad_tool_choice_values(client):
    unknown = {"type": "function", "function": {"name": "nope"}}
    _bad(client, "'nope'", "tool_choice.function.name", tool_choice=unknown)
    _bad(client, "allowed values", "tool_choice", tool_choice="sometimes")
    _bad(client, "tool_choice", "tool_choice", tool_choice={"type": "function"})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


def test_schema_xgrammar_cannot_compile_names_the_tool(client):
    tools = [
        *TOOLS,
        {"type": "function", "function": {"name": "broken", "parameters": {"type": "objec"}}},
    ]
    error = _bad(
        client, "'broken'", "tools.2.function.parameters", tools=tools, tool_choice="required"
    )
    assert "objec" in error["message"]


def test_tool_message_without_matching_call_is_400(client):
    orphan = [*MESSAGES, {"role": "tool", "tool_call_id": "call_missing", "content": "42"}]
    _bad(client, "call_missing", "messages.1.tool_call_id", messages=orphan)
    no_id = [*MESSAGES, {"role": "tool", "content": "42"}]
    _bad(client, "tool_call_id", "messages.1.tool_call_id", messages=no_id)
    bad_args = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
            ],
        },
    ]
    _bad(client, "not valid JSON", "messages.1.tool_calls.0.function.arguments", messages=bad_args)


def test_forced_choice_with_response_format_is_400(client):
    _bad(
        client,
        "cannot be combined",
        "response_format",
        tool_choice="required",
        response_format={"type": "json_object"},
    )


def test_server_unaffected_after_bad_requests(client):
    test_bad_tool_choice_values(client)
    reply = _create(client, tool_choice="required", max_tokens=80, logit_bias=END_LIST)
    _assert_valid_calls(reply.choices[0].message)


def test_stream_with_several_choices_matches_non_stream(client):
    args = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=11,
        n=3,
        logit_bias=END_LIST,
    )
    whole = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion()
    assert len(streamed.choices) == 3
    for got, want in zip(streamed.choices, whole.choices, strict=True):
        assert got.index == want.index
        assert _calls(got.message) == _calls(want.message)
        assert got.finish_reason == want.finish_reason == "tool_calls"


def test_strict_pydantic_tools_parse_through_the_client_helpers(client):
    """`openai.pydantic_function_tool` + `chat.completions.parse` / `.stream`: the path agent
    frameworks take; the client validates the arguments into the model itself."""
    from typing import Literal

    import pydantic

    class GetWeather(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        days: int = pydantic.Field(ge=1, le=7)

    args = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    [call] = client.chat.completions.parse(**args).choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(**args) as stream:
        [streamed] = stream.get_final_completion().choices[0].message.tool_calls
    assert streamed.function.parsed_arguments == call.function.parsed_arguments


def test_auto_constrains_calls_with_the_servers_grammar(server, client):
    """The engine gets the structural tag of serve/auto_tools.py for `auto` (what it enforces is
    tested with xgrammar's matcher in test_serve_auto_tools.py); xgrammar's matcher on the
    server's own grammar must accept the answer and a hermes call, and reject a call to an
    unknown function."""
    import xgrammar as xgr
    from engine_helpers import byte_tokenizer

    seen = []
    original = server.async_engine.submit

    def submit(requests):
        seen.extend(params.structured for _, _, params in requests)
        return original(requests)

    server.async_engine.submit = submit
    try:
        reply = _create(client, max_tokens=20, temperature=0)
    finally:
        server.async_engine.submit = original
    [spec] = seen
    assert spec is not None and spec.kind == "ebnf"
    info = xgr.TokenizerInfo.from_huggingface(byte_tokenizer(), vocab_size=256)
    grammar = xgr.GrammarCompiler(info).compile_grammar(spec.spec)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(reply.choices[0].message.content)
    good = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert xgr.GrammarMatcher(grammar).accept_string("Hi " + good)
    assert not xgr.GrammarMatcher(grammar).accept_string('<tool_call>\n{"name": "rm_rf"')
    assert not xgr.GrammarMatcher(grammar).accept_string(good.replace("CET", "cet"))


def test_forced_calls_have_no_content_logprobs(client):
    """A forced call's message has no content, so `logprobs.content` lists no token (stream too)."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = _create(client, tool_choice=choice, logprobs=True, top_logprobs=1)
    assert reply.choices[0].message.content is None and reply.choices[0].message.tool_calls
    assert reply.choices[0].logprobs.content == [] and reply.usage.completion_tokens > 3
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0)
    chunks = list(
        client.chat.completions.create(**args, tool_choice=choice, logprobs=True, stream=True)
    )
    assert not [
        item
        for chunk in chunks
        for c in chunk.choices
        for item in ((c.logprobs.content or []) if c.logprobs else [])
    ]


def test_auto_call_text_has_no_content_logprobs(client):
    """Byte tokenizer: one token per character. The hermes block and the blank before it are not
    content, so the content's logprob tokens spell exactly "Sure." (stream: chunk by chunk)."""
    extra = {"response_format": {"type": "regex", "regex": HERMES_REGEX}, "logprobs": True}
    reply = _create(client, tool_choice="auto", **extra)
    assert reply.choices[0].message.tool_calls
    assert "".join(t.token for t in reply.choices[0].logprobs.content) == "Sure."
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0)
    pairs = []
    for chunk in client.chat.completions.create(**args, tool_choice="auto", stream=True, **extra):
        for c in chunk.choices:
            tokens = "".join(t.token for t in (c.logprobs.content or [])) if c.logprobs else ""
            if c.delta.content or tokens:
                pairs.append((c.delta.content or "", tokens))
    assert all(delta == tokens for delta, tokens in pairs), pairs
    assert "".join(delta for delta, _ in pairs) == "Sure."
