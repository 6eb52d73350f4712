"""bridge: the Torch <-> MLX boundary. Imports only torch; mlx is imported lazily on first use."""

from bridge.bridge_state import (
    BRIDGE_LOCK,
    BridgeStats,
    DeviceCapabilities,
    capabilities,
    reset_stats,
    stats,
)
from bridge.device import resolve_device
from bridge.runtime import MlxRuntimeError, use_mlx, validate_device, validate_runtime
from bridge.tensor_bridge import (
    MlxTensorView,
    borrow_torch_tensors,
    mlx_call,
    mlx_call_multi,
    mlx_to_torch,
    torch_to_mlx,
)

__all__ = [
    "BRIDGE_LOCK",
    "BridgeStats",
    "DeviceCapabilities",
    "MlxRuntimeError",
    "MlxTensorView",
    "borrow_torch_tensors",
    "capabilities",
    "mlx_call",
    "mlx_call_multi",
    "mlx_to_torch",
    "reset_stats",
    "resolve_device",
    "stats",
    "torch_to_mlx",
    "use_mlx",
    "validate_device",
    "validate_runtime",
]
