"""ModelRunner grouping contract: every chunk runs exactly once, decodes share one forward, and
no group pads more than PAD_WASTE times its real tokens (checked by brute force)."""

import random

from torch_runner.runner.model_runner import PAD_WASTE, group_chunks
from torch_runner.scheduler import ScheduledChunk
from torch_runner.sequence import Sequence


def _chunk(i, n):
    return ScheduledChunk(Sequence(f"r{i}", list(range(n + 5))), 0, n)


def test_groups_cover_every_chunk_once_with_bounded_padding():
    rng = random.Random(0)
    for _ in range(200):
        chunks = [
            _chunk(i, rng.choice([1, 1, 1, 2, 7, 16, 64, 65, 300]))
            for i in range(rng.randint(1, 40))
        ]
        groups = group_chunks(chunks)
        flat = [c for g in groups for c in g]
        assert sorted(id(c) for c in flat) == sorted(id(c) for c in chunks)
        for g in groups:
            width = max(c.num_tokens for c in g)
            real = sum(c.num_tokens for c in g)
            assert len(g) == 1 or len(g) * width <= PAD_WASTE * real
        decode_groups = [g for g in groups if any(c.num_tokens == 1 for c in g)]
        assert len(decode_groups) <= 1  # all decodes run as one batched forward, alone
        assert all(c.num_tokens == 1 for g in decode_groups for c in g)
