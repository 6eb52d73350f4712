"""RadixCache contracts: longest block-prefix match against a brute-force reference, reference
counting with the BlockManager, LRU eviction of unreferenced leaves, payload-gated matches."""

import random

import pytest

from torch_runner.kv.block_manager import NO_BLOCK, BlockManager
from torch_runner.kv.radix_cache import RadixCache

BS = 4


def _brute_force_match(inserted: list[list[int]], tokens: list[int], max_tokens: int) -> int:
    """Longest number of whole blocks shared with any inserted sequence (a pure-Python oracle)."""
    best = 0
    limit = min(len(tokens), max_tokens) // BS
    for seq in inserted:
        n = 0
        while (
            n < limit
            and n < len(seq) // BS
            and seq[n * BS : (n + 1) * BS] == tokens[n * BS : (n + 1) * BS]
        ):
            n += 1
        best = max(best, n)
    return best


def _insert(cache: RadixCache, bm: BlockManager, tokens: list[int], payload=None) -> list[int]:
    table: list[int] = []
    bm.grow(table, len(tokens))
    num_full = len(tokens) // BS
    cache.insert(tokens, table[:num_full], payload)
    blocks = list(table)
    bm.release(table)  # the sequence finishes; the tree keeps its own references
    return blocks


def test_match_equals_brute_force_longest_block_prefix():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=4096, block_size=BS)
    cache = RadixCache(bm)
    inserted = []
    for _ in range(60):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        cut = rng.randint(0, len(base))
        tokens = base[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(1, 20))]
        _insert(cache, bm, tokens)
        inserted.append(tokens)
    for _ in range(200):
        base = rng.choice(inserted)
        tokens = base[: rng.randint(1, len(base))] + [
            rng.randint(0, 3) for _ in range(rng.randint(0, 6))
        ]
        max_tokens = rng.randint(0, len(tokens))
        blocks, _ = cache.match_prefix(tokens, max_tokens)
        assert len(blocks) == _brute_force_match(inserted, tokens, max_tokens)
    # every node holds exactly one reference: used blocks == nodes
    assert bm.num_used_blocks == cache.num_nodes


def test_matched_blocks_hold_the_inserted_tokens():
    bm = BlockManager(num_blocks=64, block_size=BS)
    cache = RadixCache(bm)
    a = list(range(10))
    table_a = _insert(cache, bm, a)
    blocks, _ = cache.match_prefix(a + [99], 11)
    assert blocks == table_a[:2]  # 10 tokens -> 2 full blocks cached


def test_lru_eviction_frees_unreferenced_leaves_oldest_first():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm)
    old = [1] * 8
    new = [2] * 8
    _insert(cache, bm, old)
    _insert(cache, bm, new)
    cache.match_prefix(new, 8)  # touch `new`
    assert cache.num_evictable_blocks() == 4
    assert cache.evict(2) == 2
    assert cache.match_prefix(old, 8)[0] == []  # the old path went first (leaf, then parent)
    assert len(cache.match_prefix(new, 8)[0]) == 2
    assert bm.num_free_blocks == 16 - 2


def test_referenced_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm)
    tokens = list(range(12))
    _insert(cache, bm, tokens)
    blocks, _ = cache.match_prefix(tokens, 12)
    for b in blocks[:2]:
        bm.incref(b)  # a running sequence shares the first two blocks
    assert cache.num_evictable_blocks() == 1
    assert cache.evict(3) == 1
    assert cache.match_prefix(tokens, 12)[0] == blocks[:2]
    for b in blocks[:2]:
        bm.decref(b)
    cache.reset()
    assert bm.num_free_blocks == 16 and cache.num_nodes == 0


def test_payload_gated_match_stops_at_deepest_payload_node():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm, max_payloads=2)
    tokens = list(range(16))
    _insert(cache, bm, tokens[:8], payload=lambda i: f"block-{i}" if i == 1 else None)
    _insert(cache, bm, tokens)  # deeper path, no payload
    blocks, restore = cache.match_prefix(tokens, 16, need_payload=True)
    assert len(blocks) == 2 and restore == (8, ["block-1"])
    blocks, restore = cache.match_prefix(tokens, 16)
    assert len(blocks) == 4 and restore is None
    _insert(cache, bm, [7] * 8, payload=lambda i: f"other-{i}")  # the cap (2) drops the oldest
    assert cache.num_payloads == 2
    assert cache.match_prefix(tokens, 16, need_payload=True) == ([], None)


