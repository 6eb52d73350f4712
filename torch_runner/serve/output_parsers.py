"""One `OutputParser` per choice, from the server's parser names and the request's `ToolPlan`.

The reasoning parser (`state.reasoning_parser_name`, serve/reasoning/) runs first and hands its
content to the tool parser: `state.tool_parser_name` for `auto`, the forced-JSON parsers for
`required` and a named function. A family whose one parser does both (gpt-oss harmony: `openai`
for reasoning and tools) names it twice and gets a single instance.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import ChainedParser, FirstCallOnly, OutputParser, PlainParser
from torch_runner.serve.tool_parsers import get_tool_parser, select_tool_parser
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from torch_runner.serve.tool_parsers.json_calls import new_call_id
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


def _reasoning_parser(state: Any) -> OutputParser | None:
    name = state.reasoning_parser_name
    if name is None:
        return None
    from torch_runner.serve.reasoning import new_reasoning_parser  # the reasoning registry

    return new_reasoning_parser(name, state.tokenizer)


def make_output_parser(state: Any, plan: ToolPlan | None) -> OutputParser:
    tools = _tool_parser(state, plan)
    if tools is not None and state.reasoning_parser_name == state.tool_parser_name:
        return tools  # one parser for both (harmony)
    reasoning = _reasoning_parser(state)
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
