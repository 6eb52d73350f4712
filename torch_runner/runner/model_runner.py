"""The ModelRunner: the only component that touches the device.

Per step it turns the scheduler's chunks into tensors, runs the model and samples. Rows of very
different lengths are not padded into one rectangle (63 decodes beside a 448-token chunk would
compute 64 x 448 tokens): chunks are grouped by length (all decodes together, similar prefill
chunks together), each group is one `model.forward`, and the last hidden state of every row
that needs a token is gathered so `compute_logits` and the sampler run once per step, on those
rows only. Slot indices for the paged pool are built once per group and shared by every
full-attention layer; SWA layers use one WindowedKVCache per request and layer.
"""

from __future__ import annotations

import logging

import torch

import ops
from models.layers import pack_linear_weights
from models.native_weights import DTYPES as NATIVE_DTYPES
from models.native_weights import native_linear_weights, weights_on_huge_pages
from ops.cpu_native.build import wants_native
from ops.sampling.batch import SamplingBatch
from ops.sampling.sampler import SampleOutput, is_plain_greedy
from torch_runner.kv.caches import (
    CacheLayout,
    PagedKVPool,
    PagedLayerView,
    PagedStepMeta,
    WindowedBatchView,
    WindowedKVCache,
)
from torch_runner.kv.windows import payload_source, restore_windows
from torch_runner.runner.cpu_compiled import CompiledDecoder
from torch_runner.runner.cpu_decode import FlatDecoder, supports_fast_decode
from torch_runner.runner.cuda_graphs import DecodeGraphs
from torch_runner.runner.graph_head import GraphHead, is_graph_sampled
from torch_runner.runner.launched import (
    NON_FINITE_TOKEN,
    LaunchedStep,
    StepResult,
    placeholder,
    resolve_placeholders,
)
from torch_runner.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

__all__ = ["NON_FINITE_TOKEN", "LaunchedStep", "ModelRunner", "StepResult"]

PAD_WASTE = 1.3  # a group may compute at most this many padded tokens per real token


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of the device: CUDA mem_get_info, MPS recommended budget, else /proc/meminfo."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set max_total_tokens")