def _covered_oracle(has_payload: list[bool], window: int, limit: int) -> int:
    """Deepest node count n <= limit whose last ceil(min(window, n*BS) / BS) nodes all hold a
    payload (brute force: check every candidate)."""
    best = 0
    for n in range(1, limit + 1):
        need = -(-min(window, n * BS) // BS)
        if all(has_payload[n - need : n]):
            best = n
    return best


def test_windowed_match_is_the_deepest_node_whose_window_payloads_are_all_held():
    rng = random.Random(0)
    for window in (2, 4, 7, 8, 13):
        for _ in range(30):
            bm = BlockManager(num_blocks=64, block_size=BS)
            cache = RadixCache(bm, max_payloads=1000, window=window)
            tokens = [rng.randrange(50) for _ in range(10 * BS)]
            has = [rng.random() < 0.7 for _ in range(10)]
            _insert(cache, bm, tokens, payload=lambda i, has=has: i if has[i] else None)
            limit = rng.randrange(0, 11)
            blocks, restore = cache.match_prefix(tokens + [1], limit * BS, need_payload=True)
            n = _covered_oracle(has, window, limit)
            assert len(blocks) == n, (window, has, limit)
            if n:
                need = -(-min(window, n * BS) // BS)
                assert restore == (n * BS, list(range(n - need, n)))
            else:
                assert restore is None


def test_insert_asks_payloads_only_for_nodes_without_one():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm, window=8)
    asked: list[int] = []
    tokens = list(range(12))

    def source(i):
        asked.append(i)
        return i

    _insert(cache, bm, tokens[:8], payload=source)
    _insert(cache, bm, tokens, payload=source)
    assert asked == [0, 1, 2]


def test_payload_cap_drops_the_deepest_of_a_path_first():
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm, max_payloads=3, window=8)
    tokens = list(range(20))
    _insert(cache, bm, tokens, payload=lambda i: i)  # 5 payloads, cap 3: keep blocks 0-2
    assert cache.num_payloads == 3
    blocks, restore = cache.match_prefix(tokens, 20, need_payload=True)
    assert len(blocks) == 3 and restore == (12, [1, 2])


def test_deep_chains_do_not_recurse():
    bm = BlockManager(num_blocks=4096, block_size=1)
    cache = RadixCache(bm)
    table: list[int] = []
    bm.grow(table, 3000)  # one 3000-block path, deeper than Python's recursion limit
    cache.insert(list(range(3000)), table)
    bm.release(table)
    assert cache.num_evictable_blocks() == 3000
    assert cache.evict(3000) == 3000 and bm.num_free_blocks == 4096


