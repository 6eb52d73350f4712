"""KV cache contracts against a brute-force full-history reference.

- WindowedKVCache returns exactly the trailing slice of the full history (arrays), its mask
  width equals its key count, capacity stays window + max(chunk, window) and shrinks back after
  a large chunk, and attention over it equals attention over the whole history;
- the paged pool views return every row's history through its block table (mixed lengths,
  padded chunks) and the batched windowed view matches per-row attention.
"""

import random

import pytest
import torch

from ops.attention import attention
from torch_runner.kv.block_manager import NO_BLOCK
from torch_runner.kv.caches import (
    PagedKVPool,
    PagedLayerView,
    PagedStepMeta,
    WindowedBatchView,
    WindowedKVCache,
)
from torch_runner.kv.windows import payload_source, restore_windows

H_KV, H_Q, D = 2, 4, 8


def _brute_attention(q, k, v, q_pos, k_pos, window):
    """float64 softmax attention over explicit positions; q [Hq, N, D], k/v [Hkv, S, D]."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(H_Q // H_KV, dim=0)
    v = v.repeat_interleave(H_Q // H_KV, dim=0)
    scores = q @ k.transpose(-1, -2) * D**-0.5  # [Hq, N, S]
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [Hq, N, D]


@pytest.mark.parametrize("window", [1, 4, 7])
def test_windowed_cache_equals_trailing_slice_of_full_history(window):
    rng = random.Random(window)
    torch.manual_seed(window)
    cache = WindowedKVCache(window)
    full_k = torch.empty(1, H_KV, 0, D)
    full_v = torch.empty(1, H_KV, 0, D)
    chunks = [rng.choice([1, 1, 1, 2, 3, window, 3 * window + 1]) for _ in range(60)]
    for s in chunks:
        k, v = torch.randn(1, H_KV, s, D), torch.randn(1, H_KV, s, D)
        before = cache.offset
        full_k, full_v = torch.cat([full_k, k], 2), torch.cat([full_v, v], 2)
        keys, values, layout = cache.update_and_fetch(k, v)
        first = int(layout.k_offsets[0])
        assert cache.offset == full_k.shape[2]  # absolute offset
        assert int(layout.kv_lens[0]) == keys.shape[2]  # mask width == returned key length
        assert first <= max(0, before - (window - 1))  # the first query still sees its window
        torch.testing.assert_close(keys, full_k[:, :, first:], rtol=0, atol=0)
        torch.testing.assert_close(values, full_v[:, :, first:], rtol=0, atol=0)
        assert cache.capacity <= window + max(s, window)
    # after a large chunk, the next decode shrinks the buffer back to 2 * window
    cache.update_and_fetch(torch.randn(1, H_KV, 5 * window, D), torch.randn(1, H_KV, 5 * window, D))
    assert cache.capacity == 6 * window
    cache.update_and_fetch(torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D))
    assert cache.capacity == 2 * window


def test_windowed_decode_appends_in_place_with_amortised_compaction():
    window = 16
    cache = WindowedKVCache(window)
    cache.update_and_fetch(torch.randn(1, H_KV, 3, D), torch.randn(1, H_KV, 3, D))
    reallocations, buffer = 0, cache.keys
    for _ in range(10 * window):
        cache.update_and_fetch(torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D))
        if cache.keys is not buffer:
            reallocations, buffer = reallocations + 1, cache.keys
    assert reallocations <= 10 * window // window + 1  # one compaction per `window` tokens


def test_windowed_attention_equals_full_history_attention():
    torch.manual_seed(0)
    window = 5
    cache = WindowedKVCache(window)
    full_k, full_v = torch.empty(1, H_KV, 0, D), torch.empty(1, H_KV, 0, D)
    for s in [7, 1, 1, 3, 12, 1, 1, 1, 2, 1]:
        q = torch.randn(1, H_Q, s, D)
        k, v = torch.randn(1, H_KV, s, D), torch.randn(1, H_KV, s, D)
        pos = torch.arange(cache.offset, cache.offset + s)
        full_k, full_v = torch.cat([full_k, k], 2), torch.cat([full_v, v], 2)
        keys, values, layout = cache.update_and_fetch(k, v)
        got = attention(q, keys, values, pos[None], layout, sm_scale=D**-0.5, window=window)
        want = _brute_attention(
            q[0], full_k[0], full_v[0], pos, torch.arange(full_k.shape[2]), window
        )
        torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, block_size", [(4, 4), (6, 4), (3, 4), (8, 2)])
def test_block_payloads_join_into_the_window_at_every_boundary(window, block_size):
    """Per-block payloads (kv/windows.py) taken from two layers' buffers, joined over the last
    ceil(window / block) blocks before a boundary, restore caches whose next keys are exactly
    the full history's window there (bit for bit), and none is claimed once the ring lost it."""
    torch.manual_seed(1)
    layers = [WindowedKVCache(window) for _ in range(2)]
    full = [(torch.randn(1, H_KV, 23, D), torch.randn(1, H_KV, 23, D)) for _ in layers]
    payloads = {}
    source = None
    for lo, hi in [(0, 9), (9, 10), (10, 11), (11, 17), (17, 18), (18, 22)]:  # chunks, decodes
        for cache, (k, v) in zip(layers, full):
            cache.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
        source = payload_source(layers, block_size)
        for i in range(hi // block_size):  # every completed block, while the ring holds it
            if i not in payloads:
                payloads[i] = source(i)
    count = min(block_size, window)
    for i, payload in payloads.items():
        if payload is None:
            continue
        end = (i + 1) * block_size
        for layer, (k, _) in enumerate(full):
            torch.testing.assert_close(
                payload[0][layer], k[0, :, end - count : end], rtol=0, atol=0
            )
    assert source(0) is None  # position 0..block is long out of the ring
    checked = 0
    for i in payloads:
        end = (i + 1) * block_size
        need = -(-min(window, end) // block_size)
        chain = [payloads.get(j) for j in range(i + 1 - need, i + 1)]
        if any(p is None for p in chain):
            continue
        restored = restore_windows(window, (end, chain))
        for cache, (k, v) in zip(restored, full):
            keys, _, layout = cache.update_and_fetch(k[:, :, end : end + 1], v[:, :, end : end + 1])
            torch.testing.assert_close(
                keys, k[:, :, end - min(window, end) : end + 1], rtol=0, atol=0
            )
            assert int(layout.k_offsets[0]) == end - min(window, end)
        checked += 1
    assert checked >= 22 // block_size - 1  # every boundary but the first few was restorable


def test_paged_view_returns_each_rows_history_and_matches_brute_attention():
    torch.manual_seed(2)
    bs, num_blocks = 4, 32
    pool = PagedKVPool(2, num_blocks, bs, H_KV, D, torch.float32, "cpu")
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    lengths = [(0, 9), (5, 1), (13, 3), (2, 1)]  # (cached, new) per row: mixed prefill + decode
    histories, tables = [], []
    for cached, new in lengths:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        hist_k, hist_v = torch.randn(H_KV, total, D), torch.randn(H_KV, total, D)
        for p in range(cached):  # pre-fill the cached part through the slot formula
            slot = table[p // bs] * bs + p % bs
            pool.k[1, slot], pool.v[1, slot] = hist_k[:, p], hist_v[:, p]
        histories.append((hist_k, hist_v))
        tables.append(table)
    n = max(new for _, new in lengths)
    k = torch.zeros(len(lengths), H_KV, n, D)
    v = torch.zeros(len(lengths), H_KV, n, D)
    q = torch.randn(len(lengths), H_Q, n, D)
    positions = torch.zeros(len(lengths), n, dtype=torch.int64)
    for i, ((cached, new), (hk, hv)) in enumerate(zip(lengths, histories)):
        k[i, :, :new], v[i, :, :new] = hk[:, cached:], hv[:, cached:]
        positions[i] = torch.arange(cached, cached + n)
    meta = PagedStepMeta(
        tables, [c for c, _ in lengths], [m for _, m in lengths], bs, "cpu", pool.pad_slot
    )
    keys, values, layout = PagedLayerView(pool, 1, meta).update_and_fetch(k, v)
    out = attention(q, keys, values, positions, layout, sm_scale=D**-0.5)
    for i, ((cached, new), (hk, hv)) in enumerate(zip(lengths, histories)):
        total = cached + new
        assert int(layout.kv_lens[i]) == total
        torch.testing.assert_close(keys[i, :, :total], hk, rtol=0, atol=0)
        torch.testing.assert_close(values[i, :, :total], hv, rtol=0, atol=0)
        want = _brute_attention(
            q[i, :, :new], hk, hv, positions[i, :new], torch.arange(total), None
        )
        torch.testing.assert_close(out[i, :, :new].double(), want, rtol=1e-5, atol=1e-5)
    assert keys[1, :, 6:].abs().sum() == 0  # padding reads the zero slot


def test_windowed_batch_view_matches_per_row_attention():
    torch.manual_seed(3)
    window = 3
    rows = [WindowedKVCache(window) for _ in range(3)]
    fulls = []
    for cache, s in zip(rows, [7, 2, 4]):
        hk, hv = torch.randn(1, H_KV, s, D), torch.randn(1, H_KV, s, D)
        cache.update_and_fetch(hk, hv)
        fulls.append((hk, hv))
    num_new = [1, 3, 2]
    n = max(num_new)
    k, v, q = torch.randn(3, H_KV, n, D), torch.randn(3, H_KV, n, D), torch.randn(3, H_Q, n, D)
    positions = torch.stack([torch.arange(c.offset, c.offset + n) for c in rows])
    layouts: dict = {}
    keys, values, layout = WindowedBatchView(rows, num_new, layouts).update_and_fetch(k, v)
    assert keys.shape[2] == int(layout.kv_lens.max())
    out = attention(q, keys, values, positions, layout, sm_scale=D**-0.5, window=window)
    for i, ((hk, hv), m) in enumerate(zip(fulls, num_new)):
        fk = torch.cat([hk[0], k[i, :, :m]], 1)
        fv = torch.cat([hv[0], v[i, :, :m]], 1)
        want = _brute_attention(
            q[i, :, :m], fk, fv, positions[i, :m], torch.arange(fk.shape[1]), window
        )
        torch.testing.assert_close(out[i, :, :m].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table", [[3, 4, 5], [5, 3, 4]])  # consecutive (view) / scattered (gather)
def test_single_row_fetch_is_the_history_whether_blocks_are_consecutive_or_not(table):
    torch.manual_seed(4)
    bs = 4
    pool = PagedKVPool(1, 8, bs, H_KV, D, torch.float32, "cpu")
    hist_k, hist_v = torch.randn(H_KV, 11, D), torch.randn(H_KV, 11, D)
    for start, count in [(0, 7), (7, 1), (8, 3)]:  # prefill chunk, then decode, then a chunk
        meta = PagedStepMeta([table], [start], [count], bs, "cpu", pool.pad_slot)
        assert (meta.first_slot is not None) == (table == [3, 4, 5])
        k = hist_k[None, :, start : start + count]
        v = hist_v[None, :, start : start + count]
        keys, values, layout = PagedLayerView(pool, 0, meta).update_and_fetch(k, v)
        end = start + count
        torch.testing.assert_close(keys[0], hist_k[:, :end], rtol=0, atol=0)
        torch.testing.assert_close(values[0], hist_v[:, :end], rtol=0, atol=0)
        assert int(layout.kv_lens[0]) == keys.shape[2] == end


def test_blocks_given_back_behind_the_window_read_the_zero_pad_slot():
    """A table [NO_BLOCK, 0, 1] (block 0 given back, then ids 0 and 1: "consecutive" from -1)
    is gathered, not sliced; the hole's keys are the pad slot's zeros (NaN-free), and windowed
    attention of queries that cannot see the hole equals the brute-force window over the true
    history."""
    torch.manual_seed(5)
    bs, window = 4, 4
    pool = PagedKVPool(1, 4, bs, H_KV, D, torch.float32, "cpu")
    pool.k.fill_(float("nan"))  # every slot but the pad slot: garbage that must not be read
    pool.v.fill_(float("nan"))
    pool.k[:, pool.pad_slot].zero_()
    pool.v[:, pool.pad_slot].zero_()
    table = [NO_BLOCK, 0, 1]
    hist_k, hist_v = torch.randn(H_KV, 11, D), torch.randn(H_KV, 11, D)
    pool.k[0, :4], pool.v[0, :4] = hist_k[:, 4:8].transpose(0, 1), hist_v[:, 4:8].transpose(0, 1)
    meta = PagedStepMeta([table], [8], [3], bs, "cpu", pool.pad_slot)  # positions 8..10
    assert meta.first_slot is None
    k, v = hist_k[None, :, 8:11], hist_v[None, :, 8:11]
    keys, values, layout = PagedLayerView(pool, 0, meta).update_and_fetch(k, v)
    assert torch.equal(keys[0, :, :4], torch.zeros(H_KV, 4, D))  # the hole
    torch.testing.assert_close(keys[0, :, 4:11], hist_k[:, 4:11], rtol=0, atol=0)
    q = torch.randn(1, H_Q, 3, D)
    positions = torch.arange(8, 11)[None]
    out = attention(q, keys, values, positions, layout, sm_scale=D**-0.5, window=window)
    want = _brute_attention(q[0], hist_k, hist_v, positions[0], torch.arange(11), window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-5)


def _brute_slots(tables, starts, num_new, bs, pad):
    """Every row's key slots (pad past its length or in a given-back block) and the new
    tokens' write slots, position by position."""
    lens = [s + m for s, m in zip(starts, num_new)]
    gather = [pad if p >= n or t[p // bs] < 0 else t[p // bs] * bs + p % bs
              for t, n in zip(tables, lens) for p in range(max(lens))]  # fmt: skip
    write = [t[p // bs] * bs + p % bs for t, s, m in zip(tables, starts, num_new)
             for p in range(s, s + m)]  # fmt: skip
    return gather, write


@pytest.mark.parametrize("seed", range(6))
def test_paged_step_meta_slots_on_host_and_device_equal_brute_force(seed):
    """The CPU build (numpy) and the device build (torch ops, run here on the CPU) of the slot
    tensors both equal the position-by-position slots: ragged rows, padded query tokens and
    blocks given back (NO_BLOCK) included."""
    rng, bs, pad = random.Random(seed), 4, 99
    b = rng.randint(1, 4)
    num_new = [rng.choice([1, 1, 3, 7]) for _ in range(b)]
    if seed % 2:
        num_new = [1] * b  # decode: dense, no write_rows
    starts = [rng.randint(0, 13) for _ in range(b)]
    tables = [rng.sample(range(40), -(-(s + m) // bs)) for s, m in zip(starts, num_new)]
    if seed >= 4 and starts[0] >= bs:
        tables[0][0] = NO_BLOCK
    want_gather, want_write = _brute_slots(tables, starts, num_new, bs, pad)
    meta = PagedStepMeta(tables, starts, num_new, bs, "cpu", pad)
    assert meta.gather_slots.tolist() == want_gather
    assert meta.write_slots.tolist() == want_write
    assert meta.kv_lens.tolist() == [s + m for s, m in zip(starts, num_new)]
    host = (meta.block_tables, meta.kv_lens, meta.gather_slots, meta.write_slots, meta.write_rows)
    width = max(map(len, tables))
    padded = [x for t in tables for x in t + [0] * (width - len(t))]
    rows = [i * max(num_new) + j for i, m in enumerate(num_new) for j in range(m)]
    meta._slots_on_device(padded, meta.kv_lens.tolist(), starts, rows, width, max(num_new), pad,
                          torch.device("cpu"))  # fmt: skip
    device = (meta.block_tables, meta.kv_lens, meta.gather_slots, meta.write_slots, meta.write_rows)
    for a, c in zip(host, device):
        assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_step_meta_builds_its_slots_without_a_host_sync():
    """An eager (prefill / mixed) step's slot tensors go to the GPU in one queued copy: torch's
    sync debug mode sees no blocking call (before: four pageable copies and a nonzero())."""
    tables, starts, num_new = [[3, 4, 5], [0], [7, 1]], [5, 0, 2], [6, 3, 1]
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = PagedStepMeta(tables, starts, num_new, 4, "cuda", 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = PagedStepMeta(tables, starts, num_new, 4, "cpu", 0)
    assert torch.equal(meta.write_slots.cpu(), cpu.write_slots)
    assert torch.equal(meta.gather_slots.cpu(), cpu.gather_slots)
    assert torch.equal(meta.write_rows.cpu(), cpu.write_rows)
