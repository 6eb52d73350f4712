"""How this model's chat turns are written and read back: gpt-oss harmony, or the chat template.

Chosen once at start-up from `--reasoning-parser` (vLLM's names) or, by default, from the model:
gpt-oss (`model_type` gpt_oss) speaks harmony, so its prompts are rendered by openai-harmony
(reasoning effort, developer instructions, tool namespace) and its output split by channel,
with `<|return|>` / `<|call|>` as stop tokens; a chat template that writes `</think>` gets the
qwen3 `<think>` parser; anything else is plain content. `none` turns reasoning parsing off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.parsing import OutputParser, PlainParser
from torch_runner.serve.reasoning import HARMONY_PARSER, REASONING_PARSERS, new_reasoning_parser

logger = logging.getLogger(__name__)

AUTO, NONE = "auto", "none"
REASONING_PARSER_CHOICES = (AUTO, NONE, *REASONING_PARSERS)
# Keyword arguments the server passes to apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "chat_template", "tokenizer"}
)  # fmt: skip


@dataclass
class ChatFormat:
    """The chosen format; `reasoning_parser` None means no reasoning parsing."""

    reasoning_parser: str | None = None
    harmony_encoding: Any = None
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def is_harmony(self) -> bool:
        return self.reasoning_parser == HARMONY_PARSER

    def output_parser(
        self, prompt_text: str, stop: list[str] | None = None, include_stop_str: bool = False
    ) -> OutputParser:
        """A fresh parser for one choice (think parsers look at how the prompt ended)."""
        if self.reasoning_parser is None:
            return PlainParser()
        return new_reasoning_parser(
            self.reasoning_parser,
            prompt_text=prompt_text,
            harmony_encoding=self.harmony_encoding,
            stop=stop,
            include_stop_str=include_stop_str,
        )


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` reach the template, except the arguments the server sets itself."""
    kwargs = dict(kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(clash)} (the server sets them)",
            param="chat_template_kwargs",
        )
    return kwargs


def select_chat_format(
    tokenizer: Any, model_type: str | None, choice: str = AUTO, template: str | None = None
) -> ChatFormat:
    """The format for `--reasoning-parser choice` (`template`: --chat-template's, else the
    tokenizer's); raises ValueError naming the flag's problem."""
    if choice not in REASONING_PARSER_CHOICES:
        raise ValueError(
            f"--reasoning-parser {choice!r} is unknown; allowed: {', '.join(REASONING_PARSER_CHOICES)}"
        )
    if choice == AUTO:
        if model_type == "gpt_oss":
            choice = HARMONY_PARSER
        elif "</think>" in (template or getattr(tokenizer, "chat_template", None) or ""):
            choice = "qwen3"
        else:
            choice = NONE
    if choice == NONE:
        return ChatFormat()
    if choice != HARMONY_PARSER:
        return ChatFormat(reasoning_parser=choice)
    from torch_runner.serve.reasoning.harmony_encoding import (
        HarmonyUnavailableError,
        load_harmony_encoding,
    )

    try:
        encoding = load_harmony_encoding(tokenizer)
    except HarmonyUnavailableError as exc:
        raise ValueError(
            f"--reasoning-parser openai_gptoss: {exc} (or pass --reasoning-parser none to serve "
            "the chat template's text as it is)"
        ) from None
    stops = sorted(encoding.stop_tokens_for_assistant_actions())  # <|return|>, <|call|>
    logger.info("gpt-oss harmony format: openai-harmony prompts, stop tokens %s", stops)
    return ChatFormat(
        reasoning_parser=HARMONY_PARSER, harmony_encoding=encoding, stop_token_ids=stops
    )


def continuation_field(add_generation_prompt: bool, continue_final_message: bool) -> str | None:
    """The field that asks not to open a new assistant turn, if any."""
    if continue_final_message:
        return "continue_final_message"
    return None if add_generation_prompt else "add_generation_prompt"


def harmony_effort(
    template_kwargs: dict[str, Any], reasoning_effort: str | None, continuation: str | None
) -> str | None:
    """gpt-oss has no chat template: of chat_template_kwargs only reasoning_effort applies (vLLM
    users pass it there too), and openai-harmony always opens a new assistant turn
    (`continuation`: the field that asked otherwise, see continuation_field)."""
    if continuation is not None:
        raise InvalidRequestError(
            f"{continuation} is not supported for gpt-oss: openai-harmony renders its prompt and "
            "always opens a new assistant turn",
            param=continuation,
        )
    effort = reasoning_effort or template_kwargs.pop("reasoning_effort", None)
    if template_kwargs:
        raise InvalidRequestError(
            f"chat_template_kwargs {', '.join(sorted(template_kwargs))} do not apply to gpt-oss: "
            "its prompt is rendered by openai-harmony, not a chat template (allowed: "
            "reasoning_effort)",
            param="chat_template_kwargs",
        )
    return effort
