"""POST /tokenize and POST /detokenize, as vLLM serves them.

/tokenize takes a `prompt` (special tokens added by default, as /v1/completions does) or chat
`messages` (rendered by the chat template, which writes its own special tokens, so none are
added by default) and answers `tokens`, `count`, `max_model_len` (and `token_strs` when
`return_token_strs`). /detokenize takes `tokens` and answers `prompt`, the decoded text with
special tokens kept. Both go through the same tokenizer and chat template (with
`chat_template_kwargs`; openai-harmony for gpt-oss) as generation, so a count here is the count
a request will be charged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from torch_runner.serve.chat_format import (
    check_template_kwargs,
    continuation_field,
    harmony_effort,
)
from torch_runner.serve.errors import InvalidRequestError, param_error
from torch_runner.serve.history import message_dicts
from torch_runner.serve.params import check_continuation, check_message_fields
from torch_runner.serve.prompts import chat_prompt
from torch_runner.serve.protocol import ChatMessage
from torch_runner.serve.reasoning.harmony_prompt import HarmonyPromptError, render_harmony_prompt


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize (or send messages).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="Chat messages, rendered by the chat template."
    )
    add_special_tokens: bool | None = Field(
        None, description="Default: true for a prompt, false for messages (the template adds them)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="messages only: extra chat template variables, as in chat requests."
    )
    add_generation_prompt: bool = Field(True, description="messages only.")
    continue_final_message: bool = Field(False, description="messages only.")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(state: Any, body: TokenizeRequest) -> TokenizeResponse:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        for i, message in enumerate(body.messages):
            check_message_fields(i, message)
        check_continuation(body)
        tokens = _chat_tokens(state, body)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = list(state.tokenizer.encode(body.prompt, add_special_tokens=add_special))
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=strs
    )


def _chat_tokens(state: Any, body: TokenizeRequest) -> list[int]:
    """The prompt a chat request with these messages gets: harmony for gpt-oss, else the chat
    template (--chat-template's when given) with chat_template_kwargs."""
    template_kwargs = check_template_kwargs(body.chat_template_kwargs)
    if state.chat_format.is_harmony:
        continuation = continuation_field(body.add_generation_prompt, body.continue_final_message)
        effort = harmony_effort(template_kwargs, None, continuation)
        try:
            return render_harmony_prompt(
                state.chat_format.harmony_encoding, message_dicts(body.messages), None, effort
            )
        except HarmonyPromptError as exc:
            raise param_error(exc) from None
    return chat_prompt(
        state.tokenizer,
        body.messages,
        chat_template=state.chat_template,
        template_kwargs=template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=bool(body.add_special_tokens),
    )


def detokenize(state: Any, body: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is out of range [0, {state.vocab_size})", param="tokens"
        )
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, skip_special_tokens=False))
