"""`<think>` reasoning models over real HTTP with the official openai client (tiny random Qwen3).

A regex grammar forces `<think>...</think>...` while the words stay the model's. The oracles: the
regex (the whole output fullmatches it), transformers' `apply_chat_template` for the prompts the
engine receives, and stream == non-stream for one seed.
"""

from __future__ import annotations

import re

import openai
import pytest
from reasoning_helpers import USER, WORDS_RE, start, stream_message, tokenize
from serve_fixtures import MODEL_NAME
from tiny_models import build_tiny_model

pytestmark = pytest.mark.slow  # real HTTP servers; CI still runs them

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)


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


def test_tokenize_applies_chat_template_kwargs(qwen3):
    client, spy, tokenizer = qwen3
    kwargs = {"enable_thinking": False}
    counted = tokenize(client, messages=USER, chat_template_kwargs=kwargs)["tokens"]
    client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
    )
    assert counted == spy.prompts[-1]
    oracle = tokenizer.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert tokenizer.decode(counted) == oracle


@pytest.mark.parametrize("open_think", [False, True])
def test_think_logprobs_cover_only_the_content(qwen3, open_think):
    """Byte tokenizer: one token per character, so the content's tokens are exactly its text; the
    reasoning, both tags and the end-of-turn token must be left out, streamed chunk by chunk too."""
    from reasoning_helpers import stream_content_logprobs

    client, _, _ = qwen3
    regex = r"[a-z][a-z ]{2,10}</think>[a-z][a-z ]{2,10}"
    request = dict(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=60,
        temperature=1.0,
        seed=11,
        extra_body={
            "response_format": {
                "type": "regex",
                "regex": regex if open_think else "<think>" + regex,
            },
            "chat_template_kwargs": {"open_think": open_think},
        },
    )
    reply = client.chat.completions.create(**request, logprobs=True)
    message, items = reply.choices[0].message, reply.choices[0].logprobs.content
    assert message.reasoning_content and message.content
    assert "".join(item.token for item in items) == message.content
    assert reply.usage.completion_tokens > len(items) + len("</think>")
    pairs = stream_content_logprobs(client, **request)
    assert all(delta == tokens for delta, tokens in pairs), pairs
    assert "".join(delta for delta, _ in pairs) == message.content
