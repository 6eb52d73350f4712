"""The scheduler's side of overlapped scheduling, in plain Python: a sequence with an output
placeholder (a token sampled by the step in flight) is scheduled for one chained decode token
whose KV slot is allocated; one that surely ends at its placeholder (max_tokens, the context)
is not scheduled and its seat goes to a waiting request at once; a preempted sequence whose
token is still in flight is not re-admitted until it is known; prefix publishing keys only
known tokens. The oracle is the same schedule with the token already appended."""

from types import SimpleNamespace

from torch_runner.kv.block_manager import BlockManager
from torch_runner.kv.radix_cache import RadixCache
from torch_runner.scheduler import Scheduler
from torch_runner.sequence import Sequence

BS = 4


def _params(max_tokens=None):
    return SimpleNamespace(max_tokens=max_tokens)


def _scheduler(num_blocks=32, max_num_seqs=4, prefix=False, max_model_len=None):
    bm = BlockManager(num_blocks, BS)
    cache = RadixCache(bm) if prefix else None
    return Scheduler(bm, max_num_seqs=max_num_seqs, token_budget=64, prefix_cache=cache,
                     max_model_len=max_model_len)  # fmt: skip


def _run_prefill(sched, seq):
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out)
    return out


def test_a_placeholder_gets_a_chained_chunk_like_a_known_token():
    placeheld, known = (
        Sequence("a", [1, 2, 3, 4], _params()),
        Sequence("b", [1, 2, 3, 4], _params()),
    )
    runs = []
    for seq in (placeheld, known):
        sched = _scheduler()
        _run_prefill(sched, seq)
        if seq is placeheld:
            seq.num_output_placeholders = 1
        else:
            seq.append_token(9)
        (chunk,) = sched.schedule().chunks
        runs.append((chunk.start, chunk.num_tokens, chunk.is_sampled, len(seq.block_table)))
        assert chunk.is_chained == (seq is placeheld)
    assert runs[0] == runs[1] == (4, 1, True, 2)  # position 4 needs a second block


def test_a_sequence_ending_at_its_placeholder_frees_its_seat_now():
    sched = _scheduler(max_num_seqs=2, max_model_len=100)
    ending = Sequence("end", [1, 2], _params(max_tokens=1))
    by_context = Sequence("ctx", list(range(99)), _params())
    for seq in (ending, by_context):
        _run_prefill(sched, seq)
        seq.num_output_placeholders = 1  # the first token is in flight
    waiting = Sequence("w", [5, 6, 7], _params())
    sched.add(waiting)
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["w"]  # no wasted slot; both seats reused
    assert len(sched.running) == 3


def test_a_preempted_sequence_waits_for_its_token_and_publishing_skips_placeholders():
    sched = _scheduler(prefix=True)
    seq = Sequence("a", list(range(8)), _params())
    _run_prefill(sched, seq)
    seq.num_output_placeholders = 1
    out = sched.schedule()
    sched.advance(out)  # the chained chunk computed position 8, whose token is not known yet
    assert seq.num_computed_tokens == 9 and seq.num_tokens == 8
    sched.cache_prefix(seq)  # keys only the 8 known tokens: two blocks
    assert sched.prefix_cache.match_prefix(list(range(8)) + [0], 8, False)[0] == seq.block_table[:2]
    sched._preempt(seq)
    assert sched.schedule().chunks == []  # its token is still in flight
    seq.num_output_placeholders = 0
    seq.append_token(3)
    (chunk,) = sched.schedule().chunks
    assert (chunk.seq, chunk.start, chunk.end) == (seq, 8, 9)  # recomputed from the cache hit
