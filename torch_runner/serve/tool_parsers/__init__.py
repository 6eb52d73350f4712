"""serve.tool_parsers: one file per tool-call format (hermes, llama3_json, mistral, harmony), a registry by
vLLM's parser names. Pure text/token parsing over serve.parsing: imports no engine, runner or torch."""
