"""KV caches for one step: a shared paged pool for full-attention layers, a per-request window
for sliding-window (SWA) layers, both behind one protocol the models call:

    update_and_fetch(k [B, Hkv, N, D], v) -> (keys [B, Hkv, S, D], values, KeyLayout)

Why two kinds: a full-attention layer needs every past token, so its KV lives in fixed-size
blocks of a pool shared by all requests (prefix sharing, no fragmentation). An SWA layer only
ever reads the last `window` tokens, so it keeps a small per-request buffer of capacity
`window + max(chunk, window)` and never takes pool memory: decode appends in place, a full
buffer is compacted to its trailing window (amortised O(1) per token), `offset` stays absolute
(RoPE positions and scheduling do not change) and the returned key count always equals the
mask width, because the layout says where key 0 sits.

`CacheLayout(page_windows=True)` (the CUDA default, EngineConfig.swa_kv) stores the SWA layers
in the pool too: then every layer has fixed device storage, so a decode step with windows can
be captured in a CUDA graph, and the paged decode kernel reads only the window's keys; the
price is pool memory for the out-of-window tokens of those layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import ops
from models.args import SLIDING_ATTENTION
from ops.attention import KeyLayout
from ops.paged_attention import impl_for as paged_impl


@dataclass(frozen=True)
class CacheLayout:
    """Which layers are full attention (pool) and which are sliding (windowed)."""

    layer_types: tuple[str, ...]
    window: int | None
    page_windows: bool = False  # True: SWA layers live in the pool too (module docstring)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers whose KV lives in the paged pool."""
        if self.page_windows:
            return tuple(range(len(self.layer_types)))
        return tuple(i for i, t in enumerate(self.layer_types) if t != SLIDING_ATTENTION)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Layers with a per-request WindowedKVCache."""
        if self.page_windows:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def has_swa(self) -> bool:
        return bool(self.swa_layers)

    @property
    def frees_behind_window(self) -> bool:
        """Pool blocks wholly behind the window can be given back: every layer is windowed and
        in the pool (a full-attention layer in the same block would still read them)."""
        return (
            self.page_windows
            and self.window is not None
            and all(t == SLIDING_ATTENTION for t in self.layer_types)
        )


class WindowedKVCache:
    """One request's keys/values for one sliding-window layer (see the module docstring)."""

    __slots__ = ("keys", "values", "offset", "window", "_local")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window} is invalid; expected >= 1")
        self.window = window
        self.keys: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self.values: torch.Tensor | None = None
        self.offset = 0  # absolute position of the next token
        self._local = 0  # tokens held in the buffer

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def num_held(self) -> int:
        return self._local

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
        """Write a chunk [B, Hkv, S, D] in place; returns the buffer range (start, end) it sees."""
        s = keys.shape[2]
        kept = min(self._local, self.window)
        capacity = self.window + max(s, self.window)
        held = self.capacity
        if self._local + s > held or held > capacity:
            # compact the trailing window into a right-sized buffer: first write, a full buffer
            # (amortised O(1) per decode token), or shrinking back after a large prefill chunk
            b, h, _, d = keys.shape
            new_k = keys.new_empty((b, h, capacity, d))
            new_v = values.new_empty((b, h, capacity, d))
            if kept:
                new_k[:, :, :kept] = self.keys[:, :, self._local - kept : self._local]
                new_v[:, :, :kept] = self.values[:, :, self._local - kept : self._local]
            self.keys, self.values, self._local = new_k, new_v, kept
        start, end = self._local - kept, self._local + s
        self.keys[:, :, self._local : end] = keys
        self.values[:, :, self._local : end] = values
        self._local = end
        self.offset += s
        return start, end

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor):
        start, end = self.append(keys, values)
        b = keys.shape[0]
        first = self.offset - (end - start)  # absolute position of the first returned key
        layout = KeyLayout(
            torch.full((b,), first, dtype=torch.int64, device=keys.device),
            torch.full((b,), end - start, dtype=torch.int64, device=keys.device),
            is_causal_tail=True,
        )
        return self.keys[:, :, start:end], self.values[:, :, start:end], layout

    @classmethod
    def restore(
        cls, window: int, keys: torch.Tensor, values: torch.Tensor, offset: int
    ) -> WindowedKVCache:
        """A cache whose history ends at `offset` with `keys` [B, Hkv, <=window, D] as its tail."""
        cache = cls(window)
        held = keys.shape[2]
        capacity = window + window
        b, h, _, d = keys.shape
        cache.keys = keys.new_empty((b, h, capacity, d))
        cache.values = values.new_empty((b, h, capacity, d))
        cache.keys[:, :, :held] = keys
        cache.values[:, :, :held] = values
        cache._local, cache.offset = held, offset
        return cache


