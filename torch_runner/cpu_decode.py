"""The decode forward without module dispatch, for CPU.

Why: a batch-1 decode step of the default model on a 2-core CPU spends about a quarter of its
time between the matmuls, in ~120 small ops and their Python per layer (module calls, op
dispatch, argument checks, view shuffles). `decode_forward` is the same computation as
`model(input_ids, positions, caches)` for one new token per row, written as one flat loop
over the layers on 2-D [B, H] activations: the same ops in the same order on the same values
(the outputs match the module path bit for bit; tests/test_cpu_decode.py), fewer of them.

It covers the pre-norm decoders of models/layers.py whose layers are full attention with fused
q/k/v and gate/up projections and no q/k norm, sinks or window (Llama, Qwen2, Mistral without
windows: the default SmolLM2); `supports_fast_decode` says which. Everything else, and every
prefill chunk, runs through the modules.
"""

from __future__ import annotations

import torch

import ops
from models.args import SLIDING_ATTENTION
from models.layers import Attention, DecoderLayer, GatedMLP


def supports_fast_decode(model, args) -> bool:
    """True when every layer is a plain full-attention DecoderLayer with fused projections."""
    if SLIDING_ATTENTION in args.layer_types:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return False
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not GatedMLP:
            return False
        if attn.qkv_weight is None or mlp.gate_up_weight is None:
            return False
        if attn.q_norm is not None or attn.sinks is not None or attn.window is not None:
            return False
    return True


def decode_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, caches) -> torch.Tensor:
    """Hidden [B, 1, H] for one token per row: input_ids, positions [B, 1] int64; caches: one
    paged view per layer (`update_and_fetch` as in the module path)."""
    decoder = model.model
    rms_norm, attention = ops.impl("rms_norm"), ops.impl("attention")
    linear, linear_add = ops.linear, ops.linear_add
    b = input_ids.shape[0]
    h = decoder.embed_tokens(input_ids.view(b))  # [B, H]
    rope = decoder.rotary.at(positions, h.dtype)
    for layer, cache in zip(decoder.layers, caches):
        attn, mlp = layer.self_attn, layer.mlp
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        x = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = linear(x, attn.qkv_weight, attn.qkv_bias).view(b, 1, hq + 2 * hkv, d)
        qk = rope(qkv[:, :, : hq + hkv])  # [B, 1, Hq + Hkv, D]
        k, v = qk[:, :, hq:].transpose(1, 2), qkv[:, :, hq + hkv :].transpose(1, 2)
        keys, values, layout = cache.update_and_fetch(k, v)  # [B, Hkv, S, D]
        q = qk[:, :, :hq].transpose(1, 2)  # [B, Hq, 1, D]
        out = attention(q, keys, values, positions, layout, sm_scale=attn.scale)
        out = out.transpose(1, 2).reshape(b, hq * d)
        h = linear_add(out, attn.o_proj.weight, attn.o_proj.bias, h)
        x = rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gate, up = linear(x, mlp.gate_up_weight, mlp.gate_up_bias).chunk(2, dim=-1)
        down = mlp.down_proj
        h = linear_add(mlp.act(gate).mul_(up), down.weight, down.bias, h)
    return rms_norm(h, decoder.norm.weight, decoder.norm.eps).view(b, 1, -1)
