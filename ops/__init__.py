"""ops: every swappable compute op, one signature each; torch is the reference and default.

Models call `ops.attention(...)`, `ops.rms_norm(...)`, ... ; each dispatches through the table in
ops/registry.py to the backend chosen once at start-up (`ops.configure()`, or the first call).
`ops.backends()` reports the choice. Importing this package never imports mlx.

Note: `ops.attention` is the dispatcher, which shadows the submodule of the same name; reach the
module itself with `from ops.attention import ...` or `importlib.import_module("ops.attention")`.
"""

from ops.attention import KeyLayout
from ops.linear import (
    can_pack,
    linear,
    linear_add,
    linear_rope_kv,
    linear_silu_mul,
    pack_weight,
)
from ops.registry import OPS, backends, configure, impl, make_dispatcher
from ops.rope import rope_cos_sin, rope_init

attention = make_dispatcher("attention")
rms_norm = make_dispatcher("rms_norm")
add_rms_norm = make_dispatcher("add_rms_norm")
layer_norm = make_dispatcher("layer_norm")
apply_rope = make_dispatcher("apply_rope")
moe_gpt_oss = make_dispatcher("moe_gpt_oss")
moe_qwen3 = make_dispatcher("moe_qwen3")
sample = make_dispatcher("sampler")
norm_infer = make_dispatcher("norm_infer")
modulate = make_dispatcher("modulate")
dit_rope = make_dispatcher("dit_rope")


__all__ = [
    "OPS",
    "KeyLayout",
    "add_rms_norm",
    "apply_rope",
    "attention",
    "backends",
    "can_pack",
    "configure",
    "dit_rope",
    "impl",
    "layer_norm",
    "linear",
    "linear_add",
    "linear_rope_kv",
    "linear_silu_mul",
    "moe_gpt_oss",
    "moe_qwen3",
    "modulate",
    "norm_infer",
    "pack_weight",
    "rms_norm",
    "rope_cos_sin",
    "rope_init",
    "sample",
]
