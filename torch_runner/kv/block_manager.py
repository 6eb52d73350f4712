"""Block ids and reference counts of the paged KV pool, in plain Python.

A block holds `block_size` consecutive tokens of one sequence for every full-attention layer.
A block may be shared: by several sequences that matched the same cached prefix and by the
prefix cache itself. Each holder owns one reference; a block returns to the free list when
its count drops to zero. Nothing here touches the device: the ModelRunner maps block ids to
pool rows.

`NO_BLOCK` in a block table marks a block given back because no layer can read it again (every
layer windowed and the block wholly behind the window, kv/windows.py); references on it are
no-ops, so tables with holes release and share like any other.

The prefix cache watches the blocks its nodes hold (`watch`): when such a block gains a second
holder or drops back to the cache's reference alone, `on_shared(owner, is_shared)` tells it, so
it keeps its evictable count without walking the tree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

NO_BLOCK = -1  # a block-table entry whose block was given back (out of every layer's window)


class BlockManager:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid; expected >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid; expected >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owners: list[Any] = [None] * num_blocks  # a watcher's token per watched block
        self.on_shared: Callable[[Any, bool], None] | None = None

    def watch(self, block_id: int, owner: Any) -> None:
        """Report this block's crossings between one holder and more to `on_shared(owner, ..)`."""
        self._owners[block_id] = owner

    def unwatch(self, block_id: int) -> None:
        self._owners[block_id] = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def allocate(self) -> int:
        """Take one free block (reference count 1)."""
        if not self._free:
            raise RuntimeError(
                "KV pool exhausted: no free block (the scheduler should have preempted)"
            )
        block_id = self._free.popleft()
        self._refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if block_id == NO_BLOCK:
            return
        count = self._refcounts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} is free; cannot add a reference")
        self._refcounts[block_id] = count + 1
        if count == 1 and self._owners[block_id] is not None:
            self.on_shared(self._owners[block_id], True)

    def decref(self, block_id: int) -> None:
        if block_id == NO_BLOCK:
            return
        count = self._refcounts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} is already free (double release)")
        self._refcounts[block_id] = count - 1
        if count == 1:
            self._free.append(block_id)
        elif count == 2 and self._owners[block_id] is not None:
            self.on_shared(self._owners[block_id], False)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append fresh blocks to `block_table` until it covers `num_tokens` tokens."""
        needed = self.blocks_for_tokens(num_tokens) - len(block_table)
        if needed > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, {len(self._free)} free")
        for _ in range(needed):
            block_table.append(self.allocate())

    def release(self, block_table: list[int]) -> None:
        """Drop one reference on every block of `block_table` and clear it."""
        for block_id in block_table:
            self.decref(block_id)
        block_table.clear()
