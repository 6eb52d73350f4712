"""Compile the runtime's newer Triton kernels for the H200 (sm_90) on a machine without a GPU.

Why: `TRITON_INTERPRET=1` checks a kernel's numbers on the CPU but not that it compiles: a
kernel reading a non-constexpr global ran in the interpreter and failed to compile on the
device (2026-12-02). Triton's bundled ptxas builds the cubin without a driver, so compile errors
show up here, before a device call. Each kernel is built for every constexpr combination the
launchers use (dtypes bf16; ops/fused greedy pick, ops/paged_attention_triton both passes).

    PYTHONPATH=.:/work/triton_site python tools/check_triton_compile.py
"""

from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ops.fused.triton_kernels as fused
import ops.paged_attention_triton as paged

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, signature: dict, constexprs: dict, num_warps: int = 4) -> int:
    """Compile one specialisation; returns the cubin's size (raises on a compile error)."""
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                            target=TARGET, options={"num_warps": num_warps})  # fmt: skip
    return len(kernel.asm["cubin"])


def main() -> None:
    rows = []
    chunk = {"L": "*bf16", "Best": "*fp32", "Index": "*i32", "Bad": "*i32", "stride_l": "i64",
             "V": "i32"}  # fmt: skip
    rows.append(("greedy chunk", build(fused._greedy_chunk_kernel, chunk,
                                       {"CHUNK": fused.GREEDY_CHUNK, "NCHUNK": 32})))  # fmt: skip
    merge = {"Best": "*fp32", "Index": "*i32", "Bad": "*i32", "Tokens": "*i64", "Picks": "*i64"}
    rows.append(("greedy merge", build(fused._greedy_merge_kernel, merge,
                                       {"NCHUNK": 32, "PAD": 32}, num_warps=1)))  # fmt: skip
    ptrs = dict(zip(["Q", "K", "V", "Tables", "Lens", "Acc", "Lse", "Sinks", "Out"],
                    ["*bf16"] * 3 + ["*i64"] * 2 + ["*fp32"] * 3 + ["*bf16"]))  # fmt: skip
    strides = ["stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_tb", "stride_lens",
               "stride_ab", "stride_ah", "stride_as", "stride_lb", "stride_lh", "stride_ob",
               "stride_oh"]  # fmt: skip
    partial = {**ptrs, **dict.fromkeys(strides, "i64"), "sm_scale": "fp32", "window": "i32"}
    fixed = dict(G=4, G_PAD=16, D=64, D_PAD=64, PAGE=16, BLOCK=paged.BLOCK_N, PRECISION="tf32")
    for splits, sinks, window in itertools.product((1, 4), (False, True), (False, True)):
        size = build(paged._partial_kernel, partial,
                     dict(fixed, SPLITS=splits, HAS_SINKS=sinks, HAS_WINDOW=window))  # fmt: skip
        rows.append((f"paged partial splits={splits} sinks={sinks} window={window}", size))
    for name, size in rows:
        print(f"{name:48s} ok ({size} bytes of sm_90 cubin)")


if __name__ == "__main__":
    main()
