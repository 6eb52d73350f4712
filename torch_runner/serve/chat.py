"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs, streaming.

Each choice's output goes through one `OutputParser` (serve/output_parsers.py) into content,
reasoning_content and tool_calls: `parse` for the JSON answer, `feed`/`finish` for the stream, so
the two agree. A message with calls that ended naturally has finish_reason "tool_calls".
`required` with parallel calls ends at a call repeating an earlier one (serve/call_repeats.py):
the choice's text stops before it, for the stream and the JSON answer alike.
gpt-oss (`state.chat_format.is_harmony`) is rendered by openai-harmony instead of a template,
stops at <|return|> / <|call|>, and its forced calls are harmony messages (serve/chat_format.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from torch_runner.serve.call_repeats import RepeatGuard
from torch_runner.serve.chat_plan import apply_tool_plan, render_prompt
from torch_runner.serve.chat_stream import ChoiceRenderer
from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.generation import (
    Choice,
    Increment,
    run_choices,
    usage_of,
)
from torch_runner.serve.logprob_fields import CONTENT, TokenLabeler
from torch_runner.serve.logprobs import chat_logprobs, message_token_count
from torch_runner.serve.offload import json_response
from torch_runner.serve.output_parsers import make_output_parser
from torch_runner.serve.params import chat_fields
from torch_runner.serve.parsing import DeltaMessage, OutputParser
from torch_runner.serve.prompts import check_context
from torch_runner.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChoiceLogprobs,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDeltaOut,
    ToolCallOut,
)
from torch_runner.serve.sse import stream_choices
from torch_runner.serve.state import ServingState
from torch_runner.serve.tools import ToolPlan, plan_tools


