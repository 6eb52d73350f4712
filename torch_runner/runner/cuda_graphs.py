"""CUDA-graph capture and replay of the decode forward.

Why: a decode step of a small model is launch-bound on a GPU (a profile at batch 32 showed 58 ms
of CPU launching 6.3 ms of GPU work). A CUDA graph replays every kernel of the forward with one
launch, but only for fixed shapes and fixed buffer addresses. So a pure-decode group runs a
*static-shape* forward instead of the eager one:

- the batch is padded to a bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 16 up to
  `cuda_graph_max_bs`); padded rows have kv_len 0, read only the pool's zero `pad_slot` and
  write their K/V to `scratch_slot`, which nothing reads;
- every row's block table is padded to a fixed width S / block_size (S a power of two >= the
  step's longest context, a multiple of the block size); attention reads the pool through it
  (ops/paged_attention.py: only keys below kv_len, and inside the window for SWA layers), so
  nothing in the graph depends on host values;
- all inputs live in one int64 buffer per graph, [B, 4 + S / block_size] =
  (token id, position, kv_len, write slot, block table...), filled by one host-to-device copy.

A step whose sampling allows it (no logprobs, logit edits or penalties; model_runner decides,
graph_head.py says which head) replays a graph that also runs the lm_head and the sampler: no
logits leave the graph and the step is one launch. Unseeded rows draw from the runner's
generator, registered with every graph that draws from it: a replay reads its current offset
and advances it (torch's graph-safe generator state), so no two replays share noise.

`static_decode` is that forward as a plain function: on CPU the tests run it eagerly and
compare it with the eager path; on CUDA `DecodeGraphs` captures it once per (batch bucket,
key bucket, head), on first use or ahead of serving (`warm_up`, runner/warmup.py), into one shared
memory pool. Every family is captured:
sliding-window layers are paged on CUDA (kv/caches.py `page_windows`), sinks are part of the
attention kernel and the MoE op routes with grouped GEMMs on the device (ops/moe.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from weakref import WeakKeyDictionary

import numpy as np
import torch

from models.layers import GatedMLP, Rotary
from ops.linear import linear_rope_kv
from ops.moe import is_capturable
from ops.paged_attention import impl_for as paged_impl_for
from torch_runner.kv.caches import PagedKVPool, decode_from_pool
from torch_runner.runner.graph_head import GraphHead, HeadInputs, run_head
from torch_runner.runner.launched import resolve_placeholders_

logger = logging.getLogger(__name__)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIN_KEYS = 64  # smallest key bucket: short contexts share one graph
HEADER = 4  # buffer columns before the block table: id, position, kv_len, write slot


def batch_buckets(max_bs: int) -> tuple[int, ...]:
    """Padded batch sizes with a graph: BATCH_BUCKETS, then steps of 16, ending at max_bs."""
    sizes = [b for b in BATCH_BUCKETS if b < max_bs]
    while sizes and sizes[-1] + 16 < max_bs and sizes[-1] >= BATCH_BUCKETS[-1]:
        sizes.append(sizes[-1] + 16)
    return (*sizes, max_bs)


def key_bucket(num_keys: int, block_size: int, min_keys: int = MIN_KEYS) -> int:
    """Gathered key width for a longest context of `num_keys`: a power of two (>= min_keys),
    rounded up to a multiple of the block size so it covers whole block-table columns."""
    width = max(min_keys, 1 << (num_keys - 1).bit_length())
    return -(-width // block_size) * block_size


class StaticPagedView:
    """A pool layer's cache in the static decode: write one token, attend through the table."""

    __slots__ = ("pool", "layer", "write_slots", "tables", "kv_lens")

    def __init__(self, pool: PagedKVPool, layer: int, write_slots, tables, kv_lens):
        self.pool, self.layer = pool, layer
        self.write_slots, self.tables, self.kv_lens = write_slots, tables, kv_lens  # fmt: skip

    def attend(self, q, k, v, positions, *, sm_scale: float, sinks=None, window=None):
        return decode_from_pool(self.pool, self.layer, self.write_slots, self.tables,
                                self.kv_lens, q, k, v, sm_scale, sinks, window)  # fmt: skip

    def project_attend(self, x, weight, bias, cos, signed_sin, num_q_heads: int, *,
                       sm_scale: float, sinks=None, window=None):  # fmt: skip
        """x [B, hidden] through the [q | k | v] projection, q and k rotated by the rope rows
        [B, D_rot], k and v written to the pool (ops.linear_rope_kv: on CUDA one or two
        kernels), attend -> [B, Hq, D]."""
        k_pool, v_pool = self.pool.k_layers[self.layer], self.pool.v_layers[self.layer]
        q = linear_rope_kv(x, weight, bias, cos, signed_sin, k_pool, v_pool, self.write_slots,
                           num_q_heads)  # fmt: skip
        return paged_impl_for(q.device)(q, k_pool, v_pool, self.tables, self.kv_lens,
                                        block_size=self.pool.block_size, sm_scale=sm_scale,
                                        sinks=sinks, window=window)  # fmt: skip


