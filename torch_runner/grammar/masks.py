"""Turn xgrammar token bitmasks into the sampler's additive edit rows.

Contract with the sampler (`SamplingBatch.build(..., edit_rows=[Tensor[V] | None per row])`): a
grammar row is 0 where a token is allowed and -inf where the grammar forbids it; the sampler adds
it to the request's logit_bias (and min_tokens bans) to form the request's ONE additive edit row
(`SamplingBatch.logit_edits`), so the sampler stays a plain `logits + edits`.

Why a lookup table: the bitmask is int32 words, bit j of word w = token 32*w + j (little-endian),
so viewing it as bytes and gathering a [256, 8] table of {0, -inf} yields the row in one
`index_select`. Measured on the 2-core CPU (tools/bench_grammar.py) this is 1.0-3.5x faster
than xgrammar's `apply_token_bitmask_inplace` CPU kernel on a zero row, and needs no compile
(its torch_compile backend pays ~30 s on first call and was not faster). On CUDA the bitmask lives in pinned host
memory and is copied non-blocking; the table lives on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from torch_runner.grammar.compiler import RequestGrammar

NEG_INF = float("-inf")


def allocate_bitmask(batch_size: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """CPU int32 bitmask [B, ceil(V / 32)], all allowed; pinned only when the runner is CUDA."""
    shape = xgr.get_bitmask_shape(batch_size, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=device.type == "cuda")


def byte_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256, 8] table: row b, column j is 0 when bit j of byte b is set, else -inf."""
    bits = (torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8)) & 1  # [256, 8]
    return torch.where(bits.bool(), 0.0, NEG_INF).to(device=device, dtype=dtype)


def bitmask_to_additive(
    bitmask: torch.Tensor, vocab_size: int, table: torch.Tensor
) -> torch.Tensor:
    """Bitmask [G, W] int32 (any device) -> additive rows [G, V] on the table's device."""
    num_rows = bitmask.shape[0]
    as_bytes = bitmask.to(table.device, non_blocking=True).view(torch.uint8)  # [G, 4W]
    rows = table.index_select(0, as_bytes.reshape(-1).long())  # [G * 4W, 8]
    return rows.view(num_rows, -1)[:, :vocab_size]  # [G, V]


class GrammarMasker:
    """Per-runner buffers that build the edit rows of one step.

    `build_edit_rows` fills the bitmask of every grammar row on the CPU (xgrammar) and converts
    them on the runner's device in one gather; free rows get None.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        *,
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 8,
    ):
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.dtype = dtype
        self.table = byte_table(self.device, dtype)
        self.bitmask = allocate_bitmask(max_batch_size, self.vocab_size, self.device)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        if num_rows > self.bitmask.shape[0]:
            grown = max(num_rows, 2 * self.bitmask.shape[0])
            self.bitmask = allocate_bitmask(grown, self.vocab_size, self.device)
        return self.bitmask[:num_rows]

    def build_edit_rows(
        self, grammars: Sequence[RequestGrammar | None]
    ) -> list[torch.Tensor | None]:
        """One additive mask row [V] (or None for free rows) per batch row, on the device.

        Call after the previous step's tokens were accepted. The bitmask buffer is reused: on
        CUDA its non-blocking copy is stream-ordered before the sampler, whose tokens the host
        reads (a sync) before the next fill can overwrite it.
        """
        grammar_rows = [i for i, g in enumerate(grammars) if g is not None]
        edit_rows: list[torch.Tensor | None] = [None] * len(grammars)
        if not grammar_rows:
            return edit_rows
        bitmask = self._bitmask_rows(len(grammar_rows))
        for slot, row in enumerate(grammar_rows):
            grammars[row].fill_bitmask(bitmask, slot)
        masks = bitmask_to_additive(bitmask, self.vocab_size, self.table)  # [G, V]
        for slot, row in enumerate(grammar_rows):
            edit_rows[row] = masks[slot]
        return edit_rows
