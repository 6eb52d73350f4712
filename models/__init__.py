"""models: one file per model family, pure compute over explicit inputs, and the HF-folder loader.

`load_model(path, device=..., dtype=..., load_format=...)` is the entry point; see
docs/architecture.md for the forward / compute_logits / cache protocol.
"""

from models.default_model import default_model_path
from models.errors import ModelLoadError
from models.loader import LoadedModel, load_model
from models.registry import supported_model_types

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "default_model_path",
    "load_model",
    "supported_model_types",
]