class PagedKVPool:
    """Device storage of the full-attention layers: per layer [num_slots, Hkv, D] for K and V.

    slot = block_id * block_size + offset-in-block; the BlockManager hands out block ids. The
    storage is left uninitialised (a large CPU pool is then only paged in as it fills): every
    slot a row reads below its kv_len was written first, and padding reads `pad_slot`, one
    extra slot kept at zero (garbage there could be NaN, and 0 * NaN poisons attention).
    `scratch_slot`, one more, takes the writes of padded rows in a CUDA-graph batch bucket
    and is never read (cuda_graphs.py).
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        self.scratch_slot = self.pad_slot + 1
        shape = (num_layers, self.pad_slot + 2, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, self.pad_slot].zero_()
        self.v[:, self.pad_slot].zero_()
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # per-layer views

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store new keys/values [T, Hkv, D] of `layer` at pool slots [T]."""
        self.k_layers[layer].index_copy_(0, slots, keys)
        self.v_layers[layer].index_copy_(0, slots, values)

    def gather(self, layer: int, slots: torch.Tensor, num_rows: int):
        """Keys and values of `layer` at slots [B * S] as [B, Hkv, S, D] (copies)."""
        _, _, h, d = self.k.shape
        keys = self.k_layers[layer].index_select(0, slots).view(num_rows, -1, h, d).transpose(1, 2)
        values = (
            self.v_layers[layer].index_select(0, slots).view(num_rows, -1, h, d).transpose(1, 2)
        )
        return keys, values


