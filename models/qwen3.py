"""Qwen3: Llama with RMSNorm on each query/key head (before rope) and optional windows.

`q_norm`/`k_norm` normalise over head_dim only; sliding layers follow `layer_types`
(transformers derives them from use_sliding_window / max_window_layers).
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
    bias = args.attention_bias
    attn = Attention(args, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=True)
    mlp = GatedMLP(args.hidden_size, args.intermediate_size, act=args.hidden_act)
    return DecoderLayer(args, attn, mlp)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return weights
