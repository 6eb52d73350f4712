"""ModelArgs: the few config values a model needs, named exactly as the HF `config.json` keys.

Fields are read from the transformers config object (so its defaults and normalisation, e.g.
`rope_parameters`, apply), while `REQUIRED_FIELDS` are checked against the raw `config.json`
first: a missing `hidden_size` must be an error naming it, not a silent 4096-wide default.
`layer_types` is derived for every family so the runner can build one cache kind per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def config_values(config: Any, names: set[str]) -> dict[str, Any]:
    """The config's values by HF key; attribute access resolves aliases (num_local_experts ->
    num_experts) and values transformers sets in __post_init__ (head_dim, layer_types)."""
    if isinstance(config, dict):
        return dict(config)
    values = config.to_dict()
    for name in names:
        if hasattr(config, name):
            values[name] = getattr(config, name)
    return values


@dataclass
class ModelArgs:
    """Shared decoder geometry; families subclass it to add their own HF keys."""

    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    )

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    # load option, not a config key: "packed" keeps quantized MoE experts as on disk (gpt-oss MXFP4)
    moe_weights: str = "packed"

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        """Build from a transformers config object (or its dict), deriving head_dim and layer_types."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = config_values(config, names)
        kwargs = {k: v for k, v in values.items() if k in names and v is not None}
        args = cls(**kwargs)
        if args.num_key_value_heads is None:
            args.num_key_value_heads = args.num_attention_heads
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        args.layer_types = args.derive_layer_types(values)
        if args.sliding_window is not None and SLIDING_ATTENTION not in args.layer_types:
            args.sliding_window = None
        args.validate()
        return args

    def derive_layer_types(self, values: dict[str, Any]) -> list[str]:
        """Default: the config's own `layer_types`, else all full attention; no window = all full."""
        if self.sliding_window is None:
            return [FULL_ATTENTION] * self.num_hidden_layers
        return list(values.get("layer_types") or [FULL_ATTENTION] * self.num_hidden_layers)

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries; num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(
                f"layer_types contains {bad}; allowed values: {', '.join(LAYER_TYPES)}"
            )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError(
                "layer_types has sliding_attention layers but sliding_window is not set"
            )

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer (None = full attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None
