"""gpt-oss harmony over real HTTP with the official openai client, on a tiny random gpt-oss.

Random weights write random text, so the known shapes come from a grammar: xgrammar's `Token(id)`
elements force harmony's special tokens (`<|channel|>`, `<|message|>`, `<|call|>`) while the words
inside stay the model's. The oracles: the grammar's guarantee (each field fullmatches its rule),
openai-harmony parsing the engine's raw token ids on its own, prompts built directly with
openai-harmony's API, and stream == non-stream for one seed.
"""

from __future__ import annotations

import datetime
import json

import jsonschema
import openai
import openai_harmony as harmony
import pytest
from harmony_tokenizer import save_harmony_tokenizer
from reasoning_helpers import USER, WORDS_RE, start, stream_message, tokenize
from serve_fixtures import MODEL_NAME
from tiny_models import build_tiny_model

pytestmark = pytest.mark.slow  # real HTTP servers; CI still runs them

WORDS = "[a-z] [a-z ]{2,10}"  # EBNF: what the grammar lets the model write inside a message
START, CHANNEL, MESSAGE, END, CALL, CONSTRAIN = 200006, 200005, 200008, 200007, 200012, 200003
ANSWER_GRAMMAR = (
    f'root ::= Token({CHANNEL}) "analysis" Token({MESSAGE}) words Token({END}) Token({START}) '
    f'"assistant" Token({CHANNEL}) "final" Token({MESSAGE}) words\nwords ::= {WORDS}'
)
CALL_GRAMMAR = (
    f'root ::= Token({CHANNEL}) "analysis" Token({MESSAGE}) words Token({END}) Token({START}) '
    f'"assistant" Token({CHANNEL}) "commentary to=functions.get_weather " Token({CONSTRAIN}) '
    f'"json" Token({MESSAGE}) "{{\\"city\\": \\"" [a-z]{{1,8}} "\\"}}" Token({CALL})\n'
    f"words ::= {WORDS}"
)
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": WEATHER_SCHEMA,
        },
    }
]
TIME_SCHEMA = {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"]}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory, harmony_encoding):
    """Tiny random gpt-oss (vocab 201,088, eos <|return|> as gpt-oss's config has it) with the real
    o200k_harmony tokenizer. <|call|> is not an EOS id here: it stops only as a harmony stop token."""
    path = tmp_path_factory.mktemp("gptoss_serve") / "tiny-gpt-oss"
    model = build_tiny_model(
        "gpt_oss", vocab_size=201088, bos_token_id=199998, eos_token_id=200002, pad_token_id=199999
    )
    model.save_pretrained(path)
    save_harmony_tokenizer(path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        server, client, spy = start(path)
        yield client, spy
        server.stop()


def harmony_oracle(encoding, token_ids):
    """openai-harmony's own parse of the raw output: [(channel, recipient, text)]."""
    ids = [t for t in token_ids if t != 199999]  # the grammar's end-of-text
    messages = encoding.parse_messages_from_completion_tokens(ids, harmony.Role.ASSISTANT)
    return [(m.channel, m.recipient, m.content[0].text) for m in messages]


def test_harmony_reasoning_and_answer(gptoss, harmony_encoding):
    client, spy = gptoss
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=5,
        extra_body={"response_format": {"type": "grammar", "grammar": ANSWER_GRAMMAR}},
    )
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert WORDS_RE.fullmatch(message.reasoning_content) and WORDS_RE.fullmatch(message.content)
    assert reply.choices[0].finish_reason == "stop" and not message.tool_calls
    raw = spy.outputs[f"{reply.id}-0"]
    assert harmony_oracle(harmony_encoding, raw) == [
        ("analysis", None, message.reasoning_content),
        ("final", None, message.content),
    ]
    assert stream_message(client, **request) == (
        message.content,
        message.reasoning_content,
        [],
        "stop",
    )


def test_harmony_tool_call(gptoss, harmony_encoding):
    client, spy = gptoss
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        tools=TOOLS,
        max_tokens=80,
        temperature=1.0,
        seed=2,
        extra_body={"response_format": {"type": "grammar", "grammar": CALL_GRAMMAR}},
    )
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    assert WORDS_RE.fullmatch(choice.message.reasoning_content)
    raw = spy.outputs[f"{reply.id}-0"]
    assert raw[-1] == CALL  # generation ended at <|call|>
    assert harmony_oracle(harmony_encoding, raw)[1] == (
        "commentary",
        "functions.get_weather",
        call.function.arguments,
    )
    content, reasoning, calls, finish = stream_message(client, **request)
    assert (content, reasoning, finish) == (
        choice.message.content,
        choice.message.reasoning_content,
        "tool_calls",
    )
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_harmony_forced_tool_choice_is_a_harmony_call(gptoss, harmony_encoding, tool_choice):
    """required / named: a grammar makes the model write harmony's own call message."""
    client, spy = gptoss
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[*TOOLS, TIME_TOOL],
        tool_choice=tool_choice,
        max_tokens=60,
        temperature=1.0,
        seed=4,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schemas = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    raw = spy.outputs[f"{reply.id}-0"]
    assert raw[-1] == CALL
    assert harmony_oracle(harmony_encoding, raw) == [
        ("commentary", f"functions.{call.function.name}", call.function.arguments)
    ]


