"""OpenAI chat messages -> a gpt-oss harmony prompt (token ids), rendered by openai-harmony.

The layout is gpt-oss's own (its chat template and vLLM render the same): a system message
with the reasoning effort and today's date; one developer message holding the request's
system/developer texts as instructions and the `tools` as the `functions` namespace; then the
turns. Assistant history keeps its `reasoning_content` (analysis; openai-harmony drops it once a
later final answer exists, as the model was trained), its text (final, or a commentary preamble
before calls) and its `tool_calls` (commentary, `to=functions.NAME`, json); a `role: "tool"`
message is `functions.NAME to=assistant`, NAME found through its `tool_call_id`.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"


class HarmonyPromptError(ValueError):
    """A request the harmony renderer cannot express; `.param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)  # list of text parts


def _tool_descriptions(tools: list[dict[str, Any]]) -> list[Any]:
    import openai_harmony as harmony

    descriptions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HarmonyPromptError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param="tools",
            )
        descriptions.append(
            harmony.ToolDescription.new(
                function["name"], function.get("description") or "", function.get("parameters")
            )
        )
    return descriptions


def _assistant_messages(message: dict[str, Any], index: int, call_names: dict[str, str]) -> list:
    import openai_harmony as harmony

    role = harmony.Role.ASSISTANT
    result = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        result.append(
            harmony.Message.from_role_and_content(role, reasoning).with_channel("analysis")
        )
    calls = message.get("tool_calls") or []
    text = _text(message.get("content"))
    if text:
        channel = "commentary" if calls else "final"
        result.append(harmony.Message.from_role_and_content(role, text).with_channel(channel))
    for call in calls:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments", "")
        if not isinstance(name, str):
            raise HarmonyPromptError(
                f"messages[{index}].tool_calls needs function.name", param="messages"
            )
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        call_names[call.get("id") or ""] = name
        result.append(
            harmony.Message.from_role_and_content(role, arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{name}")
            .with_content_type("json")
        )
    return result


def _tool_result(message: dict[str, Any], index: int, call_names: dict[str, str]) -> Any:
    import openai_harmony as harmony

    call_id = message.get("tool_call_id")
    name = call_names.get(call_id or "") or message.get("name")
    if name is None:
        raise HarmonyPromptError(
            f"messages[{index}] (role tool) has tool_call_id {call_id!r}, which no earlier "
            "assistant tool_calls entry has",
            param="messages",
        )
    author = harmony.Author.new(harmony.Role.TOOL, f"functions.{name}")
    content = _text(message.get("content"))
    return (
        harmony.Message.from_author_and_content(author, content)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def harmony_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    reasoning_effort: str | None,
    today: datetime.date | None = None,
) -> list[Any]:
    """The harmony conversation for an OpenAI request (see the module docstring)."""
    import openai_harmony as harmony

    effort = reasoning_effort or DEFAULT_REASONING_EFFORT
    if effort not in REASONING_EFFORTS:
        raise HarmonyPromptError(
            f"reasoning_effort {effort!r} is not supported by gpt-oss; allowed values: "
            + ", ".join(REASONING_EFFORTS),
            param="reasoning_effort",
        )
    today = today or datetime.datetime.now(datetime.UTC).date()
    system = (
        harmony.SystemContent.new()
        .with_reasoning_effort(harmony.ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(today.isoformat())
    )
    result = [harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system)]
    instructions = [
        _text(m.get("content")) for m in messages if m["role"] in ("system", "developer")
    ]
    instructions = [text for text in instructions if text]
    if instructions or tools:
        developer = harmony.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools(_tool_descriptions(tools))
        result.append(harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "user":
            result.append(
                harmony.Message.from_role_and_content(
                    harmony.Role.USER, _text(message.get("content"))
                )
            )
        elif role == "assistant":
            result.extend(_assistant_messages(message, index, call_names))
        elif role == "tool":
            result.append(_tool_result(message, index, call_names))
    return result


def render_harmony_prompt(
    encoding: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    today: datetime.date | None = None,
) -> list[int]:
    """Token ids of the conversation, ending in `<|start|>assistant` for the model to continue."""
    import openai_harmony as harmony

    conversation = harmony.Conversation.from_messages(
        harmony_messages(messages, tools, reasoning_effort, today)
    )
    return list(encoding.render_conversation_for_completion(conversation, harmony.Role.ASSISTANT))
