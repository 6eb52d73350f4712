"""Gemma 3 (text): sandwich norms, (1 + weight) RMSNorm, scaled embeddings, 5:1 sliding layers
with their own rope base, and optional final-logit soft-capping.

Differences from the Llama block, each one line in transformers and one line here:
- RMSNorm multiplies by (1 + weight) (weights are stored zero-centred);
- every layer has four norms: before/after attention and before/after the MLP;
- embeddings are scaled by sqrt(hidden_size) (in the weight dtype), logits are soft-capped
  (`tanh(x / c) * c`) when `final_logit_softcapping` is set;
- attention scale is query_pre_attn_scalar ** -0.5, q/k are normed per head, and sliding and
  full layers use different rope parameters (`rope_parameters[layer_type]`);
- GeGLU MLP (gelu tanh). Gemma 2's attention-logit soft-capping is not supported by
  `ops.attention`, so a config that sets `attn_logit_softcapping` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ops
from models.args import FULL_ATTENTION, SLIDING_ATTENTION
from models.args import ModelArgs as BaseArgs
from models.layers import Attention, GatedMLP, Rotary, make_lm_head, project_to_vocab

DUMMY_NORM_WEIGHT = 0.0  # the loader's random weights: zero-centred norms scale by 1


@dataclass
class ModelArgs(BaseArgs):
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True

    def validate(self) -> None:
        super().validate()
        if self.attn_logit_softcapping is not None:
            raise ValueError(
                f"attn_logit_softcapping={self.attn_logit_softcapping} is not supported "
                "(ops.attention has no logit soft-capping); allowed values: null"
            )

    def derive_layer_types(self, values: dict[str, Any]) -> list[str]:
        return list(values.get("layer_types") or [FULL_ATTENTION] * self.num_hidden_layers)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))  # zero-centred: the scale is 1 + weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight.float() + 1.0, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_type = args.layer_types[layer_idx]
        bias = args.attention_bias
        self.self_attn = Attention(
            args,
            layer_idx,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            norm_cls=GemmaRMSNorm,
            scale=args.query_pre_attn_scalar**-0.5,
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, act=args.hidden_activation)
        size, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, positions, rope, cache):
        h = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, rope, cache)
        )
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_scale = args.hidden_size**0.5
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        per_type = isinstance(args.rope_parameters.get(FULL_ATTENTION), dict)
        self.rotary = nn.ModuleDict(
            {
                kind: Rotary(args, kind if per_type else None)
                for kind in (FULL_ATTENTION, SLIDING_ATTENTION)
            }
        )

    def forward(self, input_ids, positions, caches):
        h = self.embed_tokens(input_ids)  # [B, N, H]
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        # cos/sin once per rope kind per forward, not once per layer
        ropes = {kind: rotary.at(positions, h.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, ropes[layer.layer_type], None if caches is None else caches[i])
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = TextModel(args)
        self.lm_head = make_lm_head(args)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list | None = None
    ) -> torch.Tensor:
        """input_ids, positions [B, N] int64; caches: one per layer or None -> hidden [B, N, H]."""
        return self.model(input_ids, positions, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V], soft-capped when the config asks for it."""
        logits = project_to_vocab(hidden, self.model.embed_tokens, self.lm_head)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return weights
