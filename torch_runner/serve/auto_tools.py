"""`tool_choice: "auto"`: text stays free, but a call the model starts is a well-formed call.

An xgrammar structural tag (`TriggeredTagsFormat`, as SGLang's parsers build for tools): outside
a call the output is any text; once it writes the family's start marker (the trigger, hermes'
`<tool_call>`), the rest must be `{"name": "<one of the offered functions>", "arguments": <JSON
valid against that function's schema>}` and the end marker, after which text is free again (or,
with `parallel_tool_calls: false`, generation may only end). Families whose start marker is a
special token the free text cannot spell (gpt-oss harmony, Mistral's `[TOOL_CALLS]`) or is plain
JSON (Llama-3) are parsed but not constrained: `auto_tool_grammar` returns None for them.
"""

from __future__ import annotations

import json
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _hermes_tags(functions: list[dict[str, Any]]) -> tuple[list[str], list[Any]]:
    """The Qwen/Hermes template's own layout: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`."""
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

    tags = [
        TagFormat(
            begin=f'{HERMES_START}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
            content=JSONSchemaFormat(
                json_schema=f.get("parameters") or {"type": "object"}, max_whitespace_cnt=1
            ),
            end=f"}}\n{HERMES_END}",
        )
        for f in functions
    ]
    return [HERMES_START], tags


AUTO_TAGS = {"hermes": _hermes_tags}  # tool-call parser name -> its structural tags


def auto_tool_grammar(
    parser_name: str, functions: list[dict[str, Any]], is_parallel: bool
) -> str | None:
    """xgrammar EBNF (rule `root`) for an auto answer in `parser_name`'s format; None when that
    family is not constrained (see the module docstring)."""
    build = AUTO_TAGS.get(parser_name)
    if build is None or not functions:
        return None
    import xgrammar as xgr
    from xgrammar.structural_tag import StructuralTag, TriggeredTagsFormat

    triggers, tags = build(functions)
    tag = TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=not is_parallel)
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=tag)))