def static_decode(model, pool: PagedKVPool, full_layers, num_layers: int, inputs, num_keys: int):
    """One decode token per row from the int64 buffer `inputs` [B, 4 + S / block_size]; every
    shape depends only on (B, S) and no host value is read. Returns hidden [B, 1, H]."""
    input_ids, positions = inputs[:, 0:1], inputs[:, 1:2]  # [B, 1]
    kv_lens, write_slots, tables = inputs[:, 2], inputs[:, 3], inputs[:, HEADER:]
    caches: list = [None] * num_layers
    for index, layer in enumerate(full_layers):
        caches[layer] = StaticPagedView(pool, index, write_slots, tables, kv_lens)
    rotaries = _rotaries.get(model)
    if rotaries is None:
        rotaries = _rotaries[model] = [m for m in model.modules() if isinstance(m, Rotary)]
    for rotary in rotaries:  # every position is below num_keys: gather the rope rows
        rotary.covering = num_keys
    try:
        return model(input_ids, positions, caches)
    finally:
        for rotary in rotaries:
            rotary.covering = 0


_rotaries: WeakKeyDictionary = WeakKeyDictionary()  # model -> its Rotary modules


def static_head(model, pool, full_layers, num_layers: int, inputs, num_keys: int,
                head: GraphHead, head_inputs: HeadInputs | None, generator=None):  # fmt: skip
    """`static_decode`, then the lm_head and the sampler of `head` (graph_head.py): returns
    (token ids, picks) [B]. `generator`: the unseeded rows' noise."""
    hidden = static_decode(model, pool, full_layers, num_layers, inputs, num_keys)
    return run_head(model, hidden, head, inputs[:, 1], head_inputs, generator)