def test_harmony_stop_tokens_end_generation(gptoss):
    """A forced first token of <|call|> ends the turn: one completion token, not max_tokens."""
    client, _ = gptoss
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=20, logit_bias={str(CALL): 100}
    )
    assert reply.usage.completion_tokens == 1
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_effort_and_history_reach_the_harmony_prompt(gptoss, harmony_encoding):
    client, spy = gptoss
    messages = [
        {"role": "system", "content": "Answer in French."},
        *USER,
        {
            "role": "assistant",
            "content": None,
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
    client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, reasoning_effort="high", max_tokens=1
    )
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    system = (
        harmony.SystemContent.new()
        .with_reasoning_effort(harmony.ReasoningEffort.HIGH)
        .with_conversation_start_date(today)
    )
    developer = (
        harmony.DeveloperContent.new()
        .with_instructions("Answer in French.")
        .with_function_tools(
            [
                harmony.ToolDescription.new(
                    "get_weather", "Current weather of a city", WEATHER_SCHEMA
                )
            ]
        )
    )
    assistant = harmony.Role.ASSISTANT
    oracle = harmony.Conversation.from_messages(
        [
            harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system),
            harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer),
            harmony.Message.from_role_and_content(harmony.Role.USER, USER[0]["content"]),
            harmony.Message.from_role_and_content(assistant, '{"city": "Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("json"),
            harmony.Message.from_author_and_content(
                harmony.Author.new(harmony.Role.TOOL, "functions.get_weather"), '{"sky": "clear"}'
            )
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    assert spy.prompts[-1] == harmony_encoding.render_conversation_for_completion(oracle, assistant)
    assert "Reasoning: high" in harmony_encoding.decode(spy.prompts[-1])


def test_random_harmony_output_streams_as_it_parses(gptoss):
    """Free random output (mostly not harmony) reaches the client whole, stream == non-stream."""
    client, _ = gptoss
    request = dict(model=MODEL_NAME, messages=USER, max_tokens=24, temperature=0)
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content or message.reasoning_content
    assert stream_message(client, **request)[:3] == (
        message.content,
        message.reasoning_content,
        [],
    )


def test_reasoning_effort_in_chat_template_kwargs_reaches_harmony(gptoss, harmony_encoding):
    """vLLM users also send the effort as a template variable; gpt-oss takes it from there."""
    client, spy = gptoss
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}},
    )
    assert "Reasoning: low\n" in harmony_encoding.decode(spy.prompts[-1])


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("reasoning_effort", "minimal", "low, medium, high"),
        ("chat_template_kwargs", {"enable_thinking": False}, "allowed: reasoning_effort"),
        ("add_generation_prompt", False, "always opens a new assistant turn"),
    ],
)
def test_harmony_bad_input_names_the_field(gptoss, field, value, allowed):
    client, _ = gptoss
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=1, extra_body={field: value}
        )
    assert info.value.body["param"] == field and allowed in info.value.body["message"]
    # The server is unaffected: the next request answers.
    assert client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1).choices


