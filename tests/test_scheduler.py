"""Scheduler contracts, checked against a pure-Python KV oracle.

A fake runner stores, for every pool slot it writes, the hash of the whole token prefix that
the KV at that slot would depend on; before running a chunk it checks that every earlier slot
of the sequence's block table holds exactly the right prefix. The fake model's next token is a
pure function of the token history, so every request's output must equal a one-at-a-time
reference run, whatever the batching, chunking, prefix sharing or preemption did.
"""

import random

import pytest

from torch_runner.kv.block_manager import BlockManager
from torch_runner.kv.radix_cache import RadixCache
from torch_runner.scheduler import ScheduledChunk, Scheduler
from torch_runner.sequence import Sequence, SequenceStatus

BS = 4
VOCAB = 7


def _next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % VOCAB


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(_next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, num_blocks: int) -> None:
        self.slots: list[int | None] = [None] * (num_blocks * BS)
        self.num_steps = 0

    def run(self, out) -> dict:
        sampled = {}
        for chunk in out.chunks:
            # the decode fast path's chunks are what the constructor makes (is_sampled too)
            assert chunk == ScheduledChunk(chunk.seq, chunk.start, chunk.num_tokens,
                                           chunk.restore_from)  # fmt: skip
            seq, toks = chunk.seq, chunk.seq.all_token_ids
            for p in range(chunk.start):
                slot = seq.block_table[p // BS] * BS + p % BS
                assert self.slots[slot] == hash(tuple(toks[: p + 1])), f"stale KV at {p} for {seq}"
            for p in range(chunk.start, chunk.end):
                self.slots[seq.block_table[p // BS] * BS + p % BS] = hash(tuple(toks[: p + 1]))
            if chunk.is_sampled:
                sampled[seq.request_id] = _next_token(toks)
        self.num_steps += 1
        return sampled


def _make(num_blocks=256, budget=16, chunked=True, prefix=True, max_num_seqs=8):
    bm = BlockManager(num_blocks, BS)
    cache = RadixCache(bm) if prefix else None
    sched = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        token_budget=budget,
        is_chunked_prefill=chunked,
        prefix_cache=cache,
    )
    return bm, cache, sched, FakeRunner(num_blocks)


def _drive(sched, runner, arrivals: dict[int, list[Sequence]], max_tokens: int, budget: int):
    step, outs = 0, []
    while arrivals or sched.has_unfinished():
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget or (
            not sched.is_chunked_prefill and len(out.chunks) == 1
        )
        assert len(sched.running) <= sched.max_num_seqs
        sampled = runner.run(out)
        sched.advance(out)
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.request_id in sampled:
                seq.append_token(sampled[seq.request_id])
                if seq.num_output_tokens >= max_tokens:
                    sched.finish(seq, "length")
        outs.append(out)
        step += 1
        assert step < 10_000
    return outs


def _requests(rng, n, shared_prefix=()):
    seqs = []
    for i in range(n):
        prompt = list(shared_prefix) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        seqs.append(Sequence(f"r{i}", prompt))
    return seqs


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
def test_batched_outputs_equal_one_at_a_time_with_midflight_arrivals(chunked, prefix):
    rng = random.Random(1)
    bm, _, sched, runner = _make(chunked=chunked, prefix=prefix, budget=16 if chunked else 64)
    seqs = _requests(rng, 12, shared_prefix=[1, 2, 3, 4, 5, 6])
    arrivals = {}
    for seq in seqs:
        arrivals.setdefault(rng.randint(0, 20), []).append(seq)
    _drive(sched, runner, arrivals, max_tokens=9, budget=16 if chunked else 64)
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_token_ids == _reference(seq.prompt_token_ids, 9)


def test_chunked_prefill_mixes_with_decode_and_respects_budget():
    bm, _, sched, runner = _make(budget=8, prefix=False)
    short, long = Sequence("short", [1, 2]), Sequence("long", list(range(7)) * 5)
    outs = _drive(sched, runner, {0: [short], 2: [long]}, max_tokens=12, budget=8)
    mixed = [o for o in outs if len(o.chunks) == 2]
    assert mixed and all(o.num_batched_tokens <= 8 for o in outs)
    assert any(c.num_tokens == 1 for c in mixed[0].chunks) and any(
        c.num_tokens > 1 for c in mixed[0].chunks
    )
    # non-final chunks end on a block boundary
    for o in outs:
        for c in o.chunks:
            if not c.is_sampled:
                assert c.end % BS == 0
    assert long.output_token_ids == _reference(long.prompt_token_ids, 12)


def test_prefix_hit_reports_cached_tokens_and_skips_their_prefill():
    bm, cache, sched, runner = _make(budget=64)
    shared = list(range(1, 7)) * 2  # 12 tokens = 3 blocks
    first = Sequence("a", shared + [0])
    _drive(sched, runner, {0: [first]}, max_tokens=3, budget=64)
    second = Sequence("b", shared + [5, 5])
    outs = _drive(sched, runner, {0: [second]}, max_tokens=3, budget=64)
    assert second.num_cached_tokens == 12
    assert outs[0].chunks[0].start == 12 and outs[0].chunks[0].num_tokens == 2
    assert second.output_token_ids == _reference(second.prompt_token_ids, 3)
    # a prompt that is entirely cached still computes its last token (to get logits)
    third = Sequence("c", list(shared))
    outs = _drive(sched, runner, {0: [third]}, max_tokens=2, budget=64)
    assert third.num_cached_tokens == 8 and outs[0].chunks[0].num_tokens == 4


@pytest.mark.parametrize("prefix", [True, False])
def test_tiny_pool_preempts_and_every_request_still_finishes_correctly(prefix):
    rng = random.Random(2)
    bm, _, sched, runner = _make(num_blocks=14, budget=16, prefix=prefix, max_num_seqs=6)
    seqs = [
        Sequence(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(8, 20))])
        for i in range(8)
    ]
    _drive(sched, runner, {0: seqs}, max_tokens=20, budget=16)
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.output_token_ids == _reference(seq.prompt_token_ids, 20)


@pytest.mark.parametrize("prefix", [True, False])
def test_abort_returns_the_pool_to_its_initial_free_count(prefix):
    rng = random.Random(3)
    bm, cache, sched, runner = _make(num_blocks=64, budget=16, prefix=prefix)
    seqs = _requests(rng, 6)
    for seq in seqs:
        sched.add(seq)
    for _ in range(4):
        out = sched.schedule()
        sampled = runner.run(out)
        sched.advance(out)
        for c in out.chunks:
            if c.seq.request_id in sampled:
                c.seq.append_token(sampled[c.seq.request_id])
    assert bm.num_free_blocks < 64
    for seq in seqs:
        assert sched.abort(seq.request_id) is seq and seq.finish_reason == "abort"
    assert sched.abort("missing") is None and not sched.has_unfinished()
    evictable = cache.num_evictable_blocks() if cache else 0
    assert bm.num_free_blocks + evictable == 64
    if cache:
        cache.reset()
    assert bm.num_free_blocks == 64


def test_prompt_larger_than_pool_is_rejected_with_a_clear_error():
    _, _, sched, _ = _make(num_blocks=2)
    with pytest.raises(ValueError, match="KV pool holds only 8"):
        sched.add(Sequence("big", list(range(9))))
