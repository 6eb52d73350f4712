"""Start-up warm-up of the eager CUDA shapes, so no served step meets a matmul shape first.

cuBLAS picks an algorithm per (M, N, K) the first time it sees it; ops/linear.py rounds eager
row counts above MIN_PADDED_ROWS up to EAGER_ROW_BUCKET so prompts of any length map to a few
shapes, but each of those still paid its choice once, inside some request's time to first token
(an H200, Llama-3.2-1B: the first 301-token prompt after warm-up 1.68-1.81x a repeat,
tools/bench_cuda_decode.py --new-lengths). Here every bucket up to the step's token budget runs
once before serving: one eager forward per prefill row count, then the lm_head at every row
count a step can sample. The forwards write keys and values into the pool's first blocks, which
no request holds yet (a request writes every slot before it reads it); the pad slot stays zero.

Then the decode graphs (cuda_graphs.py) are captured for every batch bucket and key bucket up to
EngineConfig.cuda_graph_warmup_keys, with the heads most requests take (greedy, temperature-only
unseeded, and the eager sampler's logits graph): captured lazily, each first use of a (batch, context) bucket
stalled every stream for a capture (an H200 serving a 1B model at 16 streams: TTFT p99 938 ms
against 85 ms at p50, tools/bench_serving.py, 2026-12-03).
"""

from __future__ import annotations

import logging
import time

import torch

from ops.linear import EAGER_ROW_BUCKET, MIN_PADDED_ROWS
from ops.sampling.batch import SamplingBatch
from torch_runner.runner.graph_head import GraphHead, is_graph_sampled
from torch_runner.scheduler import ScheduledChunk
from torch_runner.sequence import Sequence

logger = logging.getLogger(__name__)

NO_CHUNKING_LIMIT = 2048  # chunking off: prompts are prefilled whole; warm this many rows


def row_buckets(limit: int) -> list[int]:
    """The eager row counts ops.linear produces for 1..limit rows: 1..MIN_PADDED_ROWS as they
    are, then multiples of EAGER_ROW_BUCKET up to the one that holds `limit`."""
    small = list(range(1, min(limit, MIN_PADDED_ROWS) + 1))
    if limit <= MIN_PADDED_ROWS:
        return small
    top = -(-limit // EAGER_ROW_BUCKET) * EAGER_ROW_BUCKET
    return small + list(range(EAGER_ROW_BUCKET, top + 1, EAGER_ROW_BUCKET))


def prefill_lengths(limit: int) -> list[int]:
    """One prompt length per eager row count (each bucket's largest length, capped at `limit`):
    a forward over it runs every eager linear at that M. The short ones are chunk tails (a
    517-token prompt is 512 + 5: 1.22x a repeat on an H200 until 1..16 were warmed too)."""
    return [min(m, limit) for m in row_buckets(limit) if m > 1]


@torch.inference_mode()
def warm_up_eager_shapes(runner, token_budget: int, max_rows: int) -> int:
    """Run the prefill and lm_head shapes once; returns the number of forwards run.

    token_budget: the most tokens a step prefills (chunked_prefill_size, or NO_CHUNKING_LIMIT);
    max_rows: the most rows a step samples (max_num_seqs)."""
    t0 = time.perf_counter()
    block_size = runner.block_size
    num_blocks = runner.pool.pad_slot // block_size  # the pool's real blocks
    lengths = [n for n in prefill_lengths(token_budget) if -(-n // block_size) <= num_blocks]
    for n in lengths:
        seq = Sequence(f"__warmup_{n}", [0] * n)
        seq.block_table = list(range(-(-n // block_size)))  # free blocks: nobody holds them
        try:
            runner.forward_logits([ScheduledChunk(seq, 0, n)])
        finally:
            runner.free(seq.request_id)
    hidden = runner.args.hidden_size
    dtype = next(runner.model.parameters()).dtype
    for m in row_buckets(max_rows):
        runner.model.compute_logits(torch.zeros((m, hidden), dtype=dtype, device=runner.device))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("warmed %d prefill and %d lm_head shapes in %.0f ms", len(lengths),
                len(row_buckets(max_rows)), (time.perf_counter() - t0) * 1e3)  # fmt: skip
    return len(lengths) + len(row_buckets(max_rows))


def graph_head_for(runner, params) -> GraphHead | None:
    """The head a decode graph samples a batch of requests with `params` by (None: the eager
    sampler, or graphs do not sample), as model_runner picks it; the same for any batch size."""
    if runner.decode_graphs is None or not runner.graph_sampling or not is_graph_sampled(params):
        return None
    if params.is_greedy:
        return GraphHead(runner.vocab_size, "greedy")
    batch = SamplingBatch.build([params], [[0]], [[]], runner.vocab_size, runner.device,
                                deterministic=runner.deterministic,
                                eos_token_ids=runner.eos_token_ids)  # fmt: skip
    return GraphHead.for_batch(batch, runner.vocab_size)


def warm_up_graphs(runner, max_keys: int, heads=None) -> int:
    """Capture the decode graphs of contexts up to `max_keys` tokens for every batch bucket and
    `heads` (default: the common ones, module docstring); returns how many were captured (0:
    graphs off, or all captured already)."""
    graphs = runner.decode_graphs
    if graphs is None:
        return 0
    t0 = time.perf_counter()
    if heads is None:
        heads = [None]  # the eager sampler's graph: logits out (logprobs, penalties, grammar)
        if runner.graph_sampling:
            vocab = runner.vocab_size
            heads += [GraphHead(vocab, "greedy"), GraphHead(vocab, "plain", seeding="unseeded")]
    count = graphs.warm_up(max_keys, heads)
    logger.info("captured %d decode graphs (batch <= %d, contexts <= %d, %d heads) in %.0f ms",
                count, graphs.max_bs, max_keys, len(heads), (time.perf_counter() - t0) * 1e3)  # fmt: skip
    return count