def group_chunks(chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
    """Forward groups: all decodes in one, prefill chunks grouped while padding <= PAD_WASTE."""
    groups: list[list[ScheduledChunk]] = []
    real = 0
    prefills = sorted((c for c in chunks if c.num_tokens > 1), key=lambda c: -c.num_tokens)
    for chunk in prefills:
        if groups:
            width = groups[-1][0].num_tokens
            if (len(groups[-1]) + 1) * width <= PAD_WASTE * (real + chunk.num_tokens):
                groups[-1].append(chunk)
                real += chunk.num_tokens
                continue
        groups.append([chunk])
        real = chunk.num_tokens
    decodes = [c for c in chunks if c.num_tokens == 1]
    if decodes:
        groups.append(decodes)
    return groups


def _has_quantized_linears(model) -> bool:
    """True when models/quantize.py replaced the linears (`--quantization`, or a quantized GGUF)."""
    lm_head = getattr(model, "lm_head", None)
    return bool(getattr(getattr(lm_head, "weight", None), "is_quantized", False)) or any(
        getattr(getattr(m, "qkv_weight", None), "is_quantized", False) for m in model.modules()
    )


class ModelRunner:
    """Owns the model, the paged pool and the per-request SWA caches."""

    def __init__(
        self,
        loaded,
        config,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids=(),
        tensor_parallel=None,
    ):
        self.model = loaded.model
        # a ShardPlan (torch_runner/distributed): this rank's KV heads, logits gathered over ranks
        self.tensor_parallel = tensor_parallel
        is_dense = device.type == "cpu" and not _has_quantized_linears(self.model)
        # AVX2 CPU: the native GEMV (ops/cpu_native; TORCH_RUNNER_CPU_KERNELS=torch: off)
        self.is_native = is_dense and wants_native(device) and dtype in NATIVE_DTYPES
        if self.is_native:
            native_linear_weights(self.model)
        self.is_packed = (  # quantized linears use their own kernels (ops/quant/int_linear.py)
            is_dense
            and not self.is_native
            and config.weight_packing == "auto"
            and ops.can_pack(dtype)
        )
        if self.is_packed:  # oneDNN-packed matmul weights (ops/linear.py): faster CPU decode
            pack_linear_weights(self.model)
        if device.type == "cpu":  # decode streams every weight: 2 MiB pages, fewer TLB misses
            huge = weights_on_huge_pages(self.model)
            logger.info("weights on huge pages: %.0f MiB", huge / 2**20)
        self.eos_token_ids = list(eos_token_ids)
        self.args = loaded.args
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.deterministic = config.enable_deterministic_inference
        self.vocab_size = self.args.vocab_size
        self.layout = CacheLayout(
            tuple(self.args.layer_types),
            self.args.sliding_window,
            page_windows=self.pages_windows(config, device),
        )
        self.full_layers = self.layout.full_layers
        self.swa_layers = self.layout.swa_layers
        self.pool = PagedKVPool(
            len(self.full_layers),
            num_blocks if self.full_layers else 1,
            self.block_size,
            self.args.num_key_value_heads
            if tensor_parallel is None
            else tensor_parallel.num_kv_heads,
            self.args.head_dim,
            dtype,
            device,
        )
        self._pool_index = {layer: i for i, layer in enumerate(self.full_layers)}
        self.swa_caches: dict[str, list[WindowedKVCache]] = {}
        # the unseeded rows' noise, eager and in graphs (registered with the graphs that draw)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.random_seed)
        # pure-decode groups replay a CUDA graph (None: eager; see cuda_graphs.py)
        # (both off under tensor parallel: the all-reduces are module hooks they would skip)
        self.decode_graphs = None
        if tensor_parallel is None:
            self.decode_graphs = DecodeGraphs.for_runner(
                self.model, self.layout, self.pool, config, device, self.generator
            )
        # CPU decode steps skip module dispatch (cpu_decode.py); the same ops and values
        self.fast_decode = None
        is_cpu = device.type == "cpu"
        if is_cpu and supports_fast_decode(self.model, self.args):
            reduce = None if tensor_parallel is None else tensor_parallel.group.all_reduce
            self.fast_decode = FlatDecoder(self.model, reduce)
        # batch-1 decode through the compiled step (cpu_compiled.py): traceable weights only
        self.compiled_decode = None
        if self.fast_decode is not None and config.cpu_compile == "on":
            if tensor_parallel is not None or self.is_packed:
                logger.warning(
                    "cpu_compile: packed weights or tensor parallel; the eager decode loop"
                )
            else:
                self.compiled_decode = CompiledDecoder(
                    self.model, self.pool, self.block_size, num_blocks
                )
        # decode steps whose sampling allows it sample inside the graph (False: always eager)
        self.graph_sampling = True
        # the last launched step's sampled tokens [M] (on the device) and each request's row:
        # what a chained chunk's placeholder input reads (launched.py)
        self._future: tuple[torch.Tensor, dict[str, int]] | None = None

    @staticmethod
    def pages_windows(config, device: torch.device) -> bool:
        """SWA layers in the pool (config.swa_kv; "auto": on CUDA, where graphs need it, and under
        tensor parallel, where workers keep no per-request state)."""
        if config.swa_kv == "auto":
            return torch.device(device).type == "cuda" or config.tensor_parallel_size > 1
        return config.swa_kv == "paged"

    @staticmethod
    def kv_bytes_per_token(args, dtype: torch.dtype, page_windows: bool = False) -> int:
        layout = CacheLayout(tuple(args.layer_types), args.sliding_window, page_windows)
        return PagedKVPool.bytes_per_token(
            len(layout.full_layers), args.num_key_value_heads, args.head_dim, dtype
        )

    # ---- SWA cache lifecycle ----------------------------------------------------------
    def free(self, request_id: str) -> None:
        self.swa_caches.pop(request_id, None)

    def snapshot_windows(self, request_id: str):
        """Prefix-cache payloads of this request: block index -> every SWA layer's keys/values
        of that block's tail (kv/windows.py), or None without SWA caches."""
        return payload_source(self.swa_caches.get(request_id), self.block_size)

    def _swa_caches_for(self, chunk: ScheduledChunk) -> list[WindowedKVCache]:
        rid = chunk.seq.request_id
        caches = self.swa_caches.get(rid)
        if chunk.restore_from is not None:
            assert chunk.restore_from[0] == chunk.start, "prefix payload does not end at the chunk"
            caches = restore_windows(self.layout.window, chunk.restore_from)
        elif caches is None or chunk.start == 0:
            caches = [WindowedKVCache(self.layout.window) for _ in self.swa_layers]
        if caches and caches[0].offset != chunk.start:
            raise RuntimeError(
                f"request {rid!r}: SWA cache at {caches[0].offset}, chunk starts at {chunk.start}"
            )
        self.swa_caches[rid] = caches
        return caches

    # ---- the step ---------------------------------------------------------------------
    def _forward_group(self, group: list[ScheduledChunk]) -> torch.Tensor:
        """Run one forward over `group`; returns hidden [B, N, H]."""
        is_chained = any(_is_chained(c) for c in group)
        future = self._future[0] if is_chained else None
        if self.decode_graphs is not None and self.decode_graphs.can_run(group):
            tokens = [self._input_tokens(c)[0] for c in group]
            return self.decode_graphs.forward(group, tokens, future)
        b, n = len(group), group[0].num_tokens
        ids = [0] * (b * n)
        pos = [0] * (b * n)
        for i, chunk in enumerate(group):
            tokens = self._input_tokens(chunk)
            ids[i * n : i * n + len(tokens)] = tokens
            pos[i * n : (i + 1) * n] = range(chunk.start, chunk.start + n)
        input_ids = self._to_device(ids).view(b, n)  # [B, N]
        if future is not None:
            input_ids = resolve_placeholders(input_ids, future)
        positions = self._to_device(pos).view(b, n)  # [B, N]
        num_new = [c.num_tokens for c in group]
        caches: list = [None] * len(self.args.layer_types)
        if self.full_layers:
            meta = PagedStepMeta(
                [c.seq.block_table for c in group],
                [c.start for c in group],
                num_new,
                self.block_size,
                self.device,
                self.pool.pad_slot,
            )
            for layer, index in self._pool_index.items():
                caches[layer] = PagedLayerView(self.pool, index, meta)
        if self.swa_layers:
            per_row = [self._swa_caches_for(c) for c in group]
            layouts: dict = {}
            for j, layer in enumerate(self.swa_layers):
                caches[layer] = WindowedBatchView([row[j] for row in per_row], num_new, layouts)
        if self.compiled_decode is not None and b == 1 and n == 1:
            return self.compiled_decode(input_ids, positions, group[0].seq.block_table)
        if self.fast_decode is not None and n == 1:
            return self.fast_decode(input_ids, positions, caches)
        return self.model(input_ids, positions, caches)

    def _input_tokens(self, chunk: ScheduledChunk) -> list[int]:
        """The chunk's input ids; a chained chunk's one input is a placeholder (launched.py)."""
        if not _is_chained(chunk):
            return chunk.seq.token_slice(chunk.start, chunk.end)
        rows = self._future[1] if self._future is not None else {}
        if chunk.seq.request_id not in rows:
            raise RuntimeError(
                f"request {chunk.seq.request_id!r}: chained at {chunk.start}, but the last "
                "launched step sampled no token for it"
            )
        return [placeholder(rows[chunk.seq.request_id])]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 [len(values)] on the device without blocking the host: `torch.tensor(list,
        device=cuda)` waits for the copy, and so for the forward queued before it."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward_logits(self, chunks) -> tuple[torch.Tensor, list] | None:
        """Forward every group; logits [M, V'] of the chunks that reach their end, or None.

        Under tensor parallel every rank runs this (same chunks, its shard) and the logits are
        gathered over the ranks; only rank 0 goes on to sample."""
        forward = self.forward_hidden(chunks)
        return None if forward is None else (self.logits(forward[0]), forward[1])

    def forward_hidden(self, chunks) -> tuple[torch.Tensor, list] | None:
        """Forward every group; the last hidden state [M, H] of each chunk that reaches its end
        (those chunks, in order), or None when none does."""
        hidden_rows, sampled = [], []
        for group in group_chunks(chunks):
            hidden = self._forward_group(group)  # [B, N, H]
            rows = [i for i, c in enumerate(group) if c.is_sampled]
            if rows and len(rows) == len(group) and hidden.shape[1] == 1:
                hidden_rows.append(hidden[:, 0])  # a decode group: every row, no index
                sampled.extend(group)
            elif rows:
                last = [group[i].num_tokens - 1 for i in rows]
                index = (self._to_device(rows), self._to_device(last))
                hidden_rows.append(hidden[index])  # [M, H]
                sampled.extend(group[i] for i in rows)
        if not sampled:
            return None
        return torch.cat(hidden_rows) if len(hidden_rows) > 1 else hidden_rows[0], sampled

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> logits [M, V'] (gathered over the tensor-parallel ranks)."""
        logits = self.model.compute_logits(hidden)
        if self.tensor_parallel is not None:  # vocab-parallel lm_head: [M, V/N] -> [M, V']
            logits = self.tensor_parallel.group.all_gather_last(logits)
        return logits

    def execute(self, chunks: list[ScheduledChunk], grammar_rows=None) -> StepResult:
        """Run the step's chunks and wait for its tokens (`launch(...).result()`)."""
        return self.launch(chunks, grammar_rows).result()

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], grammar_rows=None) -> LaunchedStep:
        """Queue the step's chunks on the device; sample one token for every chunk that reaches
        its end. Nothing here waits for the device: the tokens come back at `result()`.

        grammar_rows(sampled_chunks) -> list of additive [V] rows or None (structured output).
        """
        launched = self._launch_graph_step(chunks)
        if launched is not None:
            return launched
        forward = self.forward_hidden(chunks)
        if forward is None:
            return LaunchedStep([])
        hidden, sampled = forward
        # queued before the host work below, unless a CPU head may pick greedy tokens without it
        logits = None if self.device.type == "cpu" else self.logits(hidden)
        seqs = [c.seq for c in sampled]
        edit_rows = grammar_rows(sampled) if grammar_rows is not None else None
        batch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [_output_ids(c) for c in sampled],
            self.vocab_size,
            self.device,
            edit_rows=edit_rows,
            deterministic=self.deterministic,
            eos_token_ids=self.eos_token_ids,
        )
        out = None if logits is not None else self._pick_greedy(hidden, batch)
        if out is None:  # the logits and the sampler
            positions = self._to_device([c.end - 1 for c in sampled])
            logits = (self.logits(hidden) if logits is None else logits)[:, : self.vocab_size]
            out = ops.sample(logits, batch, positions, self.generator)
        # a row whose raw logits hold NaN/inf gets token -1 (the engine ends that request with
        # an error); folded into the one transfer of token ids below, so no extra sync. An fp32
        # row sum is NaN/inf iff some logit is (finite logits cannot reach 3e38 in total), and
        # costs a quarter of the argmax (isfinite().all() cost 6x the argmax: a [B, V] bool)
        is_finite = out.finite  # the native greedy pick's flags, else:
        if is_finite is None:
            is_finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))  # [B]
        token_ids = torch.where(is_finite, out.token_ids, NON_FINITE_TOKEN)
        # the next step's chained rows read the sampler's ids (always valid vocabulary ids)
        self._future = (out.token_ids, {s.request_id: i for i, s in enumerate(seqs)})
        return LaunchedStep(seqs, token_ids, out.logprobs, out.top_logprobs)

    def _pick_greedy(self, hidden: torch.Tensor, batch: SamplingBatch) -> SampleOutput | None:
        """The sampler's output for an all-greedy batch with nothing to edit, picked by the
        lm_head without computing every logit (models' `greedy_tokens`: the fp32 CPU head's
        screened pick, the same ids); None where it cannot (then logits and the sampler)."""
        pick = getattr(self.model, "greedy_tokens", None)  # a CausalLM's (models/layers.py)
        if pick is None or self.tensor_parallel is not None or not is_plain_greedy(batch):
            return None
        picked = pick(hidden, self.vocab_size)
        return None if picked is None else SampleOutput(picked[0], None, None, picked[1])

    def _launch_graph_step(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        """A pure-decode step whose sampling a graph can run (graph_head.py: no logprobs, logit
        edits, penalties or grammar): the decode graph also runs the lm_head and the sampler, so
        the step is one replay. None: not such a step (the eager sampler takes it)."""
        graphs = self.decode_graphs
        if graphs is None or not self.graph_sampling or not graphs.can_run(chunks):
            return None
        if not all(c.is_sampled and is_graph_sampled(c.seq.params) for c in chunks):
            return None
        seqs = [c.seq for c in chunks]
        batch = None
        head = GraphHead(self.vocab_size, "greedy")
        if not all(s.params.is_greedy for s in seqs):
            batch = SamplingBatch.build(
                [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                [_output_ids(c) for c in chunks], self.vocab_size, self.device,
                deterministic=self.deterministic, eos_token_ids=self.eos_token_ids,
            )  # fmt: skip
            head = GraphHead.for_batch(batch, self.vocab_size)
            if head is None:  # is_graph_sampled and for_batch disagree: the eager sampler
                return None
        tokens = [self._input_tokens(c)[0] for c in chunks]
        future = self._future[0] if any(_is_chained(c) for c in chunks) else None
        token_ids, picks = graphs.forward(chunks, tokens, future, head, batch)
        self._future = (picks, {s.request_id: i for i, s in enumerate(seqs)})
        return LaunchedStep(seqs, token_ids)


def _is_chained(chunk) -> bool:
    """ScheduledChunk.is_chained; a tensor-parallel worker's chunks (distributed/worker.py) are
    never chained (overlap is off under tensor parallel) and do not carry the flag."""
    return getattr(chunk, "is_chained", False)


def _output_ids(chunk: ScheduledChunk) -> list[int]:
    """The outputs the sampler sees. A chained row's last output is still on the device: only
    its count matters (min_tokens; rows that read output values are never chained), so a
    stand-in keeps the count right."""
    seq = chunk.seq
    if chunk.is_chained and seq.params.min_tokens:
        return [*seq.output_token_ids, NON_FINITE_TOKEN]
    return seq.output_token_ids