@pytest.mark.parametrize(("include", "want"), [(False, "hello "), (True, "hello world")])
def test_stop_string_ends_the_harmony_answer(gptoss, include, want):
    """OpenAI's rule (the stop string is not in the text; vLLM's include_stop_str_in_output
    keeps it) holds for fields parsed from tokens."""
    client, _ = gptoss
    grammar = f'root ::= Token({CHANNEL}) "final" Token({MESSAGE}) "hello world" {WORDS}'
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=30,
        temperature=1.0,
        seed=3,
        stop=["world"],
        extra_body={
            "response_format": {"type": "grammar", "grammar": grammar},
            "include_stop_str_in_output": include,
        },
    )
    reply = client.chat.completions.create(**request)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (want, "stop")
    assert stream_message(client, **request) == (want, None, [], "stop")


def test_each_choice_gets_its_own_harmony_parser(gptoss):
    client, _ = gptoss
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body={"response_format": {"type": "grammar", "grammar": ANSWER_GRAMMAR}},
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert WORDS_RE.fullmatch(choice.message.reasoning_content)
        assert WORDS_RE.fullmatch(choice.message.content)
    assert len({c.message.content for c in reply.choices}) > 1  # seeds differ per choice


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_is_the_body_of_a_final_message(gptoss, harmony_encoding, stream):
    """response_format on gpt-oss: the model writes <|channel|>final<|message|> then the JSON."""
    client, spy = gptoss
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=40,
        temperature=1.0,
        seed=6,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA},
        },
    )
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), WEATHER_SCHEMA)
    assert message.reasoning_content is None and reply.choices[0].finish_reason == "stop"
    raw = spy.outputs[f"{reply.id}-0"]
    assert raw[0] == CHANNEL  # "final" itself may take any tokenization the model picks
    assert harmony_oracle(harmony_encoding, raw) == [("final", None, message.content)]
    if stream:
        assert stream_message(client, **request) == (message.content, None, [], "stop")


def test_harmony_tool_result_without_its_call_is_a_400(gptoss):
    client, _ = gptoss
    orphan = [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=orphan, tools=TOOLS, max_tokens=1)
    assert info.value.body["param"] == "messages.1.tool_call_id"
    assert "call_9" in info.value.body["message"]


def test_tokenize_counts_the_harmony_prompt_a_chat_request_gets(gptoss):
    client, spy = gptoss
    client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1)
    assert tokenize(client, messages=USER)["tokens"] == spy.prompts[-1]
    low = tokenize(client, messages=USER, chat_template_kwargs={"reasoning_effort": "low"})
    client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=1, reasoning_effort="low"
    )
    assert low["tokens"] == spy.prompts[-1]
    refused = tokenize(client, messages=USER, chat_template_kwargs={"enable_thinking": False})
    assert refused["error"]["param"] == "chat_template_kwargs"


def _final_channel_tokens(encoding, token_ids):
    """openai-harmony's own streaming parser, token by token: the ids whose text it put in the
    final channel's message body (the oracle for content logprobs)."""
    parser = harmony.StreamableParser(encoding, harmony.Role.ASSISTANT)
    ids = []
    for token_id in token_ids:
        if token_id == 199999:  # the grammar's end-of-text
            continue
        parser.process(token_id)
        if parser.current_channel == "final" and parser.last_content_delta:
            ids.append(token_id)
    return ids


def test_harmony_logprobs_cover_exactly_the_final_message(gptoss, harmony_encoding):
    from reasoning_helpers import stream_content_logprobs

    client, spy = gptoss
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=5,
        extra_body={"response_format": {"type": "grammar", "grammar": ANSWER_GRAMMAR}},
    )
    reply = client.chat.completions.create(**request, logprobs=True, top_logprobs=2)
    message, items = reply.choices[0].message, reply.choices[0].logprobs.content
    oracle = _final_channel_tokens(harmony_encoding, spy.outputs[f"{reply.id}-0"])
    assert len(items) == len(oracle) and message.reasoning_content
    assert [harmony_encoding.decode([t]) for t in oracle] == [item.token for item in items]
    assert "".join(item.token for item in items) == message.content
    assert all(len(item.top_logprobs) == 2 for item in items)
    pairs = stream_content_logprobs(client, **request)
    assert all(delta == tokens for delta, tokens in pairs), pairs
    assert "".join(delta for delta, _ in pairs) == message.content
