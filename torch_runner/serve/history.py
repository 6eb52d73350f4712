"""Chat history -> the message dicts chat templates (and openai-harmony) take.

Tool calls are checked (arguments must be JSON; a `role: "tool"` message must answer the id of a
call an earlier assistant message made). OpenAI's deprecated functions API is taken as the tools
API it became, the way its own models read it: an assistant `function_call`
(`{"name", "arguments"}`) is a tool call with an id made here (`call00003`: nine alphanumerics,
the only id shape Mistral's templates accept), and a `role: "function"` message (`name`,
`content`) is the tool result answering the earliest unanswered call of that name, so every
template renders it as its own tool-result turn.
"""

from __future__ import annotations

import json
from typing import Any

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.protocol import ChatMessage


def _content(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    return content or ""


def _arguments(raw: str, param: str) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None


def _legacy_call(i: int, message: ChatMessage) -> dict[str, Any]:
    """An assistant's deprecated `function_call` as a tool call."""
    param = f"messages.{i}.function_call"
    call = message.function_call or {}
    if message.role != "assistant" or message.tool_calls:
        raise InvalidRequestError(
            f"{param} is only allowed on assistant messages without tool_calls", param=param
        )
    name, arguments = call.get("name"), call.get("arguments", "")
    if set(call) - {"name", "arguments"} or not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f'{param} must be {{"name": string, "arguments": string}}', param=param
        )
    if not isinstance(arguments, str):
        raise InvalidRequestError(
            f"{param}.arguments must be a string (JSON)", param=f"{param}.arguments"
        )
    return {
        "id": f"call{i:05d}",
        "type": "function",
        "function": {"name": name, "arguments": _arguments(arguments, f"{param}.arguments")},
    }


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as templates take them (see the module docstring for what is checked)."""
    open_calls: list[dict[str, Any]] = []  # calls of earlier assistant messages not yet answered
    call_ids: set[str] = set()
    entries: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": _content(message)}
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content is not None:  # Qwen3's template and harmony render it
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequestError(
                    f"messages.{i}.tool_calls is only allowed on assistant messages",
                    param=f"messages.{i}.tool_calls",
                )
            entry["tool_calls"] = [
                _call_dict(i, j, call) for j, call in enumerate(message.tool_calls)
            ]
        if message.function_call is not None:
            entry["tool_calls"] = [_legacy_call(i, message)]
        for call in entry.get("tool_calls", []):
            call_ids.add(call["id"])
            open_calls.append(call)
        if message.role == "function":
            entry = _function_result(i, message, entry, open_calls)
        elif message.role == "tool":
            _check_tool_result(i, message, call_ids)
            entry["tool_call_id"] = message.tool_call_id
            open_calls[:] = [c for c in open_calls if c["id"] != message.tool_call_id]
        elif message.tool_call_id is not None:
            raise InvalidRequestError(
                f"messages.{i}.tool_call_id is only allowed on tool messages",
                param=f"messages.{i}.tool_call_id",
            )
        entries.append(entry)
    return entries


def _check_tool_result(i: int, message: ChatMessage, call_ids: set[str]) -> None:
    if not message.tool_call_id:
        raise InvalidRequestError(
            f"messages.{i} has role 'tool' but no tool_call_id", param=f"messages.{i}.tool_call_id"
        )
    if message.tool_call_id not in call_ids:
        raise InvalidRequestError(
            f"messages.{i}.tool_call_id {message.tool_call_id!r} answers no tool call "
            "of an earlier assistant message",
            param=f"messages.{i}.tool_call_id",
        )


def _function_result(
    i: int, message: ChatMessage, entry: dict[str, Any], open_calls: list[dict[str, Any]]
) -> dict[str, Any]:
    """A deprecated `role: "function"` result as the tool result of the call it answers."""
    if message.tool_call_id is not None:
        raise InvalidRequestError(
            f"messages.{i}.tool_call_id is only allowed on tool messages (a function message "
            "answers the earlier call of its name)",
            param=f"messages.{i}.tool_call_id",
        )
    if not message.name:
        raise InvalidRequestError(
            f"messages.{i} has role 'function' but no name (the function it answers)",
            param=f"messages.{i}.name",
        )
    call = next((c for c in open_calls if c["function"]["name"] == message.name), None)
    if call is None:
        raise InvalidRequestError(
            f"messages.{i}.name {message.name!r} answers no unanswered call of that function "
            "in an earlier assistant message",
            param=f"messages.{i}.name",
        )
    open_calls.remove(call)
    return {**entry, "role": "tool", "tool_call_id": call["id"]}


def _call_dict(i: int, j: int, call: Any) -> dict[str, Any]:
    param = f"messages.{i}.tool_calls.{j}.function.arguments"
    return {
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.function.name,
            "arguments": _arguments(call.function.arguments, param),
        },
    }
