"""The kernels' side of programmatic dependent launch (ops/pdl.py): Triton helpers that every
PDL-aware kernel calls before touching memory the chain shares."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Triton 3.3+; with an older one ops.pdl never turns PDL on, so these are never reached
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel's programs start, then wait for the previous kernel (no-ops when
    the launch is not PDL). Call before the first load of anything another kernel writes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_prefetch_enter(ptrs, PDL: tl.constexpr):
    """pdl_enter, with an L2 prefetch of `ptrs` (read-only data, e.g. weight rows) issued
    between the two, so their bytes stream in while the previous kernel finishes."""
    if PDL:
        gdc_launch_dependents()
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
            [ptrs.to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        gdc_wait()
