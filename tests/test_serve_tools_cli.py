"""The tool flags of `python -m torch_runner.serve`: --help lists them, bad values exit 2 naming
the flag, and a real server process picks up --chat-template and the parser it implies."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_fixtures import API_KEY, MODEL_NAME, ServerProcess, save_serve_checkpoint
from tool_templates import LLAMA3_1

from torch_runner.serve.cli import build_parser, main

TOOL_FLAGS = ("--chat-template", "--tool-call-parser", "--enable-auto-tool-choice")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def test_help_lists_the_tool_flags_and_parser_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in (*TOOL_FLAGS, "hermes", "llama3_json", "mistral"):
        assert needle in text, needle


def test_tool_flag_defaults():
    args = build_parser().parse_args([])
    assert args.chat_template is None and args.tool_call_parser is None
    assert build_parser().parse_args(["--enable-auto-tool-choice"]).enable_auto_tool_choice


def test_unknown_tool_call_parser_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tool-call-parser", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "hermes" in err


def test_unreadable_chat_template_exits_2_naming_the_flag(capsys, tmp_path):
    missing = tmp_path / "missing.jinja"
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--chat-template", str(missing)])
    assert exit_info.value.code == 2
    assert "--chat-template" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_template_file_sets_the_format_and_the_parser(tmp_path):
    path, _ = save_serve_checkpoint(tmp_path / "tiny")
    template = tmp_path / "llama31.jinja"
    template.write_text(LLAMA3_1)
    server = ServerProcess(path, "--api-key", API_KEY, "--chat-template", str(template))
    try:
        client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        llama_call = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)"\}\}'
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
            max_tokens=80,
            temperature=0,
            response_format={"type": "regex", "regex": llama_call},
        )
        assert "tool-call parser: llama3_json   chat template: --chat-template" in server.output()
        [call] = reply.choices[0].message.tool_calls  # read by llama3_json, picked from the file
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        assert reply.choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()
