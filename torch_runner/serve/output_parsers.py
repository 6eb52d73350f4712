"""One `OutputParser` per choice, from the server's parser names and the request's `ToolPlan`.

The reasoning parser (`state.chat_format`, serve/reasoning/) runs first and hands its content to
the tool parser: `state.tool_parser_name` for `auto`, the forced-JSON parsers for `required` and
a named function. gpt-oss harmony is one parser for reasoning, content and calls (its forced
calls are harmony too: serve/harmony_tools.py), whatever the tool choice.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import ChainedParser, FirstCallOnly, OutputParser, PlainParser
from torch_runner.serve.tool_parsers import get_tool_parser, select_tool_parser
from torch_runner.serve.tool_parsers.base import new_call_id
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from torch_runner.serve.tool_prompt import template_supports_tools
from torch_runner.serve.tools import ToolPlan


def default_tool_parser_name(model_type: str | None, template: str | None) -> str:
    """A template without tool support gets the default tool prompt, whose format is hermes."""
    if not template_supports_tools(template):
        return "hermes"
    return select_tool_parser(model_type, template)


def _tool_parser(state: Any, plan: ToolPlan | None) -> OutputParser | None:
    if plan is None or plan.choice == "none":
        return None
    if plan.choice == "auto":
        parser: OutputParser = get_tool_parser(state.tool_parser_name)(state.tokenizer)
    else:
        make_id = getattr(_family_parser(state), "make_id", new_call_id)
        if plan.choice == "named":
            return NamedCallParser(plan.named or "", make_id)
        parser = RequiredCallsParser(make_id)
    return parser if plan.is_parallel else FirstCallOnly(parser)


def _family_parser(state: Any) -> type | None:
    try:
        return get_tool_parser(state.tool_parser_name)
    except ValueError:  # not available in this build: forced calls need only an id shape
        return None


def make_output_parser(
    state: Any,
    plan: ToolPlan | None,
    prompt_text: str = "",
    stop: list[str] | None = None,
    include_stop_str: bool = False,
) -> OutputParser:
    """`prompt_text`: the end of the rendered prompt (a `<think>` the template left open);
    `stop`, `include_stop_str`: the request's stop strings (harmony applies them to the tokens
    it parses) and whether they stay in the text."""
    chat_format = state.chat_format
    if chat_format.is_harmony:
        harmony = chat_format.output_parser(prompt_text, stop, include_stop_str)
        return harmony if plan is None or plan.is_parallel else FirstCallOnly(harmony)
    tools = _tool_parser(state, plan)
    reasoning = chat_format.output_parser(prompt_text) if chat_format.reasoning_parser else None
    if reasoning is None:
        return tools or PlainParser()
    if tools is None:
        return reasoning
    return ChainedParser(reasoning, tools)


def keeps_special_tokens(state: Any, plan: ToolPlan | None) -> bool:
    """The auto parser reads special-token markers (Mistral's [TOOL_CALLS]) from the text."""
    if plan is None or plan.choice != "auto":
        return False
    return not getattr(get_tool_parser(state.tool_parser_name), "skip_special_tokens", True)
