"""A chat request before generation: its prompt ids, and what its tool plan adds to sampling.

`render_prompt`: the chat template (or openai-harmony for gpt-oss) over the messages and the
offered tools. `apply_tool_plan`: forced tool choices and `auto` become xgrammar grammars in the
model's own call format (serve/auto_tools.py, serve/harmony_tools.py); parsers that read
special-token markers keep special tokens in the text.
"""

from __future__ import annotations

from torch_runner.serve.auto_tools import AUTO_TAGS, auto_tool_grammar
from torch_runner.serve.chat_format import (
    check_template_kwargs,
    continuation_field,
    harmony_effort,
)
from torch_runner.serve.errors import InvalidRequestError, param_error
from torch_runner.serve.harmony_tools import (
    WRAPPED_KINDS,
    harmony_auto_grammar,
    harmony_call_grammar,
    harmony_final_grammar,
)
from torch_runner.serve.history import message_dicts
from torch_runner.serve.output_parsers import keeps_special_tokens
from torch_runner.serve.params import structured_spec
from torch_runner.serve.prompts import chat_prompt
from torch_runner.serve.protocol import ChatCompletionRequest
from torch_runner.serve.reasoning.harmony_prompt import HarmonyPromptError, render_harmony_prompt
from torch_runner.serve.state import ServingState
from torch_runner.serve.tools import ToolPlan, check_schemas

PROMPT_TAIL_TOKENS = 16  # enough to see the `<think>` a template opens at the very end


def render_prompt(
    state: ServingState, body: ChatCompletionRequest, plan: ToolPlan
) -> tuple[list[int], str]:
    """Prompt ids, and the text of its last tokens (did the template leave `<think>` open?)."""
    chat_format = state.chat_format
    template_kwargs = check_template_kwargs(body.chat_template_kwargs)
    if chat_format.is_harmony:
        return _harmony_prompt(state, body, plan, template_kwargs), ""
    if body.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    ids = chat_prompt(
        state.tokenizer,
        body.messages,
        plan.offered,
        state.chat_template,
        template_kwargs=template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    if not chat_format.reasoning_parser:
        return ids, ""
    return ids, state.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])


def _harmony_prompt(
    state: ServingState, body: ChatCompletionRequest, plan: ToolPlan, template_kwargs: dict
) -> list[int]:
    """gpt-oss: openai-harmony renders the prompt (see harmony_effort for what it accepts)."""
    continuation = continuation_field(body.add_generation_prompt, body.continue_final_message)
    effort = harmony_effort(template_kwargs, body.reasoning_effort, continuation)
    try:
        return render_harmony_prompt(
            state.chat_format.harmony_encoding, message_dicts(body.messages), plan.offered, effort
        )
    except HarmonyPromptError as exc:
        raise param_error(exc) from None


def _auto_grammar(state: ServingState, plan: ToolPlan) -> str | None:
    """The `auto` grammar of the model's call format; None for a format that is only parsed."""
    chat_format = state.chat_format
    if chat_format.is_harmony:
        check_schemas(plan)
        return harmony_auto_grammar(chat_format.harmony_encoding, plan.functions)
    if state.tool_parser_name not in AUTO_TAGS:
        return None
    check_schemas(plan)  # a schema xgrammar cannot compile is a 400 naming the tool
    return auto_tool_grammar(
        state.tool_parser_name,
        plan.functions,
        plan.is_parallel,
        state.tokenizer.get_added_vocab(),
        has_reasoning=bool(chat_format.reasoning_parser),
    )


def apply_tool_plan(state: ServingState, plan: ToolPlan, fields: dict) -> None:
    """Forced tool choices and `auto` constrain the output; some auto parsers need special
    tokens kept. A request's own response_format under `auto` wins over the auto grammar.

    gpt-oss: forced calls are harmony call messages, `auto` is harmony with checked calls, a
    response_format is the body of a final message, and <|return|> / <|call|> end a turn."""
    chat_format = state.chat_format
    if chat_format.is_harmony:
        stops = set(fields.get("stop_token_ids") or []) | set(chat_format.stop_token_ids)
        fields["stop_token_ids"] = sorted(stops)
    if plan.is_forced and chat_format.is_harmony:
        names = [plan.named] if plan.choice == "named" else [f["name"] for f in plan.functions]
        grammar = harmony_call_grammar(chat_format.harmony_encoding, plan.offered or [], names)
        fields["structured"] = structured_spec({"type": "grammar", "grammar": grammar})
    elif plan.is_forced:
        fields["structured"] = plan.structured_spec()
    elif plan.choice == "auto" and fields.get("structured") is None and plan.functions:
        grammar = _auto_grammar(state, plan)
        if grammar is not None:  # a call the model starts is a valid call
            fields["structured"] = structured_spec({"type": "grammar", "grammar": grammar})
    elif chat_format.is_harmony and getattr(fields.get("structured"), "kind", "") in WRAPPED_KINDS:
        grammar = harmony_final_grammar(chat_format.harmony_encoding, fields["structured"])
        fields["structured"] = structured_spec({"type": "grammar", "grammar": grammar})
    try:
        if keeps_special_tokens(state, plan):
            fields["skip_special_tokens"] = False
    except ValueError as exc:  # a configured parser that is not available in this build
        raise InvalidRequestError(str(exc), param="tools") from None
