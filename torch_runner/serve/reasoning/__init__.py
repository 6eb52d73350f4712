"""serve.reasoning: reasoning parsers (`<think>` models, gpt-oss harmony channels), a registry by vLLM's
parser names. Pure text/token parsing over serve.parsing: imports no engine, runner or torch."""
