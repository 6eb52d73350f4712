"""torch_runner: the engine (scheduler, KV caches, model runner), the offline API and the server.

    from torch_runner import Engine, SamplingParams
    engine = Engine()                      # the embedded SmolLM2-135M-Instruct
    engine.generate(["Hello"], SamplingParams(max_tokens=16))

Heavy modules load on first attribute access, so `import torch_runner` stays cheap and never
imports mlx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ops.sampling.params import SamplingParams
from torch_runner.config import EngineConfig
from torch_runner.outputs import Logprob, RequestOutput

if TYPE_CHECKING:
    from torch_runner.async_engine import AsyncEngine, EngineOverCapacityError
    from torch_runner.engine import Engine

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineOverCapacityError",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "Engine":
        from torch_runner.engine import Engine

        return Engine
    if name in ("AsyncEngine", "EngineOverCapacityError"):
        from torch_runner import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module 'torch_runner' has no attribute {name!r}")
