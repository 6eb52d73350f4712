"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request -> a `ToolPlan`.

The plan says which functions the prompt offers, and how the output is read:
  none      no tools offered (the history may still hold earlier calls); output is content
  auto      tools offered; the model writes text or calls in its own format (a tool parser)
  required  tools offered; xgrammar forces a JSON list of one or more calls
  named     tools offered; xgrammar forces the named function's arguments object
Forcing uses JSON whatever the family (as vLLM does), so it works for every model, including
one whose template knows no tools. Every check here is a 400 naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.protocol import ChatCompletionRequest, ToolDefinition
from torch_runner.serve.tool_parsers.forced import parameters_schema, required_calls_schema

TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ToolPlan:
    functions: list[dict[str, Any]]  # {"name", "description"?, "parameters"?}, in request order
    choice: str  # none | auto | required | named
    named: str | None = None
    is_parallel: bool = True

    @property
    def offered(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape); None offers none."""
        if self.choice == "none" or not self.functions:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "named")

    def bounds_repeats(self, is_harmony: bool) -> bool:
        """`required` with parallel calls: a call repeating an earlier one ends the JSON list
        (serve/call_repeats.py). gpt-oss writes one harmony call per turn (`<|call|>` ends it)."""
        return self.choice == "required" and self.is_parallel and not is_harmony

    def structured_spec(self) -> Any:
        """The grammar forcing `required` / named output (None when the model chooses)."""
        from ops.sampling.params import StructuredOutputSpec
        from torch_runner.grammar.compiler import validate_grammar

        if self.choice == "named":
            function = next(f for f in self.functions if f["name"] == self.named)
            schema = parameters_schema(function)
        elif self.choice == "required":
            schema = required_calls_schema(self.functions, self.is_parallel)
        else:
            return None
        return StructuredOutputSpec("json_schema", validate_grammar("json_schema", schema))


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """Validate the tool fields (every error names its field) and decide how output is read."""
    _take_legacy_functions(body)
    functions = _functions(body)
    choice, named = _tool_choice(body.tool_choice, functions)
    plan = ToolPlan(functions, choice, named, body.parallel_tool_calls is not False)
    if plan.is_forced:
        check_schemas(plan)
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise InvalidRequestError(
                "response_format cannot be combined with tool_choice 'required' or a named "
                "function (both constrain the output)",
                param="response_format",
            )
    return plan


def _take_legacy_functions(body: ChatCompletionRequest) -> None:
    """OpenAI's deprecated `functions` / `function_call` are the tools API's ancestors: taken as
    `tools` / `tool_choice` (answers carry `tool_calls`, as OpenAI's own models now answer)."""
    from pydantic import ValidationError

    if body.functions is None and body.function_call is None:
        return
    if body.tools is not None or body.tool_choice is not None:
        name = "functions" if body.functions is not None else "function_call"
        raise InvalidRequestError(
            f"{name} is the deprecated form of tools/tool_choice; send one form, not both",
            param=name,
        )
    try:
        body.tools = [
            ToolDefinition(type="function", function=function) for function in body.functions or []
        ]
    except ValidationError as exc:
        raise InvalidRequestError(
            f"functions: {exc.errors()[0]['msg']}", param="functions"
        ) from None
    call = body.function_call
    if isinstance(call, dict):
        if set(call) != {"name"} or not isinstance(call["name"], str):
            raise InvalidRequestError(
                'function_call must be "none", "auto" or {"name": ...}', param="function_call"
            )
        call = {"type": "function", "function": {"name": call["name"]}}
    body.tool_choice = call


def _functions(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    functions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, tool in enumerate(body.tools or []):
        function = tool.function
        if not _NAME.match(function.name):
            raise InvalidRequestError(
                f"tools.{index}.function.name {function.name!r} is invalid: 1 to 64 of a-z, "
                "A-Z, 0-9, underscores and dashes",
                param=f"tools.{index}.function.name",
            )
        if function.name in seen:
            raise InvalidRequestError(
                f"tools.{index}.function.name {function.name!r} is defined twice",
                param=f"tools.{index}.function.name",
            )
        seen.add(function.name)
        entry = function.model_dump(exclude_none=True)
        entry.pop("strict", None)
        functions.append(entry)
    return functions


def _tool_choice(raw: Any, functions: list[dict[str, Any]]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if functions else "none"), None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise InvalidRequestError(
                f"tool_choice {raw!r} is invalid; allowed values: 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if raw != "none" and not functions:
            raise InvalidRequestError(
                f"tool_choice {raw!r} needs tools; none were given", param="tool_choice"
            )
        return raw, None
    function = raw.get("function") if raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or set(raw) != {"type", "function"}:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    names = [f["name"] for f in functions]
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not in tools; allowed values: "
            + (", ".join(repr(n) for n in names) or "(no tools given)"),
            param="tool_choice.function.name",
        )
    return "named", name


def check_schemas(plan: ToolPlan) -> None:
    """Each function the grammar may force must compile, or the 400 names that tool."""
    from torch_runner.grammar.compiler import GrammarError, validate_grammar

    for index, function in enumerate(plan.functions):
        if plan.choice == "named" and function["name"] != plan.named:
            continue
        try:
            validate_grammar("json_schema", parameters_schema(function))
        except GrammarError as exc:
            raise InvalidRequestError(
                f"tool {function['name']!r}: its parameters schema cannot be enforced: "
                f"{exc.message}",
                param=f"tools.{index}.function.parameters",
            ) from None
