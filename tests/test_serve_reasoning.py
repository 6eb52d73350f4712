"""Reasoning over real HTTP with the official openai client: gpt-oss harmony and `<think>` models.

Tiny random checkpoints produce random text, so the known shapes come from a grammar: xgrammar's
`Token(id)` elements force harmony's special tokens (`<|channel|>`, `<|message|>`, `<|call|>`) and
a regex forces `<think>...</think>`, while the words inside stay the model's. The oracles are the
grammar's guarantee (each field fullmatches its rule), openai-harmony parsing the engine's raw
token ids on its own, prompts rendered directly with openai-harmony's API or with transformers'
`apply_chat_template`, and stream == non-stream for one seed.
"""

from __future__ import annotations

import datetime
import json
import re

import jsonschema
import openai
import openai_harmony as harmony
import pytest
from harmony_tokenizer import save_harmony_tokenizer
from serve_fixtures import API_KEY, MODEL_NAME, ThreadedServer
from tiny_models import build_tiny_model

pytestmark = pytest.mark.slow  # real HTTP servers; CI still runs them

WORDS = "[a-z] [a-z ]{2,10}"  # EBNF: what the grammar lets the model write inside a message
WORDS_RE = re.compile(r"[a-z][a-z ]{2,10}")
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
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)


class EngineSpy:
    """Records what the server hands the engine (prompt ids) and what came back (output ids)."""

    def __init__(self, async_engine):
        self.prompts: list[list[int]] = []
        self.outputs: dict[str, list[int]] = {}
        original = async_engine.generate

        async def generate(request_id, prompt_ids, params):
            self.prompts.append(list(prompt_ids))
            async for output in original(request_id, prompt_ids, params):
                self.outputs[request_id] = list(output.token_ids)
                yield output

        async_engine.generate = generate


def start(path):
    server = ThreadedServer(path, max_total_tokens=4096)
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    return server, client, EngineSpy(server.async_engine)


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


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Tiny random Qwen3 with the byte tokenizer and a template that writes `<think>` blocks."""
    from engine_helpers import byte_tokenizer

    path = tmp_path_factory.mktemp("qwen3_serve") / "tiny-qwen3"
    build_tiny_model("qwen3", max_position_embeddings=2048).save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(path)
    server, client, spy = start(path)
    yield client, spy, tokenizer
    server.stop()


def stream_message(client, **request):
    """What a client builds from the stream: content, reasoning, calls by index, finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None and call["arguments"] == ""  # id + name come first
                    call["id"], call["name"] = piece.id, piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)], finish


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


# ----------------------------------------------------------------------------- <think> models


@pytest.mark.parametrize("stream", [False, True])
def test_think_output_splits_into_reasoning_and_content(qwen3, stream):
    client, _, _ = qwen3
    regex = r"<think>[a-z][a-z ]{2,10}</think>[a-z][a-z ]{2,10}"
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=7,
        extra_body={"response_format": {"type": "regex", "regex": regex}},
    )
    message = client.chat.completions.create(**request).choices[0].message
    assert WORDS_RE.fullmatch(message.reasoning_content) and WORDS_RE.fullmatch(message.content)
    assert re.fullmatch(regex, f"<think>{message.reasoning_content}</think>{message.content}")
    if stream:
        assert stream_message(client, **request) == (
            message.content,
            message.reasoning_content,
            [],
            "stop",
        )


def test_think_opened_by_the_template(qwen3):
    """The template writes `<think>\\n` itself (a chat_template_kwargs switch): output starts in it."""
    client, spy, tokenizer = qwen3
    regex = r"[a-z][a-z ]{2,10}</think>[a-z][a-z ]{2,10}"
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=1,
        extra_body={
            "response_format": {"type": "regex", "regex": regex},
            "chat_template_kwargs": {"open_think": True},
        },
    )
    message = client.chat.completions.create(**request).choices[0].message
    assert tokenizer.decode(spy.prompts[-1]).endswith("<|im_start|>assistant\n<think>\n")
    assert re.fullmatch(regex, f"{message.reasoning_content}</think>{message.content}")
    assert WORDS_RE.fullmatch(message.content)
    assert stream_message(client, **request)[:2] == (message.content, message.reasoning_content)


def test_chat_template_kwargs_reach_the_template(qwen3):
    client, spy, tokenizer = qwen3
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    oracle = tokenizer.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert tokenizer.decode(spy.prompts[-1]) == oracle
    assert oracle.endswith("<think>\n\n</think>\n\n")


def test_reserved_chat_template_kwargs_are_refused(qwen3):
    client, _, _ = qwen3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=USER,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert info.value.body["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in info.value.body["message"]


@pytest.fixture(scope="module")
def qwen3_template(tmp_path_factory):
    """The same kind of tiny Qwen3, served with Qwen3-8B's own template (tool_templates.QWEN3)."""
    from engine_helpers import byte_tokenizer
    from tool_templates import QWEN3

    path = tmp_path_factory.mktemp("qwen3_template") / "tiny-qwen3"
    build_tiny_model("qwen3", max_position_embeddings=2048).save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(path)
    server, client, spy = start(path)
    assert server.state.chat_format.reasoning_parser == "qwen3"  # picked from the template
    yield client, spy, tokenizer
    server.stop()


def test_qwen3_template_turns_thinking_off(qwen3_template):
    client, spy, tokenizer = qwen3_template
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    oracle = tokenizer.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert tokenizer.decode(spy.prompts[-1]) == oracle
    assert oracle.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_history_reasoning_content_reaches_the_template(qwen3):
    """An earlier answer's reasoning_content, sent back in the history, is the template's to render."""
    client, spy, tokenizer = qwen3
    messages = [
        *USER,
        {"role": "assistant", "content": "sunny", "reasoning_content": "Recall the forecast."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    oracle = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(spy.prompts[-1]) == oracle
    assert "<think>Recall the forecast.</think>sunny" in oracle
