"""The default tool prompt for templates without tools (the history itself: serve/history.py).

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
