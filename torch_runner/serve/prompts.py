"""Prompts -> token ids, with the context-length check.

Completions take strings (tokenized with the tokenizer's special tokens, e.g. BOS) or token ids
(used as given, range-checked). Chat renders messages (and tools, tool calls and tool results)
through the chat template and tokenizes the result without adding special tokens again (the
template already has them).
A prompt that cannot fit is a 400 that states both numbers.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.history import message_dicts
from torch_runner.serve.protocol import ChatMessage
from torch_runner.serve.tool_prompt import template_supports_tools, with_default_tool_prompt


def completion_prompts(tokenizer: Any, prompt: Any, vocab_size: int) -> list[tuple[list[int], str]]:
    """Normalise the four accepted shapes to [(token ids, prompt text)]."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    result = []
    for item in items:
        if isinstance(item, str):
            ids = list(tokenizer.encode(item))
            text = item
        else:
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]} is out of range [0, {vocab_size})", param="prompt"
                )
            ids = list(item)
            text = tokenizer.decode(ids, skip_special_tokens=False)
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        result.append((ids, text))
    return result


def chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    *,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """Render `messages` (and `tools`) with the chat template and tokenize.

    `chat_template` (--chat-template) replaces the tokenizer's. A template without tool support
    gets the default tool prompt (serve/tool_prompt.py). The template already writes the special
    tokens, so none are added again by default (`add_special_tokens` is /tokenize's switch, as
    in vLLM). `continue_final_message` (vLLM's) leaves the last assistant message open so the
    model continues it, instead of starting a new turn. `template_kwargs` (the request's
    chat_template_kwargs, reasoning_effort) become template variables.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use /v1/completions", param="messages"
        )
    entries = message_dicts(messages)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if chat_template:
        kwargs["chat_template"] = chat_template
    if template_supports_tools(template):
        if tools:
            kwargs["tools"] = tools
    elif tools or any(e["role"] == "tool" or e.get("tool_calls") for e in entries):
        entries = with_default_tool_prompt(entries, tools)
    try:
        text = tokenizer.apply_chat_template(
            entries,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja raises its own errors for templates that reject a conversation
        raise InvalidRequestError(
            f"messages could not be rendered by the chat template: {exc}", param="messages"
        ) from None
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise InvalidRequestError("messages render to an empty prompt", param="messages")
    return ids


def check_context(
    num_prompt: int, max_tokens: int | None, max_model_len: int, prompt_param: str, max_param: str
) -> None:
    """The prompt must leave room for at least one token, and for max_tokens when given."""
    if num_prompt >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens (at least one must be left for the completion)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but {num_prompt + max_tokens} "
            f"were requested ({num_prompt} in the prompt, {max_tokens} in the completion); reduce "
            f"{max_param} or the prompt",
            param=max_param,
            code="context_length_exceeded",
        )
