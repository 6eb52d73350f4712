"""BlockManager contracts: reference counts, free list, growth, double-release detection."""

import pytest

from torch_runner.kv.block_manager import BlockManager


def test_allocate_and_release_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.grow(table, 10)  # ceil(10 / 4) = 3 blocks
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 5
    bm.grow(table, 12)  # still 3 blocks
    assert len(table) == 3
    bm.grow(table, 13)
    assert len(table) == 4
    bm.release(table)
    assert table == [] and bm.num_free_blocks == 8


def test_shared_block_is_freed_only_by_the_last_holder():
    bm = BlockManager(num_blocks=2, block_size=4)
    block = bm.allocate()
    bm.incref(block)
    bm.decref(block)
    assert bm.num_free_blocks == 1 and bm.refcount(block) == 1
    bm.decref(block)
    assert bm.num_free_blocks == 2 and bm.refcount(block) == 0


def test_double_release_and_exhaustion_are_errors():
    bm = BlockManager(num_blocks=1, block_size=4)
    block = bm.allocate()
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate()
    bm.decref(block)
    with pytest.raises(RuntimeError, match="already free"):
        bm.decref(block)
    with pytest.raises(RuntimeError, match="is free"):
        bm.incref(block)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