def test_hole_nodes_hold_no_block_and_matches_end_where_the_window_is_held():
    """Paged all-window models cache blocks given back behind the window as holes (NO_BLOCK):
    no reference is taken, a match needs the blocks of its last window (here 8 tokens: two
    nodes), a later insert with a real block fills a hole, eviction counts only real blocks."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = RadixCache(bm, window=8)
    tokens = list(range(28))  # 7 blocks
    table: list[int] = []
    bm.grow(table, 28)
    for j in (1, 2, 3):  # the middle went behind the window
        bm.decref(table[j])
        table[j] = NO_BLOCK
    cache.insert(tokens, table)
    bm.release(table)
    assert bm.num_used_blocks == 4 and cache.num_nodes == 7
    for limit, expect in ((28, 7), (24, 6), (20, 1), (8, 1), (4, 1)):
        blocks, restore = cache.match_prefix(tokens, limit)
        assert len(blocks) == expect and restore is None, limit
    assert cache.match_prefix(tokens, 28)[0][1:4] == [NO_BLOCK] * 3
    refill: list[int] = []
    bm.grow(refill, 16)
    cache.insert(tokens[:16], refill)  # block 0 exists; blocks 1-3 fill the holes
    bm.release(refill)
    assert (
        len(cache.match_prefix(tokens, 16)[0]) == 4
        and NO_BLOCK not in cache.match_prefix(tokens, 28)[0]
    )
    assert cache.num_evictable_blocks() == 7
    assert cache.evict(16) == 7 and bm.num_free_blocks == 16


def test_block_manager_ignores_references_on_no_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    table = [bm.allocate(), NO_BLOCK, bm.allocate()]
    bm.incref(NO_BLOCK)
    bm.release(table)
    assert bm.num_free_blocks == 4 and table == []


def _snapshot(cache: RadixCache, bm: BlockManager) -> list:
    """Every node as (node, parent, children, last_access, block_id, refcount), parents first."""
    out, stack = [], [(c, None) for c in cache._root.children.values()]
    while stack:
        node, parent = stack.pop()
        rc = bm.refcount(node.block_id) if node.block_id != NO_BLOCK else 0
        out.append(
            (node, parent, list(node.children.values()), node.last_access, node.block_id, rc)
        )
        stack.extend((c, node) for c in node.children.values())
    return out


def _brute_force_evictable(cache: RadixCache, bm: BlockManager) -> int:
    """Blocks freeable by repeated leaf eviction: a node is free when only the tree holds its
    block (or it is a hole) and every child is free (a walk of the whole tree, the oracle)."""
    rows = _snapshot(cache, bm)
    free: dict[int, bool] = {}
    total = 0
    for node, _, children, _, block, rc in reversed(rows):  # children before parents
        free[id(node)] = (block == NO_BLOCK or rc == 1) and all(free[id(c)] for c in children)
        total += free[id(node)] and block != NO_BLOCK
    return total


def _brute_force_evict_order(cache: RadixCache, bm: BlockManager, num_blocks: int) -> list[int]:
    """Blocks `evict(num_blocks)` must free, in order: repeatedly the least recently used leaf
    whose block only the tree holds (a full scan per pick, on a copy of the tree)."""
    rows = _snapshot(cache, bm)
    parent = {id(n): p for n, p, *_ in rows}
    kids = {id(n): {id(c) for c in ch} for n, _, ch, *_ in rows}
    info = {id(n): (t, b, rc) for n, _, _, t, b, rc in rows}
    order: list[int] = []
    while sum(b != NO_BLOCK for b in order) < num_blocks:
        leaves = [k for k in info if not kids[k] and (info[k][1] == NO_BLOCK or info[k][2] == 1)]
        if not leaves:
            break
        pick = min(leaves, key=lambda k: info[k][0])
        order.append(info.pop(pick)[1])
        if parent[pick] is not None:
            kids[id(parent[pick])].discard(pick)
    return [b for b in order if b != NO_BLOCK]


@pytest.mark.parametrize(("seed", "window"), [(0, None), (1, None), (2, 8), (3, 8)])
def test_evictable_count_and_eviction_order_match_a_full_walk(seed, window):
    """Random sequences share prefixes, take matched blocks, grow (evicting when the pool is
    short, as the scheduler does), publish and finish, some with holes; after every operation
    the kept evictable count equals a walk of the tree, and each eviction frees exactly the
    blocks a scan-per-pick LRU reference picks, in its order."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=120, block_size=BS)
    cache = RadixCache(bm, window=window)
    finished: list[list[int]] = [[]]
    live: list[tuple[list[int], list[int]]] = []
    num_evictions = 0

    def reserve(needed: int) -> bool:
        nonlocal num_evictions
        free = bm.num_free_blocks
        if needed <= free:
            return True
        if needed > free + cache.num_evictable_blocks():
            return False
        expect = _brute_force_evict_order(cache, bm, needed - free)
        before = list(bm._free)
        cache.evict(needed - free)
        assert list(bm._free)[len(before) :] == expect
        num_evictions += 1
        return True

    for _ in range(600):
        op = rng.random()
        if op < 0.4 and len(live) < 12:
            base = rng.choice(finished)
            tokens = base[: rng.randint(0, len(base))] + [
                rng.randint(0, 2) for _ in range(rng.randint(1, 14))
            ]
            table, _ = cache.match_prefix(tokens, len(tokens) - 1)
            table = list(table)
            for block in table:
                bm.incref(block)
            needed = bm.blocks_for_tokens(len(tokens)) - len(table)
            if reserve(needed):
                bm.grow(table, len(tokens))
                live.append((tokens, table))
            else:
                bm.release(table)
        elif op < 0.55 and live:  # publish a running sequence's full blocks
            tokens, table = rng.choice(live)
            cache.insert(tokens, table[: len(tokens) // BS])
        elif op < 0.85 and live:  # finish: holes where a window model gave blocks back
            tokens, table = live.pop(rng.randrange(len(live)))
            if window is not None:
                for j in range(len(table) - 2):
                    if table[j] != NO_BLOCK and rng.random() < 0.3:
                        bm.decref(table[j])
                        table[j] = NO_BLOCK
            cache.insert(tokens, table[: len(tokens) // BS])
            bm.release(table)
            finished.append(tokens)
        else:
            reserve(bm.num_free_blocks + rng.randint(1, 10))
        assert cache.num_evictable_blocks() == _brute_force_evictable(cache, bm)
    assert num_evictions > 20
    for _, table in live:
        bm.release(table)
    assert cache.num_evictable_blocks() == _brute_force_evictable(cache, bm)
    held = sum(b != NO_BLOCK for *_, b, _ in _snapshot(cache, bm))
    assert bm.num_used_blocks == held == cache.num_evictable_blocks()
    cache.reset()
    assert bm.num_free_blocks == 120 and cache.num_evictable_blocks() == 0


def test_eviction_order_holds_when_the_heap_is_rebuilt_mid_eviction():
    """Stale heap entries pile up (paths touched again and again) until the heap is rebuilt; a rebuild that falls inside an eviction must not change which blocks it frees, or
    their order. The old paths are the least recently used, so evicting them pushes their
    parents while the heap sits at its rebuild threshold."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    cache = RadixCache(bm)
    old = [[i] * BS + [i + 100] * BS for i in range(20)]  # two-block paths, never touched again
    hot = [[i + 50] * BS for i in range(10)]
    for tokens in old + hot:
        _insert(cache, bm, tokens)
    rng = random.Random(4)
    while len(cache._heap) < 2 * cache.num_nodes + 64:  # the older ones go stale
        cache.match_prefix(rng.choice(hot), BS)
    expect = _brute_force_evict_order(cache, bm, 40)
    before = len(bm._free)
    assert cache.evict(40) == 40
    assert list(bm._free)[before:] == expect
