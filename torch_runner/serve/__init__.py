"""OpenAI-compatible HTTP server over torch_runner's engine (`python -m torch_runner.serve`).
Owns HTTP, protocol, chat templating and output parsers; nothing in the engine imports it.

`create_app(ServingState(...))` builds the FastAPI app around a started `AsyncEngine`;
`torch_runner.serve.cli.main` is the command line. Importing this package loads neither the
engine nor a model: the CLI builds those only after the MLX gate has run.
"""

from torch_runner.serve.app import create_app
from torch_runner.serve.state import ServingState

__all__ = ["ServingState", "create_app"]
