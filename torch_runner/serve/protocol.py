"""Pydantic request/response models mirroring OpenAI's API, so `/openapi.json` is real.

Requests forbid unknown fields: a misspelt parameter is a 400 naming it, never silently ignored.
The extensions beyond OpenAI (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, and request_fields.py's guided_* / skip_special_tokens / ...) follow vLLM's names
so existing clients can pass them through `extra_body`; request_fields.py also holds OpenAI's
newer Chat fields that are accepted without steering sampling.
Ranges here are the documented ones; `SamplingParams` re-validates them (one source of truth for
the engine, this one for the schema).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from torch_runner.serve.encoding import check_encodable
from torch_runner.serve.request_fields import (
    MediaContentPart,
    MessageExtraFields,
    OpenAIChatFields,
    RefusalContentPart,
    VllmChatFields,
    VllmExtraFields,
)

MAX_TOP_LOGPROBS = 20
# "error": the model produced non-finite logits for that choice (an error event/JSON follows)
FinishReason = Literal["stop", "length", "abort", "error"]


class _Request(BaseModel):
    """Every request model: unknown fields are a 400, types are strict (`"stream": "yes"` and
    `[[false, true]]` as token ids are rejected, not coerced), and no string may hold a lone
    surrogate. Fields added by subclasses inherit all three."""

    model_config = ConfigDict(extra="forbid", strict=True)

    _encodable = field_validator("*")(check_encodable)


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(
        None, description="Ignored: chunks carry no obfuscation padding."
    )


class _SamplingFields(_Request):
    """Parameters shared by both endpoints."""

    model: str | None = Field(None, description="Served model name; omitted = the served model.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="< 1e-5 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(
        1, ge=1, le=16, description="Choices per prompt; with a seed, choice i uses seed + i."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    seed: int | None = Field(None, ge=0, lt=2**64)
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM-style extensions.
    top_k: int | None = Field(None, description="-1 = whole vocabulary.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(_SamplingFields, VllmExtraFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(16, ge=1, description="null = until the context ends.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str = Field(..., description="The call's arguments: a JSON object, as a string.")


class MessageToolCall(_Request):
    """A call in an assistant message of the history (what an earlier response returned)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request, MessageExtraFields):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextContentPart | RefusalContentPart | MediaContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(None, description="role tool: the id of the call answered.")
    tool_calls: list[MessageToolCall] | None = Field(None, description="role assistant only.")
    reasoning_content: str | None = Field(
        None, description="role assistant: the reasoning an earlier answer returned."
    )


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields, VllmExtraFields, VllmChatFields, OpenAIChatFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}; '
        'default "auto" with tools, "none" without.',
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None,
        description="gpt-oss: low, medium (default) or high, in its system message; other "
        "models: the chat template's `reasoning_effort` variable.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template (enable_thinking, ...)."
    )


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


ChatFinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _omit_none(self) -> dict[str, Any]:
        return {
            k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None
        }


class ToolCallDeltaOut(BaseModel):
    """OpenAI's shape: the first piece of call `index` has id, type and name; later ones only
    `function.arguments` fragments (absent keys are omitted, not null)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "torch_runner"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    sampling_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="generation_config.json values applied when a request leaves them unset.",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
