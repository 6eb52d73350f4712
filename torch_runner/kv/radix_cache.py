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
    __slots__ = ("key", "block_id", "parent", "children", "last_access", "payload", "depth")

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
                self.block_manager.incref(block_id)  # NO_BLOCK: a hole node, no reference
                child = _Node(key, block_id, node, node.depth + 1)
                node.children[key] = child
                self._num_nodes += 1
                created += 1
            elif child.block_id == NO_BLOCK and block_id != NO_BLOCK:  # a hole filled again
                self.block_manager.incref(block_id)
                child.block_id = block_id
            child.last_access = now
            node = child
            if payload is not None and node.payload is None:
                node.payload = payload(i)
                if node.payload is not None:
                    self._payload_nodes.add(node)
                    added = True
        if added:
            self._cap_payloads()
        return created

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

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return (
            node is not self._root
            and not node.children
            and (node.block_id == NO_BLOCK or self.block_manager.refcount(node.block_id) == 1)
        )

    def _all_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_evictable_blocks(self) -> int:
        """Blocks that repeated leaf eviction could free now (O(nodes), no recursion: a long
        prompt is a chain thousands of nodes deep)."""
        order, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        is_free: dict[int, bool] = {}
        total = 0
        for node in reversed(order):  # children before their parents
            is_hole = node.block_id == NO_BLOCK
            free = (is_hole or self.block_manager.refcount(node.block_id) == 1) and all(
                is_free[id(c)] for c in node.children.values()
            )
            is_free[id(node)] = free
            total += free and not is_hole
        return total

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks, least recently used leaves first; returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._all_nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += node.block_id != NO_BLOCK
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.key]
        self._payload_nodes.discard(node)
        node.payload = None
        self._num_nodes -= 1
        self.block_manager.decref(node.block_id)

    def reset(self) -> None:
        """Drop every cached node (blocks still used by running sequences stay theirs)."""
        for node in list(self._all_nodes()):
            self.block_manager.decref(node.block_id)
            node.payload = None
        self._root.children.clear()
        self._payload_nodes.clear()
        self._num_nodes = 0
