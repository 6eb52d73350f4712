"""The engine's step: schedule -> launch -> postprocess, synchronous or overlapped.

Synchronous: each step is scheduled, run and read back before the next is scheduled.

Overlapped (`async_scheduling`, SGLang's overlap scheduler, vLLM's async scheduling): step N+1
is scheduled and launched while step N runs on the device, and the host postprocesses step N's
tokens (request state, stop checks, detokenizer, outputs) while N+1 runs. Each sequence that
step N sampled carries an output placeholder; its chunk in step N+1 reads that token on the
device (runner/launched.py). A request that step N ends (EOS, a stop string) has a wasted slot
in step N+1, discarded when read; requests that surely end by length are not scheduled again
(scheduler `_ends_at_placeholder`). A step whose next one needs this step's tokens on the host
(grammar masks, penalties that read the outputs) is not chained: it is read back before the
next is scheduled (the `chain_safe` rule). Tokens and logprobs equal the synchronous engine's.
"""

from __future__ import annotations

from torch_runner.outputs import RequestOutput
from torch_runner.runner.model_runner import NON_FINITE_TOKEN, LaunchedStep
from torch_runner.sequence import Sequence

NON_FINITE_MESSAGE = (
    "the model produced non-finite logits (NaN or inf) for this request; it was ended. "
    "Try another dtype (float16 overflows where bfloat16 or float32 does not)"
)


def is_chain_safe(seq: Sequence) -> bool:
    """False when the sampler needs this sequence's last token on the host before its next
    step: a grammar mask (advanced by the token) or penalties (counted over the outputs)."""
    return seq.params.structured is None and not seq.params.has_penalties


class EngineSteps:
    """`Engine.step` and what it needs; mixed into Engine (engine.py holds the state)."""

    _inflight: LaunchedStep | None = None

    def step(self) -> list[RequestOutput]:
        """One step; returns an output for every request that progressed. Overlapped, the
        outputs are those of the step launched by the previous call."""
        if not self.is_overlapped:
            launched = self._launch()
            return self._postprocess(launched) if launched is not None else []
        previous, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        if previous is not None and not all(is_chain_safe(s) for s in previous.seqs):
            outputs, previous = self._postprocess(previous), None  # not chained: read it first
        self._inflight = self._launch()
        if previous is not None:  # while the step just launched runs on the device
            outputs = self._postprocess(previous)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def _launch(self) -> LaunchedStep | None:
        """Schedule the next step and queue it on the device; None when nothing runs."""
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.runner.free(seq.request_id)
        if out.is_empty:
            return None
        if self.tensor_parallel is not None:  # the workers run the same step from its inputs
            self.tensor_parallel.check_alive()
            self.tensor_parallel.send_step(out.chunks)
        launched = self.runner.launch(out.chunks, self._grammar_rows)
        self.scheduler.advance(out)
        for seq in launched.seqs:
            seq.num_output_placeholders += 1
        # (overlapped: before the KV is written, but every reader is a later step on the stream)
        self._publish_prefixes(out.chunks)
        self._free_behind_window(out.chunks)
        return launched

    def _postprocess(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read the step's tokens back and apply them: stop checks, finishes, outputs."""
        result = launched.result()
        outputs = []
        requests = self.requests
        logprobs, top_logprobs = result.logprobs, result.top_logprobs
        num_generated = 0
        for i, (seq, token_id) in enumerate(zip(result.seqs, result.token_ids)):
            state = requests.get(seq.request_id)
            if state is None or state.seq is not seq:  # aborted while the step ran
                continue
            seq.num_output_placeholders -= 1
            if token_id == NON_FINITE_TOKEN:  # only this request ends; its batchmates go on
                finish = state.fail(NON_FINITE_MESSAGE)
                self.num_non_finite += 1
            else:
                logprob = logprobs[i] if logprobs is not None else None
                top = top_logprobs[i] if top_logprobs is not None else None
                finish = state.append(token_id, logprob, top)
                num_generated += 1
            if finish is not None:
                # a slot in the step now running is wasted: its KV is not counted as computed
                seq.num_computed_tokens -= seq.num_output_placeholders
                seq.num_output_placeholders = 0
                self.scheduler.finish(seq, finish[0], finish[1], self._payload(seq))
                self.runner.free(seq.request_id)
                del requests[seq.request_id]
            outputs.append(state.make_output())
        self.num_generated_tokens += num_generated
        return outputs

    def _grammar_rows(self, chunks):
        grammars = [self.requests[c.seq.request_id].grammar for c in chunks]
        if all(g is None for g in grammars):
            return None
        if self._grammar_masker is None:
            from torch_runner.grammar.masks import GrammarMasker

            self._grammar_masker = GrammarMasker(self.vocab_size, self.device)
        return self._grammar_masker.build_edit_rows(grammars)
