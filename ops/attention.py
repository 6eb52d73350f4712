"""Attention over explicit positions: causal, GQA, optional sliding window and sinks.

Why one function with positions instead of a mask argument: a model should not know whether its
keys come from a paged pool, a windowed ring or nothing at all. The cache hands back its keys with
a `KeyLayout` (where key 0 sits, how many keys each row really has) and the queries carry their
absolute positions; every visibility rule (causal, window, padding) follows from those two. The
mask is built once per step per (window, shape) and cached on the layout, so 30 layers pay for
it once.

Fast paths (measured in tools/bench_ops.py, see docs/perf_sections/ops.md):
- no layout and the window cannot bind (N <= W): fused causal SDPA (`is_causal=True`), no mask
  tensor at all (the seed measured a materialised band at ~2x per layer);
- `layout.is_causal_tail` (the queries are the last N of S contiguous keys, every row full):
  the mask depends only on (N, S, W) and is a shared [N, S] tensor, or nothing for decode;
- CPU: aten's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA
  itself dispatches to) returns the log-sum-exp too, so sinks cost one elementwise rescale,
  out * sigmoid(lse - sink), and keep the fused causal path (2.5-3.5x faster than an extra
  key column with a per-head additive mask on gpt-oss shapes);
- elsewhere, sinks are one extra key column (key 0, value 0) whose additive logit is the sink;
- a sliding window over a long causal tail (N >= 2W, S >= 4W): blocks of W queries against
  their 2W keys in one batched kernel call, N x 2W scores instead of N x S (5x faster for a
  2048-token gpt-oss prefill, W = 128).
- CUDA: SDPA never picks cuDNN, whose kernels build an execution plan for every new key length
  (31-47 ms of host time each, measured on an H200: every prefill chunk and mixed step paid
  it); flash and memory-efficient kernels are compiled templates. A causal tail in fp16/bf16
  (one request's prefill chunk) goes to the flash kernel directly: bottom-right causal, GQA and
  the sliding window natively, and its log-sum-exp makes sinks the same rescale as on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F


@dataclass(eq=False)
class KeyLayout:
    """Where the keys a cache returns sit in absolute positions; one object per layer kind per step.

    k_offsets: [B] int64, absolute position of `keys[:, :, 0]` (0 unless the cache is windowed).
    kv_lens:   [B] int64, valid keys per row; keys at index >= kv_len are padding.
    is_causal_tail: optional host-side hint; True promises that every row has kv_len == S and
        that the N queries sit at positions k_offset + S - N ... k_offset + S - 1 (one request's
        prefill chunk or decode step over a contiguous cache). The mask is then built without
        reading any tensor (and is None for decode when the window cannot bind).
    """

    k_offsets: torch.Tensor
    kv_lens: torch.Tensor
    is_causal_tail: bool = False
    # per-step mask cache: (window, N, S, dtype) -> (q_positions it was built for, mask)
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def contiguous(cls, kv_lens: torch.Tensor, *, is_causal_tail: bool = False) -> KeyLayout:
        """Layout of a cache whose key 0 is position 0 for every row (full-attention caches)."""
        return cls(torch.zeros_like(kv_lens), kv_lens, is_causal_tail=is_causal_tail)

    def mask(self, q_positions: torch.Tensor, num_keys: int, window: int | None, dtype=None):
        """Visibility mask broadcastable to [B, H, N, S], or None when every key is visible.

        Boolean (True = attend) by default; with `dtype`, additive (0 / -inf) in that dtype.
        Rows with no visible key (padding rows) get key 0 unmasked so their output stays finite.
        """
        n = q_positions.shape[1]
        key = (window, n, num_keys, dtype)
        hit = self._masks.get(key)
        if hit is not None and hit[0] is q_positions:
            return hit[1]
        if self.is_causal_tail:  # memoised across layers and steps, whatever the layout object
            built = tail_mask(n, num_keys, window, q_positions.device)
            if dtype is not None and built is not None:
                built = _additive_cached(built, dtype)
        elif dtype is not None:
            built = additive(self.mask(q_positions, num_keys, window), dtype)
        else:
            built = position_mask(q_positions, self.k_offsets, self.kv_lens, num_keys, window)
        self._masks[key] = (q_positions, built)
        return built


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> 0 where visible, -inf where not, in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


@lru_cache(maxsize=16)
def _additive_cached(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return additive(mask, dtype)


@lru_cache(maxsize=16)
def tail_mask(n: int, num_keys: int, window: int | None, device) -> torch.Tensor | None:
    """[N, S] mask for queries that are the last N of S contiguous keys; None when all visible.

    Memoised: it depends on integers only, and callers never write into it.
    """
    past = num_keys - n
    binds = window is not None and num_keys > window
    if n == 1 and not binds:
        return None
    q_pos = torch.arange(past, num_keys, device=device)[:, None]  # [N, 1]
    k_pos = torch.arange(num_keys, device=device)[None, :]  # [1, S]
    allowed = k_pos <= q_pos
    if binds:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def position_mask(
    q_positions: torch.Tensor,
    k_offsets: torch.Tensor,
    kv_lens: torch.Tensor,
    num_keys: int,
    window: int | None,
) -> torch.Tensor:
    """[B, 1, N, S] mask from absolute positions; padding rows keep key 0 to stay finite."""
    idx = torch.arange(num_keys, device=q_positions.device)
    k_pos = (k_offsets[:, None] + idx)[:, None, :]  # [B, 1, S]
    q_pos = q_positions[:, :, None]  # [B, N, 1]
    allowed = (idx < kv_lens[:, None])[:, None, :] & (k_pos <= q_pos)  # [B, N, S]
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    allowed[:, :, 0] |= ~allowed.any(dim=-1)
    return allowed[:, None]


def check_attention_args(q, k, v, q_positions, layout, window, sinks) -> None:
    """Shape and argument checks shared by every attention backend; errors name the field."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be 4-D [B, H, N|S, D]; got q{tuple(q.shape)}, "
            f"k{tuple(k.shape)}, v{tuple(v.shape)}"
        )
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"attention: k/v must be [B, Hkv, S, D] matching q [B, Hq, N, D]; got q{tuple(q.shape)}, "
            f"k{tuple(k.shape)}, v{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: Hkv={k.shape[1]} must divide Hq={q.shape[1]}")
    if tuple(q_positions.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"attention: q_positions must be [B, N] = {(q.shape[0], q.shape[2])}; "
            f"got {tuple(q_positions.shape)}"
        )
    if layout is None and k.shape[2] != q.shape[2]:
        raise ValueError(
            f"attention: layout=None means keys are this chunk's tokens, so S must equal N; "
            f"got S={k.shape[2]}, N={q.shape[2]}"
        )
    if layout is not None and layout.is_causal_tail and k.shape[2] < q.shape[2]:
        raise ValueError(
            f"attention: layout.is_causal_tail needs the N={q.shape[2]} queries among the "
            f"S={k.shape[2]} keys (S >= N)"
        )
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be None or >= 1; got {window}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"attention: sinks must be [Hq] = [{q.shape[1]}]; got {tuple(sinks.shape)}"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    layout: KeyLayout | None,
    *,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with causal/window/padding rules derived from positions.

    q [B, Hq, N, D]; k, v [B, Hkv, S, D] with Hkv dividing Hq; q_positions [B, N] int64.
    layout None: the keys are exactly this chunk's tokens (S == N), at consecutive positions.
    Otherwise a query at position p sees key j (position k_offsets[b] + j) iff j < kv_lens[b],
    position <= p and, with a window W, position > p - W. sinks [Hq] adds one logit column per
    head, dropped after the softmax. Returns [B, Hq, N, D] in q's dtype; fully masked rows
    (padding) give finite output.
    """
    check_attention_args(q, k, v, q_positions, layout, window, sinks)
    n, num_keys = q.shape[2], k.shape[2]
    is_cpu_flash = q.device.type == "cpu" and CPU_FLASH is not None
    mask_dtype = q.dtype if is_cpu_flash else None  # the CPU kernel takes additive masks only
    is_causal = False
    if layout is None:
        # keys == queries at consecutive positions: index order is position order
        if window is None or n <= window:
            mask, is_causal = None, True
        else:
            mask = tail_mask(n, n, window, q.device)
            mask = mask if mask_dtype is None else _additive_cached(mask, mask_dtype)
    elif layout.is_causal_tail and n == num_keys and (window is None or n <= window):
        mask, is_causal = None, True
    else:
        mask = layout.mask(q_positions, num_keys, window, mask_dtype)
    is_tail = layout is None or layout.is_causal_tail
    if is_tail and q.is_cuda and flash_tail_ok(q, sinks, window, n, num_keys):
        return _flash_tail(q, k, v, window, sm_scale, sinks)
    if is_tail and window is not None and n >= 2 * window and num_keys >= 4 * window:
        return _banded(q, k, v, window, sm_scale, sinks, is_cpu_flash)
    return _sdpa(q, k, v, mask, is_causal, sm_scale, sinks, is_cpu_flash)


def _sdpa(q, k, v, mask, is_causal, sm_scale, sinks, is_cpu_flash):
    if is_cpu_flash:
        out, lse = CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=sm_scale)[:2]
        if sinks is None:
            return out
        # softmax with one more logit s: p_j' = p_j * S / (S + e^s) = p_j * sigmoid(lse - s)
        keep = torch.sigmoid(lse - sinks.float()[None, :, None])  # [B, Hq, N] fp32
        return (out * keep[..., None]).to(q.dtype)
    is_gqa = q.shape[1] != k.shape[1]
    with _no_cudnn() if q.is_cuda else _NO_CONTEXT:
        if sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=sm_scale, enable_gqa=is_gqa
            )
        return _attention_with_sinks(q, k, v, mask, is_causal, sm_scale, sinks, is_gqa)


_NO_CONTEXT = contextlib.nullcontext()


def _no_cudnn():
    """SDPA on CUDA without the cuDNN backend (a plan build per new shape; module docstring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


def flash_tail_ok(q, sinks, window, n: int, num_keys: int) -> bool:
    """The flash kernel takes this causal tail: fp16/bf16, head dim a multiple of 8 up to 256,
    and something for it to do that fused SDPA cannot (sinks, or a window that binds)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[3] % 8 or q.shape[3] > 256:
        return False
    binds = window is not None and num_keys > window
    return (sinks is not None or binds) and _FLASH_FORWARD is not None and n <= num_keys


# the flash-attention-2 forward SDPA uses: [B, N, H, D] inputs, (out, lse [B, H, N], ...)
_FLASH_FORWARD = getattr(torch.ops.aten, "_flash_attention_forward", None)


def _flash_tail(q, k, v, window, sm_scale, sinks):
    """Queries are the last N of S keys: bottom-right causal, window and GQA in the kernel."""
    n, s = q.shape[2], k.shape[2]
    left = -1 if window is None else window - 1  # a window includes the current token
    out, lse = _FLASH_FORWARD(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, n, s, 0.0, True,
        False, scale=sm_scale, window_size_left=left, window_size_right=0,
    )[:2]  # fmt: skip
    out = out.transpose(1, 2)  # [B, Hq, N, D]
    if sinks is None:
        return out
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])  # [B, Hq, N] fp32
    return (out * keep[..., None]).to(q.dtype)


def _banded(q, k, v, window, sm_scale, sinks, is_cpu_flash):
    """Sliding window over a long causal tail: blocks of W queries against their 2W keys.

    A full mask makes the kernel score all N x S pairs; blocking scores N x 2W (gpt-oss: W=128,
    so a 2048-token prefill does 1/8 of the work). Queries are the last N of S keys.
    """
    b, hq, n, d = q.shape
    s = k.shape[2]
    nb = -(-n // window)
    pad = nb * window - n
    past = s - n

    def blocks(t, left):  # [B, H, L, D] -> [B * nb, H, 2W, D]: block j starts at key past + jW - W
        t = F.pad(t, (0, 0, left, pad))[:, :, past:]  # [B, H, W + nb*W, D]
        t = t.unfold(2, 2 * window, window)  # [B, H, nb, D, 2W]
        return t.permute(0, 2, 1, 4, 3).reshape(b * nb, t.shape[1], 2 * window, d)

    qb = F.pad(q, (0, 0, 0, pad)).reshape(b, hq, nb, window, d)
    qb = qb.permute(0, 2, 1, 3, 4).reshape(b * nb, hq, window, d)  # [B * nb, Hq, W, D]
    mask = _band_mask(nb, window, min(past, window), q.device, q.dtype if is_cpu_flash else None)
    mask = mask.repeat(b, 1, 1, 1)  # [B * nb, 1, W, 2W]
    out = _sdpa(
        qb, blocks(k, window), blocks(v, window), mask, False, sm_scale, sinks, is_cpu_flash
    )
    out = out.reshape(b, nb, hq, window, d).permute(0, 2, 1, 3, 4)  # [B, Hq, nb, W, D]
    return out.reshape(b, hq, nb * window, d)[:, :, :n]


@lru_cache(maxsize=16)
def _band_mask(nb: int, window: int, past: int, device, dtype) -> torch.Tensor:
    """[nb, 1, W, 2W]: query r of block j sees local key c iff r < c <= r + W and the key exists
    (block j's key c is real key past + jW + c - W; `past` only matters below W)."""
    r = torch.arange(window, device=device)[:, None]
    c = torch.arange(2 * window, device=device)[None, :]
    j = torch.arange(nb, device=device)[:, None, None]
    allowed = (c > r) & (c <= r + window) & (past + j * window + c - window >= 0)  # [nb, W, 2W]
    allowed = allowed[:, None]
    return allowed if dtype is None else additive(allowed, dtype)


# aten's fused CPU kernel (what SDPA dispatches to on CPU); returns (out, lse, ...)
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention_with_sinks(q, k, v, mask, is_causal, sm_scale, sinks, is_gqa):
    """Sinks as an extra key column: key = 0, value = 0, additive logit = sinks[h]."""
    b, hkv, s, d = k.shape
    n = q.shape[2]
    zeros = k.new_zeros(b, hkv, 1, d)
    k_ext = torch.cat([k, zeros], dim=2)  # [B, Hkv, S + 1, D]
    v_ext = torch.cat([v, zeros], dim=2)
    if is_causal:
        mask = tail_mask(n, s, None, q.device)
    if mask is None:
        bias = q.new_zeros(1, 1, n, s)
    else:
        bias = additive(mask, q.dtype)
        while bias.dim() < 4:
            bias = bias[None]
    sink_col = sinks.to(q.dtype)[None, :, None, None].expand(bias.shape[0], -1, n, 1)
    bias = torch.cat([bias.expand(bias.shape[0], q.shape[1], n, s), sink_col], dim=-1)
    return F.scaled_dot_product_attention(
        q, k_ext, v_ext, attn_mask=bias, scale=sm_scale, enable_gqa=is_gqa
    )
