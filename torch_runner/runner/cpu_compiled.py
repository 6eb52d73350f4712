"""An inductor-compiled batch-1 CPU decode step over the runner's paged KV pool (`--cpu-compile on`).

Why: the flat decoder (cpu_decode.py) runs ~45 small aten ops per layer around the weight kernels;
`torch.compile` (freezing) fuses them into a few C++ loops (tools/bench_cpu_compiled_decode.py:
1.23-1.40x on the Intel box). The KV write + attention is one opaque op, so shapes stay static.
Compiled lazily at the first batch-1 decode step (12-60 s on 2 cores), one graph for the run.
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

import ops
from models.layers import rope_tables
from ops.attention import CPU_FLASH
from ops.norm import rms_norm_unchecked
from ops.rope import rotate

# the low-level torch.library API: `custom_op`'s Python wrapper cost ~120 us per call here
_LIB = torch.library.Library("torch_runner_cpu", "DEF")
_LIB.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) pool_k, Tensor(b!) pool_v, "
    "Tensor table, Tensor length, int block_size, float scale) -> Tensor"
)


def _decode_attention(q, k, v, pool_k, pool_v, table, length, block_size, scale):
    """Write k, v [1, Hkv, D] at the row's last slot (block `table` [max_blocks] int64, 0-dim
    `length` = keys after the write), attend q [1, Hq, 1, D] over its keys -> [1, Hq, 1, D]."""
    s = int(length)
    slot = int(table[(s - 1) // block_size]) * block_size + (s - 1) % block_size
    pool_k[slot].copy_(k[0])
    pool_v[slot].copy_(v[0])
    h, d = k.shape[1:]
    nb = (s + block_size - 1) // block_size
    blocks = table[:nb]

    def fetch(pool):
        paged = pool.narrow(0, 0, pool.shape[0] - pool.shape[0] % block_size)
        rows = paged.view(-1, block_size, h, d).index_select(0, blocks).view(nb * block_size, h, d)
        return rows[:s].view(1, s, h, d).transpose(1, 2)  # [1, Hkv, S, D]

    keys, values = fetch(pool_k), fetch(pool_v)
    if q.dtype != torch.float32:  # bf16: the fused kernel in fp32 on the upcast rows, rounded once
        # (AVX2 has no bf16 math: bf16 flash took 1.1-2.6x as long at 64-512 keys, 2026-12-03)
        out = CPU_FLASH(q.float(), keys.float(), values.float(), 0.0, False, attn_mask=None,
                        scale=scale)[0]  # fmt: skip
        return out.to(q.dtype)
    return CPU_FLASH(q, keys, values, 0.0, False, attn_mask=None, scale=scale)[0]


_LIB.impl("decode_attention", _decode_attention, "CPU")
_LIB.impl("decode_attention", lambda q, *rest: torch.empty_like(q), "Meta")
decode_attention = torch.ops.torch_runner_cpu.decode_attention


class _Step(torch.nn.Module):
    """One token of a Llama-style model (fused q/k/v and gate/up) -> final hidden [1, 1, H]."""

    def __init__(self, model, block_size: int):
        super().__init__()
        self.model, self.block_size = model, block_size

    def forward(self, ids, positions, table, length, pools_k: list, pools_v: list):
        decoder = self.model.model
        h = decoder.embed_tokens(ids)  # [1, H]
        rot = decoder.rotary
        cos, sin = rope_tables(positions, rot.inv_freq, rot.attention_scaling, h.dtype)
        for layer, pool_k, pool_v in zip(decoder.layers, pools_k, pools_v):
            attn, mlp = layer.self_attn, layer.mlp
            hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x = rms_norm_unchecked(h, ln1.weight, ln1.eps)
            qkv = ops.linear(x, attn.qkv_weight, attn.qkv_bias).view(1, 1, hq + 2 * hkv, d)
            qk = rotate(qkv[:, :, : hq + hkv], cos, sin)
            q = qk[:, :, :hq].transpose(1, 2)  # [1, Hq, 1, D]
            out = decode_attention(q, qk[:, 0, hq:], qkv[:, 0, hq + hkv :], pool_k, pool_v,
                                   table, length, self.block_size, attn.scale)  # fmt: skip
            out = out.transpose(1, 2).reshape(1, hq * d)
            h = ops.linear(out, attn.o_proj.weight, attn.o_proj.bias) + h
            x = rms_norm_unchecked(h, ln2.weight, ln2.eps)
            gate, up = ops.linear(x, mlp.gate_up_weight, mlp.gate_up_bias).chunk(2, dim=-1)
            h = ops.linear(mlp.act(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias) + h
        return rms_norm_unchecked(h, decoder.norm.weight, decoder.norm.eps).view(1, 1, -1)


class CompiledDecoder:
    """Batch-1 decode through the compiled step over `pool` (the runner's PagedKVPool; every
    layer full attention, as `supports_fast_decode` requires). Dense or int8/int4 weights only:
    inductor freezes them itself (oneDNN-packed weights are not traceable)."""

    def __init__(self, model, pool, block_size: int, max_blocks: int) -> None:
        self.pools_k, self.pools_v = list(pool.k_layers), list(pool.v_layers)
        self.table = torch.zeros(max_blocks, dtype=torch.int64)
        self.step = torch.compile(_Step(model, block_size).eval(), fullgraph=True, dynamic=False)
        self.is_compiled = False

    def __call__(self, input_ids, positions, block_table: list[int]) -> torch.Tensor:
        self.table[: len(block_table)] = torch.tensor(block_table, dtype=torch.int64)
        length = torch.tensor(int(positions.view(-1)[0]) + 1)
        if not self.is_compiled:  # compiles now: freezing makes the weights constants, packed
            # for MKL / oneDNN by inductor (torch 2.13: `options={"freezing": True}` on
            # torch.compile was ignored, so the step ran unfrozen, dense aten.mm)
            with inductor_config.patch(freezing=True):
                out = self.step(input_ids.view(1), positions.view(1, 1), self.table, length,
                                self.pools_k, self.pools_v)  # fmt: skip
            self.is_compiled = True
            return out
        return self.step(input_ids.view(1), positions.view(1, 1), self.table, length,
                         self.pools_k, self.pools_v)  # fmt: skip
