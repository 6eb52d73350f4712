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
