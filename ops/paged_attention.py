"""Decode attention straight from the paged KV pool: one query token per row.

Why: the gather path copies every row's keys and values into a padded [B, Hkv, S, D] buffer per
layer and then runs masked SDPA over the padded width (0.68 ms of a 4.09 ms 1B batch-64 step on
an H200). Here a row's query reads its keys where they live, through the block table, and only
the keys it can see: positions [max(0, L - W), L) for kv_len L and window W. Sinks add one
logit per head to the softmax denominator (no value). Nothing depends on host values, so the
op is CUDA-graph safe.

`paged_decode_attention` is the torch reference (also the CPU path, and the oracle of the
Triton kernel's tests); `ops/paged_attention_triton.py` is the CUDA kernel with the same
signature, picked once per device type from `IMPLS`.
"""

from __future__ import annotations

import importlib

import torch

from ops.env import env_choice


def check_paged_args(q, k_pool, v_pool, block_tables, kv_lens, block_size, sinks) -> None:
    """Shape checks shared by the reference and the kernel; errors name the argument."""
    if q.dim() != 3 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"paged_decode_attention: q must be [B, Hq, D], k_pool/v_pool [slots, Hkv, D]; got "
            f"q{tuple(q.shape)}, k_pool{tuple(k_pool.shape)}, v_pool{tuple(v_pool.shape)}"
        )
    if q.shape[2] != k_pool.shape[2] or q.shape[1] % k_pool.shape[1]:
        raise ValueError(
            f"paged_decode_attention: head dims differ or Hkv={k_pool.shape[1]} does not divide "
            f"Hq={q.shape[1]}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"paged_decode_attention: block_tables must be [B={q.shape[0]}, blocks]; got "
            f"{tuple(block_tables.shape)}"
        )
    if tuple(kv_lens.shape) != (q.shape[0],):
        raise ValueError(
            f"paged_decode_attention: kv_lens must be [B={q.shape[0]}]; got {tuple(kv_lens.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"paged_decode_attention: block_size must be >= 1; got {block_size}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"paged_decode_attention: sinks must be [Hq={q.shape[1]}]; got {tuple(sinks.shape)}"
        )


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_size: int,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query per row over its paged keys (torch reference, fp32 softmax).

    q [B, Hq, D] (the query of position kv_lens[b] - 1); k_pool, v_pool [slots, Hkv, D];
    block_tables [B, blocks] int; kv_lens [B] int, keys per row including the current token
    (0: a padding row, output 0). Key j of row b lives at slot
    block_tables[b, j // block_size] * block_size + j % block_size. Returns [B, Hq, D] in q's
    dtype.
    """
    check_paged_args(q, k_pool, v_pool, block_tables, kv_lens, block_size, sinks)
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=q.device)  # [S]
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, S]
    lens = kv_lens.long()[:, None]
    visible = pos < lens
    if window is not None:
        visible = visible & (pos >= lens - window)
    slots = slots.masked_fill(~visible, 0)
    keys = k_pool[slots].float()  # [B, S, Hkv, D]
    values = v_pool[slots].float()
    group = hq // hkv
    qf = q.float().view(b, hkv, group, d)
    scores = torch.einsum("bhgd,bshd->bhgs", qf, keys) * sm_scale  # [B, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, group, 1).expand(b, -1, -1, -1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :width]  # padding rows: 0
    out = torch.einsum("bhgs,bshd->bhgd", probs, values)
    return out.reshape(b, hq, d).to(q.dtype)


ENV_SPLIT_MIN_KEYS = "TORCH_RUNNER_ATTN_SPLIT_MIN_KEYS"
SPLIT_MIN_KEYS_CHOICES = ("64", "128", "256", "512", "1024")


def split_min_keys() -> int:
    """ENV_SPLIT_MIN_KEYS (default 64, one key tile): the CUDA kernel splits a row's keys only into
    parts of at least this many, so a short context decodes in one split (no merge kernel) once
    it is raised. An experiment switch: which is faster at batch 1 is for the device to say."""
    return int(env_choice(ENV_SPLIT_MIN_KEYS, "64", SPLIT_MIN_KEYS_CHOICES))


# device type -> "module:function" with the reference's signature
IMPLS = {"cuda": "ops.paged_attention_triton:paged_decode_attention"}
_LOADED: dict[str, object] = {}


def impl_for(device: torch.device):
    """The implementation for a device type (loaded once): the Triton kernel on CUDA when
    Triton imports, else the torch reference."""
    kind = torch.device(device).type
    if kind not in _LOADED:
        fn = paged_decode_attention
        if kind in IMPLS:
            module, name = IMPLS[kind].split(":")
            try:
                fn = getattr(importlib.import_module(module), name)
            except ImportError:  # no Triton: the reference computes the same function
                fn = paged_decode_attention
        _LOADED[kind] = fn
    return _LOADED[kind]
