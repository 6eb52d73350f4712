"""Llama and Mistral: the plain pre-norm GQA decoder.

One file for both because Mistral is Llama with a sliding window on every layer (when
`sliding_window` is set) and no projection biases; Llama-3 rope scaling comes from
`rope_parameters` via `ops.rope_init`. No checkpoint quirks, so `sanitize` is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.args import FULL_ATTENTION, SLIDING_ATTENTION
from models.args import ModelArgs as BaseArgs
from models.layers import Attention, CausalLM, DecoderLayer, GatedMLP


@dataclass
class ModelArgs(BaseArgs):
    mlp_bias: bool = False

    def derive_layer_types(self, values: dict[str, Any]) -> list[str]:
        # Mistral windows every layer; Llama configs carry no window at all
        kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
        return [kind] * self.num_hidden_layers


def make_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    bias = args.attention_bias
    attn = Attention(args, layer_idx, qkv_bias=bias, o_bias=bias)
    mlp = GatedMLP(
        args.hidden_size, args.intermediate_size, bias=args.mlp_bias, act=args.hidden_act
    )
    return DecoderLayer(args, attn, mlp)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return weights
