"""The offline engine: load once, then schedule -> run -> postprocess, one step at a time.

`Engine.generate` and `Engine.stream` are the offline API; `AsyncEngine` (async_engine.py)
drives the same `add_request` / `step` / `abort` from a background thread for the server.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from bridge import resolve_device, use_mlx, validate_device
from models import ModelLoadError, load_model
from models.hub import resolve_model
from ops.sampling.params import SamplingParams
from torch_runner.config import EngineConfig
from torch_runner.distributed.group import LOAD_TIMEOUT
from torch_runner.distributed.launch import start_tensor_parallel
from torch_runner.engine_step import NON_FINITE_MESSAGE, EngineSteps
from torch_runner.kv.block_manager import BlockManager
from torch_runner.kv.radix_cache import RadixCache
from torch_runner.kv.windows import free_behind_window, payload_cap
from torch_runner.outputs import RequestOutput
from torch_runner.request_state import RequestState
from torch_runner.runner.model_runner import ModelRunner, available_memory_bytes
from torch_runner.runner.warmup import (
    NO_CHUNKING_LIMIT,
    graph_head_for,
    warm_up_eager_shapes,
    warm_up_graphs,
)
from torch_runner.scheduler import Scheduler
from torch_runner.sequence import Sequence

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def _load_tokenizer(auto_tokenizer, path: str):
    """The tokenizer, or one ModelLoadError naming the folder (not a tokenizers traceback)."""
    try:
        return auto_tokenizer.from_pretrained(path)
    except Exception as exc:  # tokenizers/transformers raise many types for a damaged file
        raise ModelLoadError(
            f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})"
        ) from exc


__all__ = ["NON_FINITE_MESSAGE", "Engine"]


class Engine(EngineSteps):
    """Continuous-batching generation over one model (see docs/engine.md); `step` and the
    overlapped scheduling live in engine_step.py."""

    def __init__(
        self, model: str | None = None, device: str = "auto", dtype: str = "auto", **kwargs: Any
    ):
        self._start(EngineConfig(model=model, device=device, dtype=dtype, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        # the MLX gate, before the model path is resolved or a weight read (as `serve` does):
        # a broken MLX install or an MLX-incompatible device fails here, in one line
        if use_mlx():
            validate_device(resolve_device(config.device))
        path = config.model
        if path is None:
            from models.default_model import default_model_source

            path = str(default_model_source(config.dtype, config.quantization))
        else:  # a Hub model ID becomes its cached snapshot folder; local paths are checked
            path = str(
                resolve_model(
                    path, revision=config.revision, load_format=config.load_format, flag="model"
                )
            )
        self.config = config
        # tensor parallel: None at size 1; else this process is rank 0 (ranks > 0 under torchrun
        # never return from here: they serve steps until rank 0 stops, distributed/launch.py)
        self.tensor_parallel = start_tensor_parallel(config, path)
        try:
            self._load(config, path)
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.close()
            raise

    def _load(self, config: EngineConfig, path: str) -> None:
        from transformers import AutoTokenizer

        tp = self.tensor_parallel
        loaded = load_model(
            path,
            device=config.device,
            dtype=config.dtype,
            load_format=config.load_format,
            moe_weights=config.moe_weights,
            quantization=config.quantization,
            shard=tp and tp.plan,
        )
        self.model_path = str(loaded.path)
        self.args = loaded.args
        self.device = next(loaded.model.parameters()).device
        self.dtype = next(loaded.model.parameters()).dtype
        self.vocab_size = self.args.vocab_size
        self.tokenizer = _load_tokenizer(AutoTokenizer, config.tokenizer or self.model_path)
        self.max_model_len = config.max_model_len or self.args.max_position_embeddings
        eos = set(loaded.eos_token_ids)
        hf_eos = getattr(loaded.hf_config, "eos_token_id", None)
        eos.update(hf_eos if isinstance(hf_eos, list) else [] if hf_eos is None else [hf_eos])
        self.eos_token_ids = eos
        num_blocks = self._num_blocks(config)
        if num_blocks * config.block_size < self.max_model_len:
            # a lone request must always fit, or preemption could never make room for it
            logger.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capping it",
                self.max_model_len,
                num_blocks * config.block_size,
            )
            self.max_model_len = num_blocks * config.block_size
        if tp is not None:
            # the workers build the same pool (their heads' KV) once their shards are loaded
            tp.group.send(num_blocks, timeout=LOAD_TIMEOUT)
        self.runner = ModelRunner(loaded, config, num_blocks, self.device, self.dtype, sorted(eos),
                                  tensor_parallel=tp and tp.plan)  # fmt: skip
        if self.device.type == "cuda" and config.eager_warmup == "auto" and tp is None:
            budget = config.chunked_prefill_size or NO_CHUNKING_LIMIT
            warm_up_eager_shapes(self.runner, min(budget, self.max_model_len), config.max_num_seqs)
            if self._graph_warmup_keys():
                warm_up_graphs(self.runner, self._graph_warmup_keys())
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # a match must find the window before its end held: in payloads (windowed SWA caches)
        # or in blocks (paged, with the blocks behind the window given back); kv/radix_cache.py
        layout = self.runner.layout
        window = layout.window if layout.has_swa or layout.frees_behind_window else None
        self.prefix_cache = (
            RadixCache(
                self.block_manager,
                payload_cap(config.max_cached_windows, window, config.block_size),
                window,
            )
            if config.enable_prefix_caching
            else None
        )
        budget = (
            config.chunked_prefill_size
            if config.is_chunked_prefill
            else max(self.max_model_len, 8192)
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            token_budget=budget,
            is_chunked_prefill=config.is_chunked_prefill,
            prefix_cache=self.prefix_cache,
            need_payload=self.runner.layout.has_swa,
            max_model_len=self.max_model_len,
        )
        # overlapped scheduling (engine_step.py): "auto" = on CUDA, off elsewhere and under
        # tensor parallel (the workers get each step's token ids from rank 0's host)
        self.is_overlapped = config.async_scheduling is True or (
            config.async_scheduling is None and self.device.type == "cuda" and tp is None
        )
        self._inflight = None
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._grammar_masker = None
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_non_finite = 0

    def _num_blocks(self, config: EngineConfig) -> int:
        bs = config.block_size
        most = config.max_num_seqs * self.max_model_len
        paged = ModelRunner.pages_windows(config, self.device)
        per_token = ModelRunner.kv_bytes_per_token(self.args, self.dtype, paged)
        if config.max_total_tokens is not None:
            tokens = config.max_total_tokens
        elif per_token == 0:
            tokens = most  # SWA-only model: the pool holds no KV, only prefix bookkeeping
        else:
            free = available_memory_bytes(self.device)
            tokens = min(most, int(free * config.mem_fraction) // per_token)
        num_blocks = max(1, tokens // bs)
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token over %d pool layers)",
            num_blocks,
            bs,
            num_blocks * bs,
            num_blocks * bs * per_token / 2**20,
            per_token,
            len(self.args.layer_types)
            if paged
            else sum(t != "sliding_attention" for t in self.args.layer_types),
        )
        return num_blocks

    # ---- requests ---------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids; got {type(prompt).__name__}"
        )

    def warm_up_sampling(self, params: SamplingParams) -> int:
        """Capture ahead, like start-up does for greedy and temperature-only requests, the decode
        graphs that sample requests with `params` (the server's defaults: a model's
        generation_config usually sets top_p / top_k), so its first requests do not stall on
        captures. Call before stepping starts; returns how many graphs it captured."""
        head = graph_head_for(self.runner, params) if self._graph_warmup_keys() else None
        return 0 if head is None else warm_up_graphs(self.runner, self._graph_warmup_keys(), [head])

    def _graph_warmup_keys(self) -> int:
        """Contexts up to this many tokens get their decode graphs at start-up (0: none)."""
        if self.config.eager_warmup != "auto":
            return 0
        return min(self.config.cuda_graph_warmup_keys, self.max_model_len)

    def add_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None
    ) -> str:
        """Queue one request (n must be 1 here; `generate` fans n out). Returns its id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: add_request takes one sequence; use generate() or fan out per choice"
            )
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty; expected at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is out of range; allowed: 0..{self.vocab_size - 1}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        grammar = self._new_grammar(params)
        seq = Sequence(request_id, ids, params)
        self.scheduler.add(seq)
        self.requests[request_id] = RequestState(
            seq, self.tokenizer, self.eos_token_ids, self.max_model_len, grammar
        )
        self.num_prompt_tokens += len(ids)
        return request_id

    def _new_grammar(self, params: SamplingParams):
        if params.structured is None:
            return None
        from torch_runner.grammar.compiler import compiler_for

        spec = params.structured
        return compiler_for(self.tokenizer, self.vocab_size).new_request_grammar(
            spec.kind, spec.spec, stop_token_ids=self.eos_token_ids
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        self.runner.free(request_id)
        return state.make_output()

    def _publish_prefixes(self, chunks) -> None:
        """Chunks that complete a block publish their blocks, so concurrent and later requests
        hit at any block boundary. Windowed SWA models publish decode blocks too, with their
        window payloads, while the ring still holds them (kv/windows.py); pool-only models
        publish prompt chunks (the finish publishes the rest: the pool still holds it)."""
        if self.prefix_cache is None:
            return
        bs, has_windows = self.config.block_size, self.runner.layout.has_swa
        for chunk in chunks:
            if not has_windows and chunk.start >= len(chunk.seq.prompt_token_ids):
                continue  # a decode chunk of a pool-only model (the common case, cheaply)
            # a chained chunk's input token is still on the device (overlapped scheduling): the
            # block it completes is published with the next chunk, when that token is known
            lag = 1 if chunk.is_chained else 0
            if (chunk.end - lag) // bs > (chunk.start - lag) // bs and (
                has_windows or chunk.start < chunk.seq.num_prompt_tokens
            ):
                self.scheduler.cache_prefix(chunk.seq, self._payload(chunk.seq))

    def _free_behind_window(self, chunks) -> None:
        """Paged models whose every layer is windowed give back the blocks no query can read
        again (after publishing them: the prefix cache keeps what it cached; kv/windows.py)."""
        layout = self.runner.layout
        if layout.frees_behind_window:
            for chunk in chunks:
                seq = chunk.seq
                free_behind_window(self.block_manager, seq.block_table, seq.num_computed_tokens,
                                   layout.window)  # fmt: skip

    def _payload(self, seq: Sequence):
        """The prefix cache's per-block window payloads of `seq` (None: no windowed layers)."""
        if not self.runner.layout.has_swa or self.prefix_cache is None:
            return None
        return self.runner.snapshot_windows(seq.request_id)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at size 1); idempotent."""
        if getattr(self, "tensor_parallel", None) is not None:
            self.tensor_parallel.close()

    # ---- offline API ------------------------------------------------------------------
    def _fan_out(self, prompts, params) -> list[tuple[Prompt, SamplingParams]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError(
                "prompts must be a string, a list of token ids, or a non-empty list of those"
            )
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        jobs = []
        for prompt, p in zip(prompts, params):
            for j in range(p.n):
                seed = p.seed if p.seed is None or p.n == 1 else (p.seed + j) % 2**64
                jobs.append((prompt, replace(p, n=1, seed=seed)))
        return jobs

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt (n per prompt when n > 1), in order."""
        rids = [self.add_request(None, prompt, p) for prompt, p in self._fan_out(prompts, params)]
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(rids):
                for output in self.step():
                    if output.finished:
                        final[output.request_id] = output
        finally:
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
        return [final[rid] for rid in rids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield increments of one request until it finishes."""
        rid = self.add_request(None, prompt, params)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id == rid:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.abort(rid)

    # ---- introspection ----------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def kv_cached_tokens(self) -> int:
        """KV tokens held only by the prefix cache (evictable on demand); O(1)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.num_evictable_blocks() * self.config.block_size

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        bs = self.config.block_size
        cache = self.prefix_cache
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_used_tokens": bm.num_used_blocks * bs,
            "kv_total_tokens": bm.num_blocks * bs,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "prefix_cache_hit_tokens": cache.num_hit_tokens if cache else 0,
            "prefix_cache_queried_tokens": cache.num_queried_tokens if cache else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_non_finite_requests": self.num_non_finite,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generated_tokens,
        }
