"""Per-request bookkeeping around a Sequence: detokenizer, stop checks, logprobs, increments.

Kept apart from the scheduler (which only sees token counts) and the runner (which only sees
tensors): this is where a sampled token becomes text and where a request decides it is done.
Order of checks for each new token: a token the grammar rejects (its mask allowed none) ends the
request without being output; then grammar termination, EOS (unless ignore_eos), stop token
ids, stop strings (only after min_tokens; what follows the stop string is cut, and the string
itself too unless include_stop_str_in_output), max_tokens, then the context length.
"""

from __future__ import annotations

from typing import Any

from torch_runner.detokenizer import IncrementalDetokenizer, StopStrings
from torch_runner.outputs import Logprob, RequestOutput
from torch_runner.sequence import Sequence, SequenceStatus


class RequestState:
    def __init__(
        self,
        seq: Sequence,
        tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        grammar: Any = None,
    ):
        self.seq = seq
        self.params = seq.params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, self.params.skip_special_tokens
        )
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammar = grammar
        self.stops = list(self.params.stop or [])
        self._stop_strings = StopStrings(self.stops)
        self.max_stop_len = self._stop_strings.max_len
        self.logprobs: list[Logprob] | None = [] if self.params.logprobs else None
        self.final_text: str | None = None
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.error: str | None = None

    def fail(self, message: str):
        """End the request with finish_reason "error" (its logits went non-finite)."""
        self.error = message
        self.detokenizer.flush()
        return "error", None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def append(self, token_id: int, logprob: float | None, top: list | None):
        """Record one sampled token; returns (finish_reason, stop_reason) when the request ends."""
        finish = self._check(token_id, logprob, top)
        if finish is not None and self.final_text is None:
            self.detokenizer.flush()
        return finish

    def _check(self, token_id: int, logprob: float | None, top: list | None):
        seq, params = self.seq, self.params
        # A grammar that allows no next token (complete, but none of its stop tokens is in the
        # vocabulary or allowed) leaves the sampler an all -inf row: its pick is not output, the
        # request ends as the grammar has, instead of writing token 0 until max_tokens.
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            return "stop", None
        outputs = seq.output_token_ids  # (Sequence.append_token, without the call: every step)
        outputs.append(int(token_id))
        if self.logprobs is not None and logprob is not None:
            alternatives = [(int(i), float(v)) for i, v in (top or [])[: params.top_logprobs]]
            self.logprobs.append(Logprob(token_id, float(logprob), alternatives))
        if self.grammar is not None and self.grammar.is_terminated:
            return "stop", None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return "stop", token_id
        if not self.stops:
            self.detokenizer.append(token_id)
        else:
            before = len(self.detokenizer.text)
            self.detokenizer.append(token_id)
            if len(outputs) >= params.min_tokens:
                text = self.detokenizer.text
                found = self._stop_strings.find(text, before - self.max_stop_len + 1)
                if found is not None:
                    end = found[0] + (len(found[1]) if params.include_stop_str_in_output else 0)
                    self.final_text = text[:end]
                    return "stop", found[1]
        num_outputs = len(outputs)
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return "length", None
        if len(seq.prompt_token_ids) + num_outputs >= self.max_model_len:
            return "length", None
        return None

    def visible_text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        text = self.detokenizer.text
        if self.seq.is_finished or not self.stops:
            return text
        return text[: len(text) - self._stop_strings.holdback(text)]

    def make_output(self) -> RequestOutput:
        seq = self.seq
        if self.final_text is None and not self.stops:
            text = self.detokenizer.text
        else:
            text = self.visible_text()
        output_ids = seq.output_token_ids
        num_emitted = self.num_emitted_tokens
        delta_text = text[self.num_emitted_chars :]
        self.num_emitted_chars, self.num_emitted_tokens = len(text), len(output_ids)
        logprobs = self.logprobs
        # positional (the field order of RequestOutput): ~1 us less per request per step
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            output_ids[:],
            text,
            delta_text,
            output_ids[num_emitted:],
            logprobs[:] if logprobs is not None else None,
            seq.status is SequenceStatus.FINISHED,
            seq.finish_reason,
            seq.num_cached_tokens,
            seq.stop_reason,
            self.error,
        )
