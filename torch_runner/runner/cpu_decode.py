"""The decode forward without module dispatch, for CPU.

Why: a batch-1 decode step of the default model on a 2-core CPU spends about a quarter of its
time between the matmuls, in ~120 small ops and their Python per layer (module calls, op
dispatch, argument checks, view shuffles). `FlatDecoder` is the same computation as
`model(input_ids, positions, caches)` for one new token per row, written as one flat loop
over the layers on 2-D [B, H] activations: the same ops in the same order on the same values
(the outputs match the module path bit for bit; tests/test_cpu_decode.py), fewer of them.

It covers the pre-norm decoders of models/layers.py whose layers are full attention with fused
q/k/v and gate/up projections and no q/k norm, sinks or window (Llama, Qwen2, Mistral without
windows: the default SmolLM2); `supports_fast_decode` says which. Everything else, and every
prefill chunk, runs through the modules. Under tensor parallel it is each rank's loop over its
shard, with the two all-reduces per layer the module path has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ops
from models.args import SLIDING_ATTENTION
from models.layers import Attention, DecoderLayer, GatedMLP
from ops.attention import CPU_FLASH
from ops.cpu_native.weights import NativeWeight
from ops.norm import rms_norm_unchecked


def supports_fast_decode(model, args) -> bool:
    """True when every layer is a plain full-attention DecoderLayer with fused projections."""
    if SLIDING_ATTENTION in args.layer_types:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(isinstance(getattr(x, "mlp", None), GatedMLP) for x in layers):
        return False  # dense MLPs only
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if type(layer) is not DecoderLayer or type(attn) is not Attention:
            return False
        if attn.qkv_weight is None or layer.mlp.gate_up_weight is None:
            return False
        if attn.q_norm is not None or attn.sinks is not None or attn.window is not None:
            return False
    return True


class FlatDecoder:
    """The flat decode loop, with the per-layer tensors and sizes looked up once (a module attribute
    read costs ~1.3 us of Python, ~20 per layer). Built after the weights are final (loaded,
    fused, packed): replacing a parameter object later needs a new FlatDecoder."""

    def __init__(self, model, all_reduce=None) -> None:
        decoder = model.model
        # tensor parallel (torch_runner/distributed): o_proj and down_proj are row-parallel, so
        # their partial outputs are summed over the ranks before the residual add (as the
        # modules' all-reduce hooks do); the vocab-parallel embedding reduces inside its call
        self.all_reduce = all_reduce
        self.embed, self.rotary, self.final_norm = (
            decoder.embed_tokens,
            decoder.rotary,
            decoder.norm,
        )
        self.layers = [_layer_plan(layer) for layer in decoder.layers]
        # the torch norm without its per-call shape check (the weights are [H] by construction)
        is_torch_norm = ops.backends()["rms_norm"] == "torch"
        self.rms_norm = rms_norm_unchecked if is_torch_norm else ops.rms_norm
        # a decode row over its whole contiguous history needs no mask: the fused CPU kernel
        # straight away, as ops.attention itself ends up calling it (same call, same bits)
        self.flash = CPU_FLASH if ops.backends()["attention"] == "torch" else None
        # native CPU weights (ops/cpu_native): the small ops too, one C++ pass each (rms_norm,
        # silu * up) and bf16 attention in fp32 (AVX2 has no bf16 math); within rounding of
        # the module path, no longer bit for bit
        self.native, self.silu_mul = None, None
        lib = getattr(self.layers[0][2], "lib", None) if self.layers else None
        if (
            is_torch_norm
            and lib is not None
            and all(isinstance(p[2], NativeWeight) for p in self.layers)
        ):
            self.native = lib
            self.rms_norm = lib.rms_norm
            if all(p[14] is F.silu for p in self.layers):
                self.silu_mul = lib.silu_mul
        # the whole step as one native op (ops/cpu_native/decode_step.cpp): the per-op native
        # path's kernels in the same order (the same bits), without ~10 Python op calls a layer
        self.step_args, self._plan = None, None
        if self.silu_mul is not None and all_reduce is None:
            self.step_args = _native_step_args(self.layers, self.final_norm)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches) -> torch.Tensor:
        """Hidden [B, 1, H] for one token per row: input_ids, positions [B, 1] int64; caches:
        one PagedLayerView per layer (the pool slots of this step; `store_and_fetch`)."""
        rms_norm, attention, flash = self.rms_norm, ops.impl("attention"), self.flash
        linear, upcast = ops.linear, self.native is not None
        b = input_ids.shape[0]
        h = self.embed(input_ids.view(b))  # [B, H]
        rope = self._rope(positions, h.dtype, caches)
        tables = self._native_attention_tables(rope, caches)  # (cos, sin) [B, D] or None
        if tables is not None and self.step_args is not None:
            return self._native_step(h, tables, caches).view(b, 1, -1)
        for plan, cache in zip(self.layers, caches):
            ln1, eps1, qkv_w, qkv_b, hq, hkv, d, scale, o_w, o_b = plan[:10]
            x = rms_norm(h, ln1, eps1)
            if tables is not None:  # rope, K/V write and attention: one native op
                meta, pool = cache.meta, cache.pool
                out = self.native.decode_attention(
                    linear(x, qkv_w, qkv_b), *tables, pool.k_layers[cache.layer],
                    pool.v_layers[cache.layer], meta.write_slots, meta.gather_slots,
                    meta.kv_lens, hq, hkv, scale)  # fmt: skip
                h = self._mlp(self._o_proj(out, o_w, o_b, h), plan)
                continue
            qkv = linear(x, qkv_w, qkv_b).view(b, 1, hq + 2 * hkv, d)
            qk = rope(qkv[:, :, : hq + hkv])  # [B, 1, Hq + Hkv, D]
            # this step's K/V [B, Hkv, D] into the pool; every row's keys [B, Hkv, S, D]
            keys, values, layout = cache.store_and_fetch(qk[:, 0, hq:], qkv[:, 0, hq + hkv :])
            q = qk[:, :, :hq].transpose(1, 2)  # [B, Hq, 1, D]
            if layout.is_causal_tail and flash is not None:  # one row: every key visible
                if upcast and q.dtype == torch.bfloat16:  # fp32 math, rounded once
                    out = flash(q.float(), keys.float(), values.float(), 0.0, False,
                                attn_mask=None, scale=scale)[0].to(q.dtype)  # fmt: skip
                else:
                    out = flash(q, keys, values, 0.0, False, attn_mask=None, scale=scale)[0]
            else:
                out = attention(q, keys, values, positions, layout, sm_scale=scale)
            out = out.transpose(1, 2).reshape(b, hq * d)
            h = self._mlp(self._o_proj(out, o_w, o_b, h), plan)
        return rms_norm(h, self.final_norm.weight, self.final_norm.eps).view(b, 1, -1)

    def _rope(self, positions, dtype, caches):
        """The step's cos / sin: rows of a table of every position below the longest row
        (Rotary.covering: one gather where rope_tables is ~12 small ops, the same values)."""
        meta = getattr(caches[0], "meta", None) if caches else None
        rotary = self.rotary
        if meta is None:
            return rotary.at(positions, dtype)
        rotary.covering = meta.shape[2]  # every position this step is below the longest kv_len
        try:
            return rotary.at(positions, dtype)
        finally:
            rotary.covering = 0

    def _native_attention_tables(self, rope, caches):
        """(cos, signed sin) [B, D] when this step's attention can be the native decode op: native
        weights, torch rope tables over the whole head, paged caches, one new token per row."""
        if self.native is None or self.flash is None or rope.cos is None or not caches:
            return None
        meta = getattr(caches[0], "meta", None)
        d = self.layers[0][6]
        if meta is None or not meta.is_dense or meta.shape[1] != 1 or rope.cos.shape[-1] != d:
            return None
        if d % 8:
            return None
        b = meta.shape[0]
        return rope.cos.reshape(b, d).contiguous(), rope.sin.reshape(b, d).contiguous()

    def _native_step(self, h, tables, caches) -> torch.Tensor:
        """Every layer and the final norm in one native call: h [B, H] -> [B, H]. The weights
        and pools go to a DecodePlan once per (step_args, KV pool), not every step: passing
        them cost ~0.3 ms a SmolLM2 step."""
        meta, pool = caches[0].meta, caches[0].pool
        plan = self._plan
        if plan is None or plan[0] is not self.step_args or plan[1] is not pool:
            plan = self._plan = (self.step_args, pool, self._make_plan(caches))
        return plan[2](h, *tables, meta.write_slots, meta.gather_slots, meta.kv_lens)

    def _make_plan(self, caches):
        """run(h, cos, sin, write_slots, gather_slots, kv_lens) of a new DecodePlan; where the
        layers' caches are not one pool's layers in order, the decode_step op with them."""
        weights, kinds, eps, hq, hkv, scale = self.step_args
        pools_k = [c.pool.k_layers[c.layer] for c in caches]
        pools_v = [c.pool.v_layers[c.layer] for c in caches]
        pool = caches[0].pool
        if all(c.pool is pool and c.layer == i for i, c in enumerate(caches)):
            plan = torch.classes.torch_runner_native.DecodePlan(
                weights, kinds, eps, pools_k, pools_v, hq, hkv, scale
            )
            return plan.run
        step = self.native.decode_step
        return lambda h, cos, sin, *meta: step(
            h, cos, sin, weights, kinds, eps, pools_k, pools_v, *meta, hq, hkv, scale
        )

    def _o_proj(self, out, o_w, o_b, h):
        """h + out @ o_proj (summed over the tensor-parallel ranks first)."""
        if self.all_reduce is None:
            return ops.linear_add(out, o_w, o_b, h)
        return h + self.all_reduce(ops.linear(out, o_w, o_b))

    def _mlp(self, h, plan):
        """h + the gated MLP of rms_norm(h) (down_proj summed over the ranks first)."""
        ln2, eps2, gu_w, gu_b, down_w, down_b = (
            plan[10],
            plan[11],
            plan[12],
            plan[13],
            plan[15],
            plan[16],
        )
        gate_up = ops.linear(self.rms_norm(h, ln2, eps2), gu_w, gu_b)
        if self.silu_mul is not None:
            mixed = self.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mixed = plan[14](gate).mul_(up)
        if self.all_reduce is None:
            return ops.linear_add(mixed, down_w, down_b, h)
        return h + self.all_reduce(ops.linear(mixed, down_w, down_b))


def _native_step_args(plans, final_norm):
    """(weights, kinds, eps, hq, hkv, scale) for decode_step (its layout: decode_step.cpp), or
    None when the layers differ in their head counts or scale."""
    if len({(p[4], p[5], p[7]) for p in plans}) != 1:
        return None
    weights, kinds, eps = [], [], []
    for p in plans:
        qkv, o, gate_up, down = (w.step_fields() for w in (p[2], p[8], p[12], p[15]))
        kinds += [qkv[0], o[0], gate_up[0], down[0]]
        weights += [p[0], *qkv[1:], p[3], *o[1:], p[9], p[10], *gate_up[1:], p[13], *down[1:],
                    p[16]]  # fmt: skip
        eps += [p[1], p[11]]
    weights.append(final_norm.weight)
    eps.append(final_norm.eps)
    return weights, kinds, eps, plans[0][4], plans[0][5], plans[0][7]


def _layer_plan(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2, o, down = (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        attn.o_proj,
        mlp.down_proj,
    )
    return (ln1.weight, ln1.eps, attn.qkv_weight, attn.qkv_bias, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.scale, o.weight, o.bias, ln2.weight, ln2.eps,
            mlp.gate_up_weight, mlp.gate_up_bias, mlp.act, down.weight, down.bias)  # fmt: skip
