"""Prefix cache: a radix tree whose edges are whole pool blocks, with LRU eviction.

Each node stands for one full block of `block_size` tokens following its parent's tokens and
owns one reference on that block in the `BlockManager`. A request whose prompt starts with a
cached path takes references on those blocks and skips their prefill. Only leaves whose block
nobody else references (count 1: the tree's own) can be evicted, least recently used first;
evicting a leaf can expose its parent.

Sliding-window (SWA) layers with per-request windows keep no pool KV, so a hit on such a model
is only exact when its SWA caches can be restored too. Nodes carry an optional `payload`: every
SWA layer's keys/values of the last min(block_size, window) tokens of the node's own block
(kv/windows.py makes and joins them). The window ending at a node is then the join of the
payloads of the last ceil(window / block_size) nodes of its path, so a prefix is reusable at
any block boundary whose window is covered, and such models match only up to the deepest node
whose window is (a node without one falls back to the deepest covered ancestor: never KV without
its window). Payloads are capped (`max_payloads` nodes, LRU, deepest first among equals)
because they live outside the pool.

Nothing here walks the tree per request: a node is *locked* when its block has another holder
(the BlockManager reports the crossings, `watch`) or a child is locked; the count of unlocked
nodes holding a block (what repeated leaf eviction can free) is kept as locks change, stopping
at the first ancestor whose state does not change. Eviction pops a lazy heap of candidate
leaves (LRU); entries gone stale (node removed, locked, no longer a leaf, touched since) are
skipped, and the heap is rebuilt when stale entries outnumber the nodes.

Paged models whose every layer is windowed give back blocks behind the window (`NO_BLOCK`
entries, kv/windows.py); such a block is cached as a hole node that holds no block, and a
match stops at the deepest node whose window's blocks are all held (the same rule, with
"holds its block" for "holds a payload"), so no key inside a window is ever missing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from torch_runner.kv.block_manager import NO_BLOCK, BlockManager


class _Node:
    __slots__ = (
        "key", "block_id", "parent", "children", "last_access", "payload", "depth",
        "is_shared", "num_locked_children", "is_locked",
    )  # fmt: skip

    def __init__(
        self, key: tuple[int, ...], block_id: int, parent: _Node | None, depth: int
    ) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0
        self.payload: Any = None
        self.depth = depth  # number of blocks from the root to this node, inclusive
        self.is_shared = False  # its block has a holder besides the tree
        self.num_locked_children = 0
        self.is_locked = False  # is_shared or a locked child: not evictable


class RadixCache:
    """Block-granular radix tree over token ids; see the module docstring."""

    def __init__(
        self, block_manager: BlockManager, max_payloads: int = 256, window: int | None = None
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_payloads = max_payloads
        # SWA window in tokens (None: one payload is the whole state a match needs)
        self.window = window
        self._root = _Node((), -1, None, 0)
        self._clock = itertools.count(1)
        self._num_nodes = 0
        self._payload_nodes: set[_Node] = set()
        self._num_evictable = 0  # unlocked nodes that hold a block
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, order, node) candidates
        self._order = itertools.count()
        block_manager.on_shared = self._on_shared
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_payloads(self) -> int:
        return len(self._payload_nodes)

    def _keys(self, token_ids: list[int], num_blocks: int):
        bs = self.block_size
        for i in range(num_blocks):
            yield tuple(token_ids[i * bs : (i + 1) * bs])

    def match_prefix(
        self, token_ids: list[int], max_tokens: int, need_payload: bool = False
    ) -> tuple[list[int], Any]:
        """Longest cached block path that is a prefix of `token_ids` and covers <= `max_tokens`.

        Returns (block ids, restore). Without `need_payload` restore is None. With it (SWA
        models) the match stops at the deepest node whose window is covered by payloads and
        restore is (end position, [payloads of the nodes covering the window, oldest first]),
        or None for an empty match. Takes no references.
        """
        now = next(self._clock)
        node, path = self._root, []
        for key in self._keys(
            token_ids, max(0, min(len(token_ids), max_tokens)) // self.block_size
        ):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            path.append(node)
        restore = None
        if need_payload:
            path, restore = self._covered_prefix(path, lambda n: n.payload is not None)
        elif self.window is not None:  # holes (NO_BLOCK) only where blocks left the window
            path, _ = self._covered_prefix(path, lambda n: n.block_id != NO_BLOCK)
        for visited in path:
            visited.last_access = now
        if path:
            self._offer(path[-1])
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(path) * self.block_size
        return [n.block_id for n in path], restore

    def _window_nodes(self, end: int) -> int:
        """Nodes whose payloads the window ending at `end` spans (1 without a window)."""
        if self.window is None:
            return 1
        return -(-min(self.window, end) // self.block_size)

    def _covered_prefix(self, path: list[_Node], holds) -> tuple[list[_Node], Any]:
        """The longest prefix of `path` whose last window is held (`holds(node)`: its payload,
        or its block), and its restore (end, payloads of the window's nodes)."""
        run = best = 0  # run: consecutive holding nodes ending at node i
        for i, node in enumerate(path):
            run = run + 1 if holds(node) else 0
            if run >= self._window_nodes((i + 1) * self.block_size):
                best = i + 1
        if not best:
            return [], None
        end = best * self.block_size
        need = self._window_nodes(end)
        return path[:best], (end, [n.payload for n in path[best - need : best]])

    def insert(
        self,
        token_ids: list[int],
        block_ids: list[int],
        payload: Callable[[int], Any] | None = None,
    ) -> int:
        """Cache the first `len(block_ids)` full blocks of `token_ids`; returns new node count.

        Existing nodes keep their own block (the caller's duplicate stays the caller's).
        `payload(i)`, when given, is asked for the payload of block i for every node of the
        path that has none (it may return None: no longer held).
        """
        if len(token_ids) < len(block_ids) * self.block_size:
            raise ValueError("insert: token_ids shorter than the blocks to cache")
        now = next(self._clock)
        node, created, added = self._root, 0, False
        for i, (key, block_id) in enumerate(zip(self._keys(token_ids, len(block_ids)), block_ids)):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, NO_BLOCK, node, node.depth + 1)
                node.children[key] = child
                self._num_nodes += 1
                created += 1
                self._hold(child, block_id)  # NO_BLOCK: a hole node, no reference
            elif child.block_id == NO_BLOCK and block_id != NO_BLOCK:  # a hole filled again
                self._hold(child, block_id)
            child.last_access = now
            node = child
            if payload is not None and node.payload is None:
                node.payload = payload(i)
                if node.payload is not None:
                    self._payload_nodes.add(node)
                    added = True
        if node is not self._root:
            self._offer(node)
        if added:
            self._cap_payloads()
        return created

    # ---- lock bookkeeping (see the module docstring) ----------------------------------
    def _hold(self, node: _Node, block_id: int) -> None:
        """Give `node` (a hole, possibly just created) the tree's reference on `block_id`."""
        if block_id == NO_BLOCK:
            return
        self.block_manager.incref(block_id)
        self.block_manager.watch(block_id, node)
        node.block_id = block_id
        if not node.is_locked:
            self._num_evictable += 1
        self._set_shared(node, self.block_manager.refcount(block_id) > 1)

    def _on_shared(self, node: _Node, is_shared: bool) -> None:
        self._set_shared(node, is_shared)
        if not is_shared:
            self._offer(node)

    def _set_shared(self, node: _Node, is_shared: bool) -> None:
        node.is_shared = is_shared
        while node is not self._root:
            locked = node.is_shared or node.num_locked_children > 0
            if locked == node.is_locked:
                return
            node.is_locked = locked
            if node.block_id != NO_BLOCK:
                self._num_evictable += -1 if locked else 1
            node = node.parent
            node.num_locked_children += 1 if locked else -1

    def _offer(self, node: _Node) -> None:
        """Queue `node` for eviction if it is an unlocked leaf (entries may go stale later)."""
        if node.children or node.is_locked or node is self._root:
            return
        heapq.heappush(self._heap, (node.last_access, next(self._order), node))
        if len(self._heap) > 2 * self._num_nodes + 64:  # in place: `evict` may be popping it
            self._heap[:] = [
                (n.last_access, next(self._order), n)
                for n in self._all_nodes()
                if not n.children and not n.is_locked
            ]
            heapq.heapify(self._heap)

    def _cap_payloads(self) -> None:
        """Drop the least recently used payloads over the cap; among equals the deepest first
        (a path is touched as a whole, and dropping its tail keeps its head's windows)."""
        excess = len(self._payload_nodes) - self.max_payloads
        if excess <= 0:
            return
        for node in heapq.nsmallest(
            excess, self._payload_nodes, key=lambda n: (n.last_access, -n.depth)
        ):
            node.payload = None
            self._payload_nodes.discard(node)

    def _all_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_evictable_blocks(self) -> int:
        """Blocks that repeated leaf eviction could free now (kept as locks change: O(1))."""
        return self._num_evictable

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks, least recently used leaves first; returns freed."""
        freed, heap = 0, self._heap
        while heap and freed < num_blocks:
            access, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.is_locked or access != node.last_access:
                continue  # stale: removed, locked, grown or touched since it was queued
            parent = node.parent
            self._remove(node)
            freed += node.block_id != NO_BLOCK
            self._offer(parent)
        return freed

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.key]
        node.parent = None
        self._payload_nodes.discard(node)
        node.payload = None
        self._num_nodes -= 1
        if node.block_id != NO_BLOCK:
            self._num_evictable -= 1  # only unlocked leaves are removed
            self.block_manager.unwatch(node.block_id)
            self.block_manager.decref(node.block_id)

    def reset(self) -> None:
        """Drop every cached node (blocks still used by running sequences stay theirs)."""
        for node in list(self._all_nodes()):
            if node.block_id != NO_BLOCK:
                self.block_manager.unwatch(node.block_id)
                self.block_manager.decref(node.block_id)
            node.payload = None
            node.parent = None
        self._root.children.clear()
        self._root.num_locked_children = 0
        self._payload_nodes.clear()
        self._heap.clear()
        self._num_nodes = self._num_evictable = 0