class PagedStepMeta:
    """Slot indices of one forward over B rows, shared by every full-attention layer.

    starts[i]: tokens of row i already cached; num_new[i]: its new tokens this forward (the
    input is padded to N = max(num_new)). Builds the write slots for the new tokens and the
    gather slots of every row's keys (padded to S = max(starts + num_new)) once.
    """

    def __init__(self, block_tables, starts, num_new, block_size, device, pad_slot: int) -> None:
        b, n = len(block_tables), max(num_new)
        kv_lens = [s + m for s, m in zip(starts, num_new)]
        s_max = max(kv_lens)
        width = max(len(t) for t in block_tables)
        padded = [x for t in block_tables for x in (*t, *([0] * (width - len(t))))]
        self.is_dense = all(m == n for m in num_new)  # no padded query tokens
        # the new tokens' rows of the padded [B * N] input (known here: no nonzero() sync)
        rows = [] if self.is_dense else [i * n + j for i, m in enumerate(num_new) for j in range(m)]
        device = torch.device(device)
        self.block_size = block_size
        if device.type == "cpu":  # numpy: ~1 us an op where a small torch op costs 5-10 us
            self._slots_on_host(padded, kv_lens, starts, rows, width, n, pad_slot)
        else:
            self._slots_on_device(padded, kv_lens, starts, rows, width, n, pad_slot, device)
        self.shape = (b, n, s_max)
        # one row whose blocks are consecutive (the common single-request case): its keys are a
        # slice of the pool, so fetching them is a view instead of a gather copy
        table = block_tables[0]
        num_blocks = -(-s_max // block_size)
        self.first_slot = None
        if (
            b == 1
            and table[0] >= 0  # not a block given back (NO_BLOCK): [-1, 0, 1] is no slice
            and all(table[i + 1] == table[i] + 1 for i in range(num_blocks - 1))
        ):
            self.first_slot = table[0] * block_size
        is_tail = len(set(kv_lens)) == 1 and len(set(num_new)) == 1
        self.layout = KeyLayout.contiguous(self.kv_lens, is_causal_tail=is_tail)

    # Both set block_tables [B, blocks], kv_lens [B], gather_slots [B * S] (every row's keys:
    # slot of position p = its page * block_size + p % block_size; keys past kv_len, and those of
    # blocks given back behind the window (NO_BLOCK < 0), read the zero pad slot: the window masks
    # them out, garbage there could be NaN), write_slots (the new tokens') and write_rows
    def _slots_on_device(self, padded, kv_lens, starts, rows, width, n, pad_slot, device):
        b, s_max, bs = len(kv_lens), max(kv_lens), self.block_size
        tables, lens, offsets, write_rows = _to_device((padded, kv_lens, starts, rows), device)
        tables = tables.view(b, width)  # [B, blocks]
        as_long = dict(dtype=torch.int64, device=device)
        self.block_tables, self.kv_lens = tables, lens
        pos = torch.arange(s_max, **as_long)  # [S]
        pages = tables[:, pos // bs]  # [B, S]
        slots = pages * bs + pos % bs  # [B, S]
        hidden = (pos >= lens[:, None]) | (pages < 0)
        self.gather_slots = slots.masked_fill_(hidden, pad_slot).view(-1)  # [B * S]
        offsets = offsets[:, None] + torch.arange(n, **as_long)  # [B, N]
        write = slots.view(b, s_max).gather(1, offsets.clamp_(max=s_max - 1))  # [B, N]
        self.write_rows = None if self.is_dense else write_rows
        self.write_slots = write.view(-1) if self.is_dense else write.view(-1)[write_rows]

    def _slots_on_host(self, padded, kv_lens, starts, rows, width, n, pad_slot):
        b, s_max, bs = len(kv_lens), max(kv_lens), self.block_size
        tables = np.array(padded, dtype=np.int64).reshape(b, width)
        lens = np.array(kv_lens, dtype=np.int64)
        pos = np.arange(s_max, dtype=np.int64)
        pages = tables[:, pos // bs]  # [B, S]
        slots = pages * bs + pos % bs
        slots[(pos >= lens[:, None]) | (pages < 0)] = pad_slot
        offsets = np.minimum(np.array(starts, dtype=np.int64)[:, None] + np.arange(n), s_max - 1)
        write = slots[np.arange(b)[:, None], offsets].reshape(-1)  # [B * N]
        self.block_tables, self.kv_lens = torch.from_numpy(tables), torch.from_numpy(lens)
        self.gather_slots = torch.from_numpy(slots.reshape(-1))
        if self.is_dense:
            self.write_rows, self.write_slots = None, torch.from_numpy(write)
        else:
            self.write_rows = torch.tensor(rows, dtype=torch.int64)
            self.write_slots = torch.from_numpy(write[rows])


def _to_device(parts, device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of the int lists `parts` on `device` from one host-to-device copy: from
    pinned memory on CUDA, queued like a kernel (a pageable `torch.tensor(list, device=cuda)`
    waits for every kernel queued before it: 4 such waits per eager step before)."""
    host = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
    if device.type == "cuda":
        flat = host.pin_memory().to(device, non_blocking=True)
    else:
        flat = host.to(device)
    out, at = [], 0
    for part in parts:
        out.append(flat[at : at + len(part)])
        at += len(part)
    return out


def decode_from_pool(pool, layer, write_slots, tables, kv_lens, q, k, v, sm_scale, sinks, window):
    """One decode token per row: store k, v [B, Hkv, 1, D] at `write_slots` [B], then attend
    q [B, Hq, 1, D] over each row's kv_lens [B] keys through `tables` [B, blocks] (the paged
    decode op: Triton on CUDA, the torch reference elsewhere). Returns [B, Hq, 1, D]."""
    b, h, _, d = k.shape
    pool.write(layer, write_slots, k.reshape(b, h, d), v.reshape(b, h, d))
    out = paged_impl(q.device)(q[:, :, 0], pool.k_layers[layer], pool.v_layers[layer], tables,
                               kv_lens, block_size=pool.block_size, sm_scale=sm_scale,
                               sinks=sinks, window=window)  # fmt: skip
    return out[:, :, None]


class PagedLayerView:
    """One pool layer's cache for one forward: writes the new KV, gathers the keys (or, for a
    CUDA decode step, attends straight from the pool)."""

    __slots__ = ("pool", "layer", "meta")

    def __init__(self, pool: PagedKVPool, layer: int, meta: PagedStepMeta) -> None:
        self.pool, self.layer, self.meta = pool, layer, meta

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        meta = self.meta
        b, h, n, d = k.shape
        k_new = k.transpose(1, 2).reshape(b * n, h, d)  # [B * N, Hkv, D]
        v_new = v.transpose(1, 2).reshape(b * n, h, d)
        if not meta.is_dense:
            k_new, v_new = k_new[meta.write_rows], v_new[meta.write_rows]
        return self.store_and_fetch(k_new, v_new)

    def attend(self, q, k, v, positions, *, sm_scale: float, sinks=None, window=None):
        """Write this step's K/V and attend: q [B, Hq, N, D] -> [B, Hq, N, D]. A CUDA decode
        step (N == 1) reads the pool through the block table; anything else gathers."""
        meta = self.meta
        if q.is_cuda and q.shape[2] == 1:
            return decode_from_pool(self.pool, self.layer, meta.write_slots, meta.block_tables,
                                    meta.kv_lens, q, k, v, sm_scale, sinks, window)  # fmt: skip
        keys, values, layout = self.update_and_fetch(k, v)
        return ops.attention(q, keys, values, positions, layout, sm_scale=sm_scale, sinks=sinks,
                             window=window)  # fmt: skip

    def store_and_fetch(self, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write this step's K/V [T, Hkv, D] (T: the real new tokens, row-major) and return every
        row's keys and values [B, Hkv, S, D] with the layout (`update_and_fetch` without the
        [B, Hkv, N, D] reshuffle; the CPU decode loop calls it with one token per row)."""
        meta = self.meta
        self.pool.write(self.layer, meta.write_slots, k_new, v_new)
        b, _, s = meta.shape
        h, d = k_new.shape[1:]
        if meta.first_slot is not None:
            pool_k, pool_v = self.pool.k_layers[self.layer], self.pool.v_layers[self.layer]
            keys = pool_k.narrow(0, meta.first_slot, s).view(b, s, h, d).transpose(1, 2)
            values = pool_v.narrow(0, meta.first_slot, s).view(b, s, h, d).transpose(1, 2)
            return keys, values, meta.layout  # [B, Hkv, S, D] views of the pool
        keys, values = self.pool.gather(self.layer, meta.gather_slots, b)
        return keys, values, meta.layout  # [B, Hkv, S, D]


class WindowedBatchView:
    """One SWA layer's caches for one forward over B rows (each row its own WindowedKVCache)."""

    __slots__ = ("caches", "num_new", "layouts")

    def __init__(self, caches: list[WindowedKVCache], num_new: list[int], layouts: dict) -> None:
        self.caches, self.num_new, self.layouts = caches, num_new, layouts

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        if len(self.caches) == 1 and k.shape[2] == self.num_new[0]:
            return self.caches[0].update_and_fetch(k, v)
        spans = []
        for i, (cache, count) in enumerate(zip(self.caches, self.num_new)):
            start, end = cache.append(k[i : i + 1, :, :count], v[i : i + 1, :, :count])
            spans.append((start, end, cache.offset - (end - start)))
        s_max = max(end - start for start, end, _ in spans)
        b, h, _, d = k.shape
        keys = k.new_zeros((b, h, s_max, d))  # [B, Hkv, S, D]
        values = v.new_zeros((b, h, s_max, d))
        for i, (cache, (start, end, _)) in enumerate(zip(self.caches, spans)):
            keys[i, :, : end - start] = cache.keys[0, :, start:end]
            values[i, :, : end - start] = cache.values[0, :, start:end]
        signature = tuple(spans)
        layout = self.layouts.get(signature)  # every SWA layer of the step shares one layout
        if layout is None:
            as_long = dict(dtype=torch.int64, device=k.device)
            layout = KeyLayout(
                torch.tensor([first for _, _, first in spans], **as_long),
                torch.tensor([end - start for start, end, _ in spans], **as_long),
            )
            self.layouts[signature] = layout
        return keys, values, layout
