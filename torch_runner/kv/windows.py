"""Sliding-window state for the prefix cache: per-block payloads out of a request's windows,
and windowed caches restored from the payloads of a matched path.

Why per block: a snapshot of the whole window taken only where a prompt chunk ended could be
reused only there, so a shared system prompt shorter than a chunk, or the previous turns of a
chat, were recomputed. A payload holds every SWA layer's keys/values of the last
min(block_size, window) tokens of one block ([L_swa, Hkv, n, D] each), so the window ending at
any cached block boundary is the join of the last ceil(window / block_size) payloads of its
path (radix_cache.py). Memory: one payload node per block instead of one window per chunk;
the cap (`max_cached_windows` windows' worth of tokens, `payload_cap`) keeps the bound.

Paged windows (`swa_kv="paged"`) hold every token's KV in pool blocks, so a block is only
dead once no layer can read it. That is so when every layer is windowed: `free_behind_window`
gives back the blocks behind the window that nobody else holds (the table keeps a NO_BLOCK
hole there; blocks the prefix cache holds stay, as they were). When full
layers share the block (gpt-oss, Gemma 3: one block table for all layers) nothing is freed;
that would need a second pool and table for the SWA layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_runner.kv.block_manager import NO_BLOCK
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


def free_behind_window(block_manager, block_table: list[int], num_computed: int, window: int):
    """Give back this table's blocks that no future query can read and nobody else holds.

    The next query sits at `num_computed` and sees keys from num_computed - window + 1 on, so
    a block ending at or before num_computed - window is dead for every layer
    (layout.frees_behind_window); its entry becomes NO_BLOCK (the table keeps positions). A
    block the prefix cache or another request also holds is kept: dropping only this
    reference would free nothing and would let the cache evict a running request's prefix.
    Walks back from the newest dead block to the first hole or shared block, so a step costs
    O(blocks freed). Returns how many entries it cleared."""
    bs = block_manager.block_size
    j = min(max(num_computed - window, 0) // bs, len(block_table)) - 1
    cleared = 0
    while j >= 0 and block_table[j] != NO_BLOCK and block_manager.refcount(block_table[j]) == 1:
        block_manager.decref(block_table[j])
        block_table[j] = NO_BLOCK
        cleared += 1
        j -= 1
    return cleared
