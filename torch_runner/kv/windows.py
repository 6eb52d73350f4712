"""Sliding-window state for the prefix cache: per-block payloads out of a request's windows,
and windowed caches restored from the payloads of a matched path.

Why per block: a snapshot of the whole window taken only where a prompt chunk ended could be
reused only there, so a shared system prompt shorter than a chunk, or the previous turns of a
chat, were recomputed. A payload holds every SWA layer's keys/values of the last
min(block_size, window) tokens of one block ([L_swa, Hkv, n, D] each), so the window ending at
any cached block boundary is the join of the last ceil(window / block_size) payloads of its
path (radix_cache.py). Memory: one payload node per block instead of one window per chunk;
the cap (`max_cached_windows` windows' worth of tokens, `payload_cap`) keeps the bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_runner.kv.caches import WindowedKVCache

Payload = tuple[torch.Tensor, torch.Tensor]  # keys, values [L_swa, Hkv, n, D]


def payload_cap(max_cached_windows: int, window: int | None, block_size: int) -> int:
    """Payload nodes holding as many tokens as `max_cached_windows` whole windows."""
    if window is None:
        return max_cached_windows
    return max_cached_windows * -(-window // block_size)


def block_payload(caches: list[WindowedKVCache], block_end: int, num_tokens: int):
    """Copies of the keys/values at positions [block_end - num_tokens, block_end) of every
    layer's window cache, stacked [L_swa, Hkv, n, D]; None when the buffers no longer hold
    them (or do not hold them yet)."""
    first = caches[0]
    held_from = first.offset - first.num_held
    lo = block_end - num_tokens
    if block_end > first.offset or lo < held_from:
        return None
    a = lo - held_from  # buffer index of position lo (every layer's buffer is laid out alike)
    keys = torch.stack([c.keys[0, :, a : a + num_tokens] for c in caches])
    values = torch.stack([c.values[0, :, a : a + num_tokens] for c in caches])
    return keys, values


def payload_source(
    caches: list[WindowedKVCache] | None, block_size: int
) -> Callable[[int], Payload | None] | None:
    """RadixCache.insert's `payload`: block index -> that block's payload (or None)."""
    if not caches:
        return None
    count = min(block_size, caches[0].window)
    return lambda i: block_payload(caches, (i + 1) * block_size, count)


def restore_windows(window: int, restore) -> list[WindowedKVCache]:
    """One WindowedKVCache per SWA layer whose history ends at the matched position.

    restore: (end position, payloads oldest first) from RadixCache.match_prefix; their joined
    tokens end at `end`, and the last min(window, end) of them are the window."""
    end, payloads = restore
    keys = torch.cat([k for k, _ in payloads], dim=2) if len(payloads) > 1 else payloads[0][0]
    values = torch.cat([v for _, v in payloads], dim=2) if len(payloads) > 1 else payloads[0][1]
    held = min(window, end)
    if keys.shape[2] < held:
        raise RuntimeError(
            f"prefix payloads hold {keys.shape[2]} tokens; the window ending at {end} needs {held}"
        )
    keys, values = keys[:, :, -held:], values[:, :, -held:]
    return [
        WindowedKVCache.restore(window, keys[i : i + 1], values[i : i + 1], end)
        for i in range(keys.shape[0])
    ]