def _param_names(body: ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams field -> the parameter this request actually used."""
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {"max_tokens": max_name, "structured": "response_format"}


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, http: Request
) -> Response:
    """Render messages with the chat template, fan out n choices; answer as JSON or SSE."""
    arrived_at = time.perf_counter()
    state.check_model(body.model)
    fields = await state.offload(chat_fields, body, state.vocab_size)
    plan = plan_tools(body)
    apply_tool_plan(state, plan, fields)
    prompt_ids, prompt_tail = await state.offload(render_prompt, state, body, plan)
    max_name = _param_names(body)["max_tokens"]
    check_context(len(prompt_ids), fields["max_tokens"], state.max_model_len, "messages", max_name)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = await state.offload(
        state.build_choices,
        request_id,
        [prompt_ids],
        fields,
        body.n,
        body.seed,
        _param_names(body),
        arrived_at,
    )
    if plan.bounds_repeats(state.chat_format.is_harmony):
        for choice in choices:
            choice.guard = RepeatGuard()
    model = body.model or state.model_name

    if body.stream:
        return await _stream(state, body, http, choices, request_id, model, plan, prompt_tail)
    if not await run_choices(http, state.engine, choices, on_close=lambda: state.record(choices)):
        return Response(status_code=499)
    response = await state.offload(
        lambda: ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=[_final_choice(state, body, choice, plan, prompt_tail) for choice in choices],
            usage=usage_of(choices),
        )
    )
    return await state.offload(json_response, response)


def _parser(
    state: ServingState, body: ChatCompletionRequest, plan: ToolPlan, prompt_tail: str
) -> OutputParser:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return make_output_parser(
            state, plan, prompt_tail, stop, bool(body.include_stop_str_in_output)
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="tools") from None


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _logprobs(
    state: ServingState, body: ChatCompletionRequest, picks: list[tuple[int, Any]]
) -> ChoiceLogprobs | None:
    """`picks`: the content tokens' (id, logprob entry)."""
    if not body.logprobs:
        return None
    ids = [token_id for token_id, _ in picks]
    return ChoiceLogprobs(content=chat_logprobs(state.token_table, ids, [e for _, e in picks]))


def _labeler(
    state: ServingState, body: ChatCompletionRequest, parser: OutputParser, choice: Choice
) -> TokenLabeler | None:
    if not body.logprobs:
        return None
    skipped = getattr(choice.params, "skip_special_tokens", True)
    hidden = frozenset(state.tokenizer.all_special_ids) if skipped else frozenset()
    return TokenLabeler(parser, state.token_table, hidden)


def _content_picks(
    state: ServingState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    prompt_tail: str,
    choice: Choice,
    num_tokens: int,
) -> list[tuple[int, Any]]:
    """The message's content tokens with their logprob entries (a fresh parser labels them)."""
    parser = _parser(state, body, plan, prompt_tail)
    labeler = _labeler(state, body, parser, choice)
    if labeler is None:
        return []
    parser.feed(choice.text, choice.token_ids)
    labeler.feed(choice.text, choice.token_ids)
    parser.finish()
    labeler.finish()
    labels = labeler.labels
    return [
        (choice.token_ids[i], choice.logprobs[i])
        for i in range(min(num_tokens, len(choice.logprobs)))
        if labels[i] == CONTENT
    ]


def _message_tokens(state: ServingState, choice: Choice) -> int:
    return message_token_count(
        choice.token_ids, choice.finish_reason, choice.params, state.eos_token_ids
    )


def _final_choice(
    state: ServingState,
    body: ChatCompletionRequest,
    choice: Choice,
    plan: ToolPlan,
    prompt_tail: str,
) -> ChatChoice:
    parsed = _parser(state, body, plan, prompt_tail).parse(choice.text, choice.token_ids)
    num_tokens = _message_tokens(state, choice)
    calls = [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in parsed.tool_calls
    ]
    message = ChatResponseMessage(
        content=parsed.content,
        reasoning_content=parsed.reasoning_content,
        tool_calls=calls or None,
    )
    return ChatChoice(
        index=choice.index,
        message=message,
        logprobs=_logprobs(
            state, body, _content_picks(state, body, plan, prompt_tail, choice, num_tokens)
        ),
        finish_reason=_finish_reason(choice.finish_reason, bool(calls)),
    )


def _delta(message: DeltaMessage) -> ChatDelta:
    calls = [
        ToolCallDeltaOut(
            index=piece.index,
            id=piece.id,
            type="function" if piece.id else None,
            function=FunctionCallDelta(name=piece.name, arguments=piece.arguments),
        )
        for piece in message.tool_calls
    ]
    return ChatDelta(
        content=message.content,
        reasoning_content=message.reasoning_content,
        tool_calls=calls or None,
    )


async def _stream(
    state: ServingState,
    body: ChatCompletionRequest,
    http: Request,
    choices: list[Choice],
    request_id: str,
    model: str,
    plan: ToolPlan,
    prompt_tail: str,
) -> Response:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    renderers = {}
    for choice in choices:
        parser = _parser(state, body, plan, prompt_tail)
        renderers[choice.index] = ChoiceRenderer(
            parser, _labeler(state, body, parser, choice), lambda c: _message_tokens(state, c)
        )

    def chunk(choice_list: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=model, choices=choice_list, usage=usage)

    # OpenAI opens a text answer with content "" and one that may hold calls with content null
    opening_content = "" if plan.choice == "none" else None

    def opening():
        for choice in choices:
            delta = ChatDelta(role="assistant", content=opening_content)
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta)])

    def render(increment: Increment):
        if increment.is_empty:
            return
        renderer = renderers[increment.choice.index]
        rendered = renderer.render(increment)
        if rendered is None:
            return  # held back by the parser (a partial tag); nothing to send yet
        message, picks = rendered
        yield chunk(
            [
                ChatChunkChoice(
                    index=increment.choice.index,
                    delta=_delta(message),
                    logprobs=_logprobs(state, body, picks),
                    finish_reason=_finish_reason(increment.finish_reason, renderer.has_calls),
                )
            ]
        )

    return await stream_choices(
        http,
        state.engine,
        choices,
        opening=opening,
        render=render,
        usage_chunk=(lambda usage: chunk([], usage)) if include_usage else None,
        on_close=lambda: state.record(choices),
    )
