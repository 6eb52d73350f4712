"""Continuous batching in plain Python: which tokens of which requests run in the next step.

Each step has a token budget (`chunked_prefill_size`). Running requests go first, in admission
order: a request in decode costs one token, one still in prefill gets the next chunk of its
prompt that fits the budget (chunks end on block boundaries when they are not the last, so a
prompt's last full block is always in the cache when the prompt completes). Then waiting
requests are admitted first-come-first-served while the pool can hold their whole prompt (after
a prefix-cache match) and `max_num_seqs` allows. When a running request needs a block and the
pool is full, the most recently admitted request is preempted by recompute: its blocks go back
(full ones into the prefix cache, where a later re-admission usually finds them again) and it
returns to the head of the waiting queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torch_runner.kv.block_manager import BlockManager
from torch_runner.kv.radix_cache import RadixCache
from torch_runner.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at position `start` run in this step.

    A chunk that starts at `seq.num_tokens` is *chained*: its one input token is an output
    placeholder, sampled by the step still running, which the runner reads on the device."""

    seq: Sequence
    start: int
    num_tokens: int
    restore_from: Any = None  # prefix-cache payload (SWA windows) to restore before running
    is_sampled: bool = field(init=False)  # reaches the last token: the step samples the next

    def __post_init__(self) -> None:
        self.is_sampled = self.start + self.num_tokens == self.seq.num_scheduled_tokens

    @classmethod
    def decode(cls, seq: Sequence, start: int) -> ScheduledChunk:
        """The one token of a sequence in decode, which is sampled: the constructor's result
        without its checks (a large batch builds one per request per step)."""
        chunk = cls.__new__(cls)
        chunk.seq, chunk.start, chunk.num_tokens, chunk.restore_from = seq, start, 1, None
        chunk.is_sampled = True
        return chunk

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_chained(self) -> bool:
        return self.start >= self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens > 1 or self.start < self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Waiting/running queues, token budget, admission by free KV, preemption, abort."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        token_budget: int,
        is_chunked_prefill: bool = True,
        prefix_cache: RadixCache | None = None,
        need_payload: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.is_chunked_prefill = is_chunked_prefill
        self.prefix_cache = prefix_cache
        self.need_payload = need_payload
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        max_tokens = self.block_manager.num_blocks * self.block_size
        if seq.num_tokens > max_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: prompt has {seq.num_tokens} tokens but the KV pool "
                f"holds only {max_tokens}; raise max_total_tokens or shorten the prompt"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; its blocks go back. Returns it, or None."""
        seq = self.find(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(
        self, seq: Sequence, reason: str, stop_reason: Any = None, payload: Any = None
    ) -> None:
        """Retire `seq`: cache its full computed blocks, release its references."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq, payload)
        seq.finish(reason, stop_reason)

    def cache_prefix(self, seq: Sequence, payload: Any = None) -> None:
        """Insert the full blocks computed so far into the prefix cache (no release)."""
        if self.prefix_cache is None:
            return
        # only known tokens key the tree: an overlapped step's placeholder input is not yet
        num_known = min(seq.num_computed_tokens, seq.num_tokens)
        num_full = min(num_known // self.block_size, len(seq.block_table))
        if num_full:
            self.prefix_cache.insert(
                seq.token_slice(0, num_full * self.block_size), seq.block_table[:num_full], payload
            )

    def _release(self, seq: Sequence, payload: Any = None) -> None:
        self.cache_prefix(seq, payload)
        self.block_manager.release(seq.block_table)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- block accounting -------------------------------------------------------------
    def _reserve(self, num_blocks: int) -> bool:
        """Make `num_blocks` blocks free, evicting cached ones if needed."""
        free = self.block_manager.num_free_blocks
        if num_blocks <= free:
            return True
        if self.prefix_cache is None:
            return False
        if num_blocks > free + self.prefix_cache.num_evictable_blocks():
            return False
        self.prefix_cache.evict(num_blocks - free)
        return self.block_manager.num_free_blocks >= num_blocks

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)  # blocks_for_tokens
        if needed <= 0:
            return True
        if not self._reserve(needed):
            return False
        self.block_manager.grow(seq.block_table, num_tokens)
        return True

    def _chunk_size(self, seq: Sequence, start: int, budget: int) -> int:
        pending = seq.num_scheduled_tokens - start
        if not self.is_chunked_prefill or pending <= budget:
            return pending
        end = ((start + budget) // self.block_size) * self.block_size
        return end - start if end > start else budget

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        i = num_ending = 0
        running, chunks, block_size = self.running, out.chunks, self.block_size
        while i < len(running) and budget > 0:
            seq = running[i]
            placeholders = seq.num_output_placeholders
            if placeholders and self._ends_at_placeholder(seq):
                # no wasted slot: it finishes when read back
                i += 1
                num_ending += 1
                continue
            start = seq.num_computed_tokens
            num_scheduled = len(seq.prompt_token_ids) + len(seq.output_token_ids) + placeholders
            if num_scheduled == start + 1 and start < len(seq.block_table) * block_size:
                # decode, its block already held: what the general path below decides, sooner
                chunks.append(ScheduledChunk.decode(seq, start))
                budget -= 1
                i += 1
                continue
            if not self.is_chunked_prefill and seq.num_pending_tokens > budget and out.chunks:
                i += 1
                continue
            num_new = self._chunk_size(seq, start, budget)
            while not self._grow(seq, start + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk(seq, start, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            # sequences ending at their placeholder leave their slot now, as they would have
            # had their token been read before this step (the synchronous engine's admissions)
            num_ending += sum(map(self._ends_at_placeholder, self.running[i:]))
            self._admit(out, budget, len(self.running) - num_ending)
        return out

    def _ends_at_placeholder(self, seq: Sequence) -> bool:
        """True when the token in flight surely ends `seq` by length (max_tokens or the
        context), so an overlapped step need not give it a slot it would waste."""
        num_placeholders = seq.num_output_placeholders
        if not num_placeholders:
            return False
        max_tokens = getattr(seq.params, "max_tokens", None)
        num_outputs = len(seq.output_token_ids) + num_placeholders
        if max_tokens is not None and num_outputs >= max_tokens:
            return True
        max_len = self.max_model_len  # num_scheduled_tokens, without the property call
        return max_len is not None and len(seq.prompt_token_ids) + num_outputs >= max_len

    def _admit(self, out: SchedulerOutput, budget: int, num_active: int) -> None:
        while self.waiting and num_active < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.num_output_placeholders:  # preempted with a token in flight: admit it known
                break
            if not self.is_chunked_prefill and seq.num_tokens > budget and out.chunks:
                break
            blocks, payload = [], None
            if self.prefix_cache is not None:
                blocks, payload = self.prefix_cache.match_prefix(
                    seq.all_token_ids, seq.num_tokens - 1, self.need_payload
                )
            for block_id in blocks:
                self.block_manager.incref(block_id)
            needed = self.block_manager.blocks_for_tokens(seq.num_tokens) - len(blocks)
            if not self._reserve(needed):
                for block_id in blocks:
                    self.block_manager.decref(block_id)
                break
            self.waiting.popleft()
            seq.num_computed_tokens = len(blocks) * self.block_size
            seq.block_table = blocks
            self.block_manager.grow(seq.block_table, seq.num_tokens)
            if not seq.is_admitted_before:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.is_admitted_before = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_active += 1
            num_new = self._chunk_size(seq, seq.num_computed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new, payload))
            budget -= num_new

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step's chunks have their KV in the cache."""
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.end
