"""bridge: the Torch <-> MLX boundary. Imports only torch; mlx is imported lazily on first use."""

from bridge.device import resolve_device
from bridge.runtime import MlxRuntimeError, use_mlx, validate_device, validate_runtime

__all__ = ["MlxRuntimeError", "resolve_device", "use_mlx", "validate_device", "validate_runtime"]
