"""An OpenAI surface clients accept: every reference field, vLLM's extras, models.retrieve,
/tokenize and /detokenize, and chat logprobs that cover exactly the message's tokens.

The field lists come from the installed official `openai` client's own request types, so a field
a newer SDK sends and this server does not know fails here first. Oracles: the same server's
plain greedy answer (an ignored field must not change it), the checkpoint's tokenizer (tokenize,
detokenize, logprobs), xgrammar-free checks of the constrained outputs (json.loads, re.fullmatch,
membership).
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from serve_fixtures import API_KEY, MODEL_NAME, ThreadedServer, save_serve_checkpoint
from transformers import AutoTokenizer

# The tools and reasoning work (issue 16 points 1-5) owns these; they are tested there.
OTHER_OWNERS = {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}
MESSAGES = [{"role": "user", "content": "Say something."}]
SPECIAL = "!"  # marked special in this test's tokenizer (byte 33 keeps its id)
SPECIAL_ID = 33

# Every Chat Completions field of the reference with a value a client may send; fields that do
# not steer sampling must leave the greedy answer unchanged.
CHAT_VALUES = {
    "audio": None,
    "frequency_penalty": 0.0,
    "function_call": None,
    "functions": None,
    "logit_bias": {},
    "logprobs": False,
    "max_completion_tokens": 8,
    "max_tokens": 8,
    "metadata": {"team": "surface"},
    "modalities": ["text"],
    "moderation": None,
    "n": 1,
    "prediction": {"type": "content", "content": "a predicted answer"},
    "presence_penalty": 0.0,
    "prompt_cache_key": "user-42",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "response_format": {"type": "text"},
    "safety_identifier": "hashed-user",
    "seed": 5,
    "service_tier": "priority",
    "stop": ["\u0000never"],
    "store": True,
    "stream_options": None,
    "temperature": 0.0,
    "top_logprobs": None,
    "top_p": 1.0,
    "user": "someone",
    "verbosity": "high",
    "web_search_options": None,
}
COMPLETION_VALUES = {
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "logprobs": None,
    "max_tokens": 8,
    "n": 1,
    "presence_penalty": 0.0,
    "seed": 5,
    "stop": ["\u0000never"],
    "stream_options": None,
    "suffix": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "user": "someone",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("surface") / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [SPECIAL]})
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert tok.convert_tokens_to_ids(SPECIAL) == SPECIAL_ID and SPECIAL_ID in tok.all_special_ids
    return tok


@pytest.fixture(scope="module")
def server(checkpoint):
    running = ThreadedServer(checkpoint, max_total_tokens=4096)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    )


def _post(server, path, body):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def _chat(client, **fields):
    fields = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, **fields}
    return client.chat.completions.create(**fields)


def _greedy_chat_text(client) -> str:
    return _chat(client, temperature=0.0).choices[0].message.content


# ----------------------------------------------------------------------------- OpenAI fields


def test_the_field_tables_cover_the_openai_reference():
    chat = set(chat_params.CompletionCreateParamsBase.__annotations__) - OTHER_OWNERS
    assert chat - {"messages", "model"} == set(CHAT_VALUES)
    completion = set(completion_params.CompletionCreateParamsBase.__annotations__)
    assert completion - {"prompt", "model"} == set(COMPLETION_VALUES)


def test_every_chat_field_is_accepted_and_the_ignored_ones_change_nothing(client):
    baseline = _greedy_chat_text(client)
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **CHAT_VALUES)
    assert response.choices[0].message.content == baseline
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        **{**CHAT_VALUES, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == baseline
    assert chunks[-1].usage is not None


def test_every_completion_field_is_accepted(client):
    fields = {"model": MODEL_NAME, "prompt": "Once upon", **COMPLETION_VALUES}
    baseline = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=8, temperature=0.0
    )
    assert client.completions.create(**fields).choices[0].text == baseline.choices[0].text


# Non-null values of the fields accepted and ignored (docs/serving.md "Request fields"): the
# greedy answer must not change. The names come from the openai SDK's own request type.
IGNORED_NON_NULL = {
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {"search_context_size": "low", "user_location": None},
    "moderation": {"model": "omni-moderation-latest"},
}


def test_ignored_fields_are_openai_fields():
    assert set(IGNORED_NON_NULL) <= set(chat_params.CompletionCreateParamsBase.__annotations__)


@pytest.mark.parametrize(("field", "value"), sorted(IGNORED_NON_NULL.items()))
def test_non_null_ignored_fields_are_accepted_and_change_nothing(client, field, value):
    baseline = _greedy_chat_text(client)
    assert _chat(client, temperature=0.0, **{field: value}).choices[0].message.content == baseline


def test_audio_output_is_a_400_naming_modalities(client):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    assert info.value.body["param"] == "modalities", info.value.body


LEGACY_FUNCTION = {
    "name": "pick",
    "parameters": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    },
}


def test_legacy_functions_are_taken_as_tools(client):
    import jsonschema

    reply = _chat(
        client,
        functions=[LEGACY_FUNCTION],
        function_call={"name": "pick"},
        max_tokens=40,
        temperature=0.0,
    )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "pick"
    jsonschema.validate(json.loads(call.function.arguments), LEGACY_FUNCTION["parameters"])
    with pytest.raises(openai.BadRequestError) as info:
        _chat(
            client,
            functions=[LEGACY_FUNCTION],
            tools=[{"type": "function", "function": LEGACY_FUNCTION}],
        )
    assert info.value.body["param"] == "functions"


@pytest.mark.parametrize(
    ("field", "endpoint"),
    [("temprature", "chat"), ("stor", "chat"), ("guided_jsn", "chat"), ("echos", "completions")],
)
def test_typos_are_still_a_400_naming_the_field(client, field, endpoint):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            _chat(client, extra_body={field: 1})
        else:
            client.completions.create(model=MODEL_NAME, prompt="x", extra_body={field: 1})
    assert field in info.value.body["message"] and info.value.body["param"] == field


def test_history_refusals_render_as_text(server, client, tokenizer):
    refused = [*MESSAGES, {"role": "assistant", "content": None, "refusal": "I can't."}]
    as_text = [*MESSAGES, {"role": "assistant", "content": "I can't."}]
    parts = [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    ]
    expected = tokenizer.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    for messages in (refused, parts):
        body = _post(server, "/tokenize", {"messages": messages}).json()
        assert body["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
        assert _chat(client, messages=messages, temperature=0.0).choices[0].finish_reason


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                      {"type": "image_url", "image_url": {"url": "data:,"}}]},
         "messages.0.content.1.type"),
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
         "messages.0.content.0.type"),
        ({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "messages.0.audio"),
    ],
)  # fmt: skip
def test_non_text_message_parts_are_a_400_naming_them(server, client, message, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, messages=[message])
    assert info.value.body["param"] == param, info.value.body
    response = _post(server, "/tokenize", {"messages": [message]})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ----------------------------------------------------------------------------- vLLM extras


def _sampled(client, n=3, **extra):
    """n seeded samples at temperature 1, long enough for every constrained output to end."""
    response = _chat(client, n=n, temperature=1.0, max_tokens=200, seed=11, extra_body=extra)
    assert all(choice.finish_reason == "stop" for choice in response.choices)
    return [choice.message.content for choice in response.choices]


def test_guided_choice_output_is_one_of_the_choices(client):
    choices = ["red", "green", "blue sky"]
    assert all(text in choices for text in _sampled(client, guided_choice=choices))
    outputs = _sampled(client, structured_outputs={"choice": choices})
    assert all(text in choices for text in outputs)


def test_guided_regex_output_matches(client):
    for text in _sampled(client, guided_regex="[ab]{3}-[0-9]{2}"):
        assert re.fullmatch("[ab]{3}-[0-9]{2}", text), text


def test_guided_json_output_parses_and_fits_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for value in (schema, json.dumps(schema)):
        for text in _sampled(client, n=2, guided_json=value):
            parsed = json.loads(text, strict=False)  # raw control characters inside strings
            assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int), text


def test_guided_grammar_output_is_a_sentence_of_it(client):
    grammar = 'root ::= ("yes" | "no") " " [0-9]'
    for text in _sampled(client, guided_grammar=grammar):
        assert re.fullmatch("(yes|no) [0-9]", text), text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ],
)
def test_bad_or_conflicting_guided_fields_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body


def test_skip_special_tokens(client, tokenizer):
    forced = {"logit_bias": {str(SPECIAL_ID): 100}, "temperature": 0.0, "max_tokens": 4}
    texts = {}
    for skip in (True, False):
        response = client.completions.create(
            model=MODEL_NAME, prompt="x", **forced, extra_body={"skip_special_tokens": skip}
        )
        texts[skip] = response.choices[0].text
    ids = [SPECIAL_ID] * 4
    assert texts[True] == tokenizer.decode(ids, skip_special_tokens=True) == ""
    assert texts[False] == tokenizer.decode(ids, skip_special_tokens=False) == SPECIAL * 4
    response = _chat(client, temperature=0.0, extra_body={"spaces_between_special_tokens": False})
    assert response.choices[0].message.content == _greedy_chat_text(client)


def test_include_stop_str_in_output(client):
    full = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=24, temperature=0.0
    ).choices[0]
    text = full.text
    stop = text[4:6]
    start = text.index(stop)
    for include, expected in ((False, text[:start]), (True, text[: start + len(stop)])):
        choice = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon",
            max_tokens=24,
            temperature=0.0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": include},
        ).choices[0]
        assert (choice.text, choice.finish_reason) == (expected, "stop")


# ----------------------------------------------------------------------------- models, tokenize


def test_models_retrieve(client, server):
    for name in (MODEL_NAME, "default"):
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model" and card.model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    error = info.value.body
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    raw = httpx.get(f"{server.base_url}/v1/models/x", headers={"Authorization": "Bearer bad"})
    assert raw.status_code == 401


def test_tokenize_prompt_matches_the_tokenizer(server, tokenizer):
    prompt = "héllo wörld"
    body = _post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(prompt)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = _post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    back = _post(server, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back == {"prompt": prompt}
    with_special = _post(server, "/detokenize", {"tokens": [SPECIAL_ID, *plain["tokens"]]}).json()
    assert with_special["prompt"] == tokenizer.decode([SPECIAL_ID, *plain["tokens"]])


def test_tokenize_messages_matches_the_chat_template(server, tokenizer):
    for add_generation_prompt in (True, False):
        text = tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        body = _post(
            server,
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt},
        ).json()
        assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_continue_final_message_and_add_generation_prompt(server, client, tokenizer):
    started = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
    text = tokenizer.apply_chat_template(started, tokenize=False, continue_final_message=True)
    assert text.endswith("Well, the")
    expected = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": started, "continue_final_message": True}
    assert _post(server, "/tokenize", body).json()["tokens"] == expected
    reply = _chat(client, messages=started, extra_body={"continue_final_message": True})
    assert reply.usage.prompt_tokens == len(expected)
    closed = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    reply = _chat(client, extra_body={"add_generation_prompt": False})
    assert reply.usage.prompt_tokens == len(tokenizer.encode(closed, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body={"continue_final_message": True})  # last message is the user's
    assert info.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
        ("/tokenize", {"prompt": "a", "add_special_token": True}, "add_special_token"),
        ("/detokenize", {"tokens": [99999]}, "tokens"),
    ],
)
def test_tokenize_bad_input(server, path, body, param):
    response = _post(server, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_needs_the_api_key(server):
    response = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "a"})
    assert response.status_code == 401


# ----------------------------------------------------------------------------- chat logprobs


def _eos_id(server) -> int:
    (eos,) = server.engine.eos_token_ids
    return eos


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ending", ["eos", "stop_token_ids"])
def test_chat_logprobs_cover_exactly_the_message_tokens(client, server, tokenizer, stream, ending):
    letters = {str(i): 30 for i in range(ord("a"), ord("z") + 1)}  # a valid UTF-8 message
    if ending == "eos":  # EOS forced as soon as min_tokens allows it
        extra, bias = {"min_tokens": 3}, {**letters, str(_eos_id(server)): 100}
    else:  # three letters, then "0", a stop token
        extra, bias = {"guided_regex": "[a-z]{3}0", "stop_token_ids": [ord("0")]}, {}
    fields = dict(temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=2, logit_bias=bias)
    if stream:
        chunks = list(_chat(client, stream=True, extra_body=extra, **fields))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = _chat(client, extra_body=extra, **fields).choices[0]
        content, entries, finish = (
            choice.message.content,
            choice.logprobs.content,
            choice.finish_reason,
        )
    assert finish == "stop"
    assert content  # something before the end-of-turn token
    # the oracle: the message text, tokenized by the model's tokenizer
    expected = tokenizer.encode(content, add_special_tokens=False)
    assert [e.bytes[0] for e in entries] == expected  # byte tokenizer: id == byte value
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
