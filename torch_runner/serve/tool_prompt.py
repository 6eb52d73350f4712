"""Tool history for the chat template, and the default tool prompt for templates without tools.

A template that mentions `tools` (Qwen2/3, Llama 3.x, Mistral, Hermes, ...) gets the tools and
the history as transformers passes them (`apply_chat_template(..., tools=...)`; call arguments
as objects, which is what those templates `tojson`). A template that does not (the embedded
SmolLM2-135M-Instruct) gets DEFAULT_TOOL_PROMPT appended to the system message, earlier calls
written back as `<tool_call>` blocks and tool results as `<tool_response>` user turns: the
Hermes/Qwen2.5 convention, read back by the `hermes` parser.
"""

from __future__ import annotations

import json
from typing import Any

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.protocol import ChatMessage

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _content(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    return content or ""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as templates take them; checks tool calls and the ids tool results answer."""
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
            call_ids.update(call.id for call in message.tool_calls)
        if message.role == "tool":
            if not message.tool_call_id:
                raise InvalidRequestError(
                    f"messages.{i} has role 'tool' but no tool_call_id",
                    param=f"messages.{i}.tool_call_id",
                )
            if message.tool_call_id not in call_ids:
                raise InvalidRequestError(
                    f"messages.{i}.tool_call_id {message.tool_call_id!r} answers no tool call "
                    "of an earlier assistant message",
                    param=f"messages.{i}.tool_call_id",
                )
            entry["tool_call_id"] = message.tool_call_id
        elif message.tool_call_id is not None:
            raise InvalidRequestError(
                f"messages.{i}.tool_call_id is only allowed on tool messages",
                param=f"messages.{i}.tool_call_id",
            )
        entries.append(entry)
    return entries


def _call_dict(i: int, j: int, call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"messages.{i}.tool_calls.{j}.function.arguments is not valid JSON: {exc}",
            param=f"messages.{i}.tool_calls.{j}.function.arguments",
        ) from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def with_default_tool_prompt(
    entries: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Rewrite tool turns as plain messages a tool-less template renders (see module docstring)."""
    result: list[dict[str, Any]] = []
    for entry in entries:
        if entry["role"] == "tool":
            block = f"<tool_response>\n{entry['content']}\n</tool_response>"
            if result and result[-1].get("is_tool_results"):
                result[-1]["content"] += "\n" + block
            else:
                result.append({"role": "user", "content": block, "is_tool_results": True})
            continue
        calls = [
            "<tool_call>\n"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "\n</tool_call>"
            for c in entry.get("tool_calls", [])
        ]
        entry = {k: v for k, v in entry.items() if k != "tool_calls"}
        if calls:
            entry["content"] = "\n".join(([entry["content"]] if entry["content"] else []) + calls)
        result.append(entry)
    for entry in result:
        entry.pop("is_tool_results", None)
    if tools:
        block = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if result and result[0]["role"] in ("system", "developer"):
            head = result[0]
            result[0] = {
                **head,
                "content": f"{head['content']}\n\n{block}" if head["content"] else block,
            }
        else:
            result.insert(0, {"role": "system", "content": block})
    return result
