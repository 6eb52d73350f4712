"""torch_runner.grammar: structured output: xgrammar compilation and cache, response formats, masks.
Imports xgrammar, ops.sampling params and torch; never the engine, runner, kv or serve."""