def fill_inputs(group, block_size: int, num_rows: int, num_keys: int, scratch_slot: int,
                tokens=None):  # fmt: skip
    """Host int64 [num_rows, 4 + S / block_size] for a decode group; rows past the group are
    padding (kv_len 0, writes to the scratch slot). `tokens`: each row's input id (default:
    the sequence's token at `start`; a placeholder id for a chained row, launched.py)."""
    cols = num_keys // block_size
    flat: list[int] = []  # row-major; numpy reads a flat list faster than nested rows
    extend, zeros = flat.extend, [0] * cols
    for i, chunk in enumerate(group):
        pos, seq = chunk.start, chunk.seq
        table = seq.block_table
        if len(table) > cols:
            table = table[:cols]
        slot = table[pos // block_size] * block_size + pos % block_size
        token = seq.token_slice(pos, pos + 1)[0] if tokens is None else tokens[i]
        extend((token, pos, pos + 1, slot))
        extend(table)
        extend(zeros[len(table) :])
    flat.extend([0, 0, 0, scratch_slot, *zeros] * (num_rows - len(group)))
    return torch.from_numpy(np.array(flat, dtype=np.int64).reshape(num_rows, 4 + cols))


def supports_graphs(model, layout, device) -> bool:
    """Capturable: every layer's KV in the pool (SWA layers too: `layout.page_windows`) and
    every MLP either gated or an MoE whose op has no host sync on this device."""
    if layout.swa_layers:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return False
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    moe_ok = is_capturable(device)
    return all(isinstance(m, GatedMLP) or (moe_ok and hasattr(m, "experts")) for m in mlps)


class DecodeGraphs:
    """Static-shape decode for pure-decode groups; CUDA graphs per bucket when `capture`."""

    def __init__(self, model, pool: PagedKVPool, full_layers, num_layers: int, device,
                 max_bs: int, *, capture: bool = True, min_keys: int = MIN_KEYS,
                 generator: torch.Generator | None = None):  # fmt: skip
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.generator = generator  # unseeded rows' noise (None: the device's default)
        self.full_layers, self.num_layers = tuple(full_layers), num_layers
        self.buckets = batch_buckets(max_bs)
        self.max_bs, self.capture, self.min_keys = max_bs, capture, min_keys
        # (B, S, head) -> (graph, inputs, head inputs, hidden or (token ids, picks))
        self.graphs: dict[tuple, tuple] = {}
        self.mempool = None
        self.head_steps: Counter = Counter()  # head (None: eager sampling) -> steps run

    @classmethod
    def for_runner(cls, model, layout, pool, config, device, generator=None) -> DecodeGraphs | None:
        """Graphs on CUDA unless `enforce_eager` or the model cannot be captured."""
        if torch.device(device).type != "cuda" or config.enforce_eager:
            return None
        if not supports_graphs(model, layout, device):
            logger.info("CUDA graphs off: windowed SWA caches (swa_kv='windowed') or an MoE op "
                        "with host syncs run eagerly")  # fmt: skip
            return None
        num_layers = len(layout.layer_types)
        return cls(model, pool, layout.full_layers, num_layers, device, config.cuda_graph_max_bs,
                   generator=generator)  # fmt: skip

    def can_run(self, group) -> bool:
        return len(group) <= self.max_bs and all(c.num_tokens == 1 for c in group)

    def forward(self, group, tokens=None, future=None, head: GraphHead | None = None,
                batch=None):  # fmt: skip
        """Hidden [len(group), 1, H] of a decode group, through the bucket's graph. `tokens`
        and `future`: input ids with placeholders and the tensor they index (launched.py).
        `head` (and the step's SamplingBatch `batch` unless greedy): the graph also samples
        and returns (token ids, picks) [len(group)] instead (graph_head.py)."""
        b = len(group)
        self.head_steps[head] += 1
        rows = next(x for x in self.buckets if x >= b)
        num_keys = key_bucket(max(c.start for c in group) + 1, self.pool.block_size, self.min_keys)
        host = fill_inputs(group, self.pool.block_size, rows, num_keys, self.pool.scratch_slot,
                           tokens)  # fmt: skip
        if self.device.type == "cuda":  # pageable memory would make the copy wait for the GPU
            host = host.pin_memory()
        if not self.capture:
            inputs = host.to(self.device, non_blocking=True)
            if future is not None:
                resolve_placeholders_(inputs[:, 0], future)
            head_inputs = self._head_inputs(head, rows, batch)
            return _rows(self._run(inputs, num_keys, head, head_inputs), b)
        key = (rows, num_keys, head)
        graph, inputs, head_inputs, out = self.graphs.get(key) or self._capture(*key)
        inputs.copy_(host, non_blocking=True)
        if future is not None:  # chained rows: their input token is on the device already
            resolve_placeholders_(inputs[:, 0], future)
        if head_inputs is not None:
            head_inputs.load(batch)
        graph.replay()
        return _rows(out, b)  # views of graph memory: the caller reads them before the next replay

    def key_buckets(self, max_keys: int) -> list[int]:
        """Every key bucket a context of up to `max_keys` tokens maps to, smallest first."""
        block = self.pool.block_size
        top = key_bucket(max(max_keys, 1), block, self.min_keys)
        found, width = [], self.min_keys
        while (bucket := key_bucket(width, block, self.min_keys)) <= top:
            found.append(bucket)
            width = bucket * 2
        return found

    def warm_up(self, max_keys: int, heads) -> int:
        """Capture every (batch bucket, key bucket up to `max_keys`, head) graph not captured
        yet, so no served step pays a capture (tens of ms: a stall in every stream). Returns
        how many it captured; none when graphs are off (`capture` False)."""
        if not self.capture:
            return 0
        todo = [(rows, keys, head) for head in heads for keys in self.key_buckets(max_keys)
                for rows in self.buckets if (rows, keys, head) not in self.graphs]  # fmt: skip
        for key in todo:
            self._capture(*key)
        return len(todo)

    def _head_inputs(self, head: GraphHead | None, rows: int, batch=None) -> HeadInputs | None:
        if head is None or head.kind == "greedy":
            return None
        head_inputs = HeadInputs(head, rows, self.device)
        if batch is not None:
            head_inputs.load(batch)
        return head_inputs

    def _run(self, inputs, num_keys: int, head: GraphHead | None, head_inputs):
        args = (self.model, self.pool, self.full_layers, self.num_layers, inputs, num_keys)
        if head is None:
            return static_decode(*args)
        return static_head(*args, head, head_inputs, self.generator)

    def _capture(self, rows: int, num_keys: int, head: GraphHead | None):
        t0 = time.perf_counter()
        inputs = torch.zeros((rows, HEADER + num_keys // self.pool.block_size),
                             dtype=torch.int64, device=self.device)  # fmt: skip
        inputs[:, 3] = self.pool.scratch_slot  # all rows padding: warm-up writes nothing real
        head_inputs = self._head_inputs(head, rows)
        generator = None  # the one the head draws from, if it draws
        if head is not None and head.draws_noise:
            generator = self.generator
            if generator is None:
                generator = torch.cuda.default_generators[self.device.index or 0]
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(lambda: self._run(inputs, num_keys, head, head_inputs),
                                   self.device, self.mempool, generator)  # fmt: skip
        key = (rows, num_keys, head)
        self.graphs[key] = (graph, inputs, head_inputs, out)
        logger.debug("captured decode graph B=%d S=%d head=%s in %.1f ms (%d graphs)", rows,
                    num_keys, head, (time.perf_counter() - t0) * 1e3, len(self.graphs))  # fmt: skip
        return self.graphs[key]


def capture_graph(run, device, pool, generator: torch.Generator | None = None):
    """(graph, out) of `run()` captured on `device` into memory pool `pool`, after one warm-up
    run on a side stream (lazy inits, allocator). `generator`: the one `run` draws noise from;
    registered with the graph, so every replay reads its current offset and advances it by
    the graph's draws (no two replays share noise); the warm-up's draws are undone, so a
    capture does not shift later steps' noise."""
    state = None if generator is None else generator.get_state()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    if state is not None:
        generator.set_state(state)  # the warm-up's kernels took seed and offset by value
    graph = torch.cuda.CUDAGraph()
    if generator is not None:  # before capture_begin: torch sets up its per-capture state
        with torch.cuda.device(device):
            graph.register_generator_state(generator)
    # thread_local: the server steps on a background thread; other threads' CUDA calls
    # during a capture must not invalidate it
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    torch.cuda.synchronize(device)
    return graph, out


def _rows(out, b: int):
    """The first b rows of a static forward's output (a tensor or a tuple of tensors)."""
    return out[:b] if isinstance(out, torch.Tensor) else tuple(t[:b] for t in out)
