"""`fill_inputs` (the decode graphs' host input rows) against a row-by-row reference."""

import random

import torch

from torch_runner.runner.cuda_graphs import fill_inputs
from torch_runner.scheduler import ScheduledChunk
from torch_runner.sequence import Sequence


def _reference(group, block_size, num_rows, num_keys, scratch_slot, tokens):
    cols = num_keys // block_size
    out = torch.zeros(num_rows, 4 + cols, dtype=torch.int64)
    out[:, 3] = scratch_slot
    for i, chunk in enumerate(group):
        seq, pos = chunk.seq, chunk.start
        block = seq.block_table[pos // block_size]
        token = seq.all_token_ids[pos] if tokens is None else tokens[i]
        table = seq.block_table[:cols]
        out[i, :4] = torch.tensor([token, pos, pos + 1, block * block_size + pos % block_size])
        out[i, 4 : 4 + len(table)] = torch.tensor(table, dtype=torch.int64)
    return out


def test_rows_equal_the_reference_for_random_groups():
    rng = random.Random(0)
    for trial in range(200):
        block_size = rng.choice([1, 4, 16])
        group = []
        for _ in range(rng.randrange(0, 9)):
            seq = Sequence("r", [rng.randrange(1000) for _ in range(rng.randrange(1, 40))])
            seq.output_token_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]
            extra = rng.randrange(0, 4)  # blocks held past the position (cut by narrow keys)
            seq.block_table = rng.sample(range(500), -(-seq.num_tokens // block_size) + extra)
            group.append(ScheduledChunk(seq, seq.num_tokens - 1, 1))
        longest = max((c.start + 1 for c in group), default=1)
        # key widths below a table's length cut it (the graph reads only that many blocks)
        num_keys = block_size * rng.randrange(-(-longest // block_size), 70)
        num_rows = len(group) + rng.randrange(0, 4)
        tokens = None if trial % 2 else [-(i + 1) for i in range(len(group))]
        got = fill_inputs(group, block_size, num_rows, num_keys, 99_999, tokens)
        want = _reference(group, block_size, num_rows, num_keys, 99_999, tokens)
        assert got.dtype == torch.int64 and torch.equal(got, want), trial
