"""Qwen2: Llama with q/k/v biases (o_proj has none) and optional sliding-window layers.

Windows apply only when `use_sliding_window` is true, to the layers from `max_window_layers`
on; transformers derives that into `layer_types`, which `ModelArgs` takes as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.args import ModelArgs as BaseArgs
from models.layers import Attention, CausalLM, DecoderLayer, GatedMLP


@dataclass
class ModelArgs(BaseArgs):
    use_sliding_window: bool = False
    max_window_layers: int = 28


def make_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    attn = Attention(args, layer_idx, qkv_bias=True, o_bias=False)
    mlp = GatedMLP(args.hidden_size, args.intermediate_size, act=args.hidden_act)
    return DecoderLayer(args, attn, mlp)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return weights
