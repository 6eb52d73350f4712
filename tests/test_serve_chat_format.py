"""Which chat format a model gets (harmony, `<think>`, plain) and the chat_template_kwargs check."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from torch_runner.serve.chat_format import check_template_kwargs, select_chat_format
from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.parsing import PlainParser
from torch_runner.serve.reasoning.think import ThinkParser


class _Template:
    def __init__(self, chat_template):
        self.chat_template = chat_template


@pytest.mark.parametrize(
    ("template", "choice", "parser"),
    [
        ("{{ messages }}<think>{% if x %}</think>{% endif %}", "auto", "qwen3"),
        ("{{ messages }}", "auto", None),
        ("{{ messages }}<think></think>", "none", None),
        ("{{ messages }}", "deepseek_r1", "deepseek_r1"),
    ],
)
def test_think_formats_follow_the_template_or_the_flag(template, choice, parser):
    chat_format = select_chat_format(_Template(template), "qwen3", choice)
    assert chat_format.reasoning_parser == parser and chat_format.stop_token_ids == []
    made = chat_format.output_parser("<|im_start|>assistant\n<think>\n")
    assert isinstance(made, ThinkParser if parser else PlainParser)


def test_gpt_oss_speaks_harmony_with_its_stop_tokens(harmony_encoding, harmony_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    chat_format = select_chat_format(tokenizer, "gpt_oss")
    assert chat_format.is_harmony
    assert chat_format.stop_token_ids == sorted(
        tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    )


def test_harmony_that_cannot_load_names_the_flag(tmp_path, monkeypatch):
    from engine_helpers import byte_tokenizer

    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    with pytest.raises(
        ValueError, match="--reasoning-parser openai_gptoss: .*--reasoning-parser none"
    ):
        select_chat_format(byte_tokenizer(), "gpt_oss")
    with pytest.raises(ValueError, match="allowed: auto, none, qwen3, deepseek_r1, openai_gptoss"):
        select_chat_format(byte_tokenizer(), "llama", "think")


def test_template_kwargs_pass_through_except_the_servers_own():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert check_template_kwargs(None) == {}
    with pytest.raises(InvalidRequestError) as info:
        check_template_kwargs({"tokenize": True, "messages": [], "enable_thinking": True})
    assert info.value.param == "chat_template_kwargs"
    assert "messages, tokenize" in str(info.value)
