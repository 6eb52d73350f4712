"""Test-only KV caches implementing the model cache protocol, the simplest way possible.

`ContiguousCache` keeps every key (layout: key 0 = position 0). `WindowedCache` keeps only the
last window - 1 keys between calls and reports where its first key sits (`k_offsets`), so a
model that mishandles positions against offset keys fails the parity tests. Both assume every
row of the batch has the same length (what these tests feed them).
"""

from __future__ import annotations

import torch

from ops import KeyLayout


class ContiguousCache:
    def __init__(self):
        self.keys = None
        self.values = None

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        """k, v [B, Hkv, N, D] -> all keys/values so far [B, Hkv, S, D] and their layout."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        b, s = k.shape[0], self.keys.shape[2]
        layout = KeyLayout.contiguous(torch.full((b,), s, dtype=torch.int64))
        return self.keys, self.values, layout


class WindowedCache:
    def __init__(self, window: int):
        self.window = window
        self.keys = None
        self.values = None
        self.num_seen = 0  # absolute position of the next token

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        if self.keys is None:
            keys, values = k, v
        else:
            keys, values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.num_seen += k.shape[2]
        first = self.num_seen - keys.shape[2]  # absolute position of keys[:, :, 0]
        keep = self.window - 1  # the next query (position p) still needs keys p-W+1 .. p-1
        self.keys, self.values = keys[:, :, -keep:], values[:, :, -keep:]
        b = k.shape[0]
        layout = KeyLayout(
            torch.full((b,), first, dtype=torch.int64),
            torch.full((b,), keys.shape[2], dtype=torch.int64),
        )
        return keys, values, layout


def make_caches(args) -> list:
    """One cache per layer: windowed for sliding layers, contiguous for full ones."""
    return [
        WindowedCache(args.sliding_window) if kind == "sliding_attention" else ContiguousCache()
        for kind in args.layer_types
    ]


class RaggedCache:
    """Rows of different lengths in one padded buffer (full attention, key 0 = position 0).

    Built from per-row caches; each call appends row b's new keys at index kv_lens[b], so the
    batch's rows sit at different positions, as they do in a continuous-batching decode step.
    """

    def __init__(self, rows: list[ContiguousCache], capacity: int):
        first = rows[0].keys
        b, h, d = len(rows), first.shape[1], first.shape[3]
        self.keys = first.new_zeros(b, h, capacity, d)  # [B, Hkv, capacity, D]
        self.values = first.new_zeros(b, h, capacity, d)
        self.kv_lens = torch.tensor([row.keys.shape[2] for row in rows], dtype=torch.int64)
        for i, row in enumerate(rows):
            self.keys[i, :, : row.keys.shape[2]] = row.keys[0]
            self.values[i, :, : row.values.shape[2]] = row.values[0]

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        n = k.shape[2]
        for i, start in enumerate(self.kv_lens.tolist()):
            self.keys[i, :, start : start + n] = k[i]
            self.values[i, :, start : start + n] = v[i]
        self.kv_lens = self.kv_lens + n
        width = int(self.kv_lens.max())
        layout = KeyLayout.contiguous(self.kv_lens.clone())
        return self.keys[:, :, :width], self.values[:, :, :width], layout
