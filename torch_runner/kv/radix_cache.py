"""Prefix cache: a radix tree whose edges are whole pool blocks, with LRU eviction.

Each node stands for one full block of `block_size` tokens following its parent's tokens and
owns one reference on that block in the `BlockManager`. A request whose prompt starts with a
cached path takes references on those blocks and skips their prefill. Only leaves whose block
nobody else references (count 1: the tree's own) can be evicted, least recently used first;
evicting a leaf can expose its parent.

Sliding-window (SWA) layers keep no pool KV, so a hit on a model with SWA layers is only exact
when the SWA caches can be restored too: nodes carry an optional `payload` (the runner's
snapshot of every SWA layer's last `window` keys/values ending at that node), and such models
match only up to the deepest node holding one. Payloads are capped (`max_payloads`, LRU)
because they live outside the pool.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from torch_runner.kv.block_manager import BlockManager


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

    def __init__(self, block_manager: BlockManager, max_payloads: int = 256) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_payloads = max_payloads
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

        Returns (block ids, payload of the last node or None). With `need_payload`, the match
        stops at the deepest node that carries a payload (SWA models). Takes no references.
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
        if need_payload:
            while path and path[-1].payload is None:
                path.pop()
        for visited in path:
            visited.last_access = now
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(path) * self.block_size
        return [n.block_id for n in path], (path[-1].payload if path else None)

    def insert(self, token_ids: list[int], block_ids: list[int], payload: Any = None) -> int:
        """Cache the first `len(block_ids)` full blocks of `token_ids`; returns new node count.

        Existing nodes keep their own block (the caller's duplicate stays the caller's);
        `payload`, when given, is attached to the deepest node.
        """
        if len(token_ids) < len(block_ids) * self.block_size:
            raise ValueError("insert: token_ids shorter than the blocks to cache")
        now = next(self._clock)
        node, created = self._root, 0
        for key, block_id in zip(self._keys(token_ids, len(block_ids)), block_ids):
            child = node.children.get(key)
            if child is None:
                self.block_manager.incref(block_id)
                child = _Node(key, block_id, node, node.depth + 1)
                node.children[key] = child
                self._num_nodes += 1
                created += 1
            child.last_access = now
            node = child
        if payload is not None and node is not self._root:
            node.payload = payload
            self._payload_nodes.add(node)
            self._cap_payloads()
        return created

    def _cap_payloads(self) -> None:
        while len(self._payload_nodes) > self.max_payloads:
            oldest = min(self._payload_nodes, key=lambda n: n.last_access)
            oldest.payload = None
            self._payload_nodes.discard(oldest)

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return (
            node is not self._root
            and not node.children
            and self.block_manager.refcount(node.block_id) == 1
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
            free = self.block_manager.refcount(node.block_id) == 1 and all(
                is_free[id(c)] for c in node.children.values()
            )
            is_free[id(node)] = free
            total += free
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
            freed += 1
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
