"""The GEMV's tiles and where it runs (ops/quant/gemv_triton.py), as data: no triton import, so
the choice is testable where Triton is absent (CI). Two tables: 1-byte (fp8 / int8) weights,
below, and plain bf16 weights (BF16_CONFIGS, further down).

Measured on one H200 (2026-12-02, tools/bench_fp8_linear.py --rows 1,2,4,8: `do_bench` medians
with the L2 cleared before each call; docs/performance-log.md): for every projection of the
Llama-3.2-1B / 3.1-8B geometries and each row bucket, the fastest of the sweep's tiles, and the
shapes where `_scaled_mm` (activations quantized to e4m3, tensor cores) beat the best tile.
At one row the GEMV won every shape (1.03-1.5x faster than bf16 F.linear, 1.06-8.9x faster than
`_scaled_mm`); from 2 rows its per-slice reduction makes the wide shapes compute-bound (2 rows
cost ~1.9x one on the heads), and at 4-8 rows `_scaled_mm` wins most of them.
One row was measured again on 2026-12-04 as decode runs it (--chain: a CUDA graph of one shape's
GEMVs over distinct weights), which favours smaller programs than the L2-cleared do_bench did.
"""

from __future__ import annotations

import json
import os

from ops.env import env_choice

MAX_ROWS = 8  # BLOCK_M: the kernel keeps every row's accumulator in registers
UNMEASURED_MAX_ROWS = 1  # fp8 shapes not in the table take the GEMV up to this many rows
# (BLOCK_M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, SPLIT_K), H200; one row: 2026-12-04, the
# fastest tile converting as loaded in a CUDA-graph chain of the shape's GEMVs (bench_fp8_linear
# --chain, 19:35: one-warp programs of 4-8 channels won the wide matrices; Llama-8B decode 330.8
# -> 340.9 tok/s over the 19:29 chain table, 307.9 before it; 1B 1,206.6 -> 1,279.5, 1,144.8);
# 2-8 rows: 2026-12-02, do_bench with the L2 cleared. The five wide one-row shapes run the
# tensor-core loop (FP8_READS below), tiles from tools/bench_gemv_dot.py (H200, 2026-12-06)
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 3072, 2048): (2, 512, 2, 1), (1, 2048, 2048): (2, 1024, 4, 1),
    (1, 16384, 2048): (32, 128, 1, 1), (1, 2048, 8192): (2, 1024, 4, 1),
    (1, 128256, 2048): (32, 128, 1, 1), (1, 6144, 4096): (8, 512, 4, 1),
    (1, 4096, 4096): (2, 512, 2, 1), (1, 28672, 4096): (32, 128, 1, 1),
    (1, 4096, 14336): (32, 256, 2, 4), (1, 128256, 4096): (32, 256, 2, 1),
    (2, 3072, 2048): (4, 512, 4, 1), (2, 2048, 2048): (16, 256, 4, 4),
    (2, 16384, 2048): (16, 512, 4, 1), (2, 2048, 8192): (8, 512, 4, 4),
    (2, 128256, 2048): (16, 512, 4, 1), (2, 6144, 4096): (8, 512, 4, 1),
    (2, 4096, 4096): (8, 512, 4, 1), (2, 28672, 4096): (16, 512, 4, 1),
    (2, 4096, 14336): (8, 512, 4, 4), (2, 128256, 4096): (16, 512, 4, 1),
    (4, 3072, 2048): (8, 512, 4, 1), (4, 2048, 2048): (4, 512, 4, 1),
    (4, 16384, 2048): (8, 512, 4, 1), (4, 2048, 8192): (8, 512, 4, 4),
    (4, 128256, 2048): (16, 512, 4, 1), (4, 6144, 4096): (8, 512, 4, 1),
    (4, 4096, 4096): (8, 512, 4, 1), (4, 28672, 4096): (16, 512, 4, 1),
    (4, 4096, 14336): (8, 512, 4, 4), (4, 128256, 4096): (16, 512, 4, 1),
    (8, 3072, 2048): (8, 512, 4, 1), (8, 2048, 2048): (4, 512, 4, 1),
    (8, 16384, 2048): (16, 512, 4, 1), (8, 2048, 8192): (8, 512, 4, 4),
    (8, 128256, 2048): (16, 512, 4, 1), (8, 6144, 4096): (8, 512, 4, 1),
    (8, 4096, 4096): (4, 512, 4, 1), (8, 28672, 4096): (16, 512, 4, 1),
    (8, 4096, 14336): (8, 512, 4, 4), (8, 128256, 4096): (16, 512, 4, 1),
}  # fmt: skip
# (BLOCK_M, N, K) where fp8 `_scaled_mm` beat the GEMV's best tile, H200, 2026-12-02
SCALED_MM_FASTER: set[tuple[int, int, int]] = {
    (2, 128256, 2048), (2, 28672, 4096), (2, 128256, 4096),
    (4, 16384, 2048), (4, 2048, 8192), (4, 128256, 2048), (4, 28672, 4096), (4, 4096, 14336),
    (4, 128256, 4096),
    (8, 16384, 2048), (8, 2048, 8192), (8, 128256, 2048), (8, 6144, 4096), (8, 4096, 4096),
    (8, 28672, 4096), (8, 4096, 14336), (8, 128256, 4096),
}  # fmt: skip


# One row of an int8 weight keeps the 2026-12-02 tiles: the 12-04 fp8 chain tiles above made int8
# decode slower (H200, 19:54, bench_cuda_decode --quantization int8, this table / those tiles /
# this table: Llama-8B 215.0 / 230.9 / 214.9 tok/s, 1B 922.4 / 941.6 / 922.3)
INT8_ROW_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 3072, 2048): (4, 1024, 8, 1), (1, 2048, 2048): (4, 1024, 8, 1),
    (1, 16384, 2048): (8, 256, 4, 1), (1, 2048, 8192): (8, 1024, 8, 1),
    (1, 128256, 2048): (8, 256, 4, 1), (1, 6144, 4096): (8, 256, 4, 1),
    (1, 4096, 4096): (8, 512, 8, 1), (1, 28672, 4096): (4, 512, 4, 1),
    (1, 4096, 14336): (4, 1024, 8, 1), (1, 128256, 4096): (8, 256, 4, 1),
}  # fmt: skip


def block_rows(m: int) -> int:
    """The BLOCK_M a batch of `m` rows compiles for (a power of two, 1..MAX_ROWS)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows; got {m}")
    return 1 << (m - 1).bit_length()


def pick_config(
    m: int, n: int, k: int, int8: bool = False, dot: bool = True
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT_K) for an [m, k] @ [n, k].T product: the measured
    table (INT8_ROW_CONFIGS first for one row of int8 weights), else 8 (16 for wide N) channels
    by 512-byte slices, 4 warps, unsplit (split-K won no measured shape at one row). dot False:
    a product that will not run the tensor-core loop (block scales, fp32 x) takes the rule
    where the table's tile was measured for that loop (READ_DOT)."""
    key = (block_rows(m), n, k)
    found = INT8_ROW_CONFIGS.get(key) if int8 else None
    if found is None and (dot or FP8_READS.get(key) != READ_DOT):
        found = CONFIGS.get(key)
    if found is not None:
        return found
    return (8 if n <= 8192 else 16), min(512, 1 << max(k - 1, 1).bit_length()), 4, 1


# How one row of an fp8 GEMV reads its e4m3 slices where another way than converting each as
# loaded (gemv_triton.WIDEN_1BYTE) measured faster: (1, N, K) -> READ_BITS (bit placement,
# E4M3_BITS) or READ_RAW (raw bytes carried, converted at use); tools/bench_fp8_linear.py --chain
# (a CUDA graph of one shape's GEMVs over distinct weights) writes it as a tile's 5th value.
# H200, 2026-12-04: converting as loaded won every shape in the chain (bits 2-30% slower);
# 2026-12-06: the tensor-core loop (READ_DOT) won the five wide shapes.
# READ_DOT: the tensor-core loop (gemv_triton._accumulate_dot), with Triton's num_stages in
# DOT_STAGES (a tile's 6th value)
READ_CONVERT, READ_BITS, READ_RAW, READ_DOT = 0, 1, 2, 3
# H200, 2026-12-06 (tools/bench_gemv_dot.py, a CUDA-graph chain per shape, the FMA loop at the
# 12-04 tile / the tensor-core loop at these tiles, num_stages 4, us): 8b gate_up 34.81 / 31.14,
# down 19.80 / 18.02, head 138.48 / 123.69; 1b gate_up 12.26 / 10.80, head 73.63 / 65.15. The
# narrow ones (qkv, o, 1b down) stayed faster on the FMA loop (0.76-1.0x)
_DOT_SHAPES = [(1, 16384, 2048), (1, 128256, 2048), (1, 28672, 4096), (1, 4096, 14336),
               (1, 128256, 4096)]  # fmt: skip
FP8_READS: dict[tuple[int, int, int], int] = dict.fromkeys(_DOT_SHAPES, READ_DOT)
DOT_STAGES: dict[tuple[int, int, int], int] = dict.fromkeys(_DOT_SHAPES, 4)
ENV_FP8_BITS = "TORCH_RUNNER_GEMV_FP8_BITS"  # auto (default): FP8_READS | on | off
FP8_BITS_MODES = ("auto", "on", "off")


def set_configs(table: dict[tuple[int, int, int], tuple[int, ...]]) -> None:
    """Replace the tile table (a benchmark's sweep result); shapes not in it take the rule. A
    5th value in a tile (bench_fp8_linear.py --chain) is how one row reads e4m3 (FP8_READS)."""
    CONFIGS.clear()
    CONFIGS.update({key: tuple(cfg[:4]) for key, cfg in table.items()})
    FP8_READS.clear()
    FP8_READS.update({key: cfg[4] for key, cfg in table.items() if len(cfg) > 4 and cfg[4]})
    DOT_STAGES.clear()
    DOT_STAGES.update({key: cfg[5] for key, cfg in table.items() if len(cfg) > 5})


def fp8_bits_mode() -> str:
    """ENV_FP8_BITS, read once by ops/quant/gemv_triton.py."""
    return env_choice(ENV_FP8_BITS, "auto", FP8_BITS_MODES)


ENV_SILU = "TORCH_RUNNER_GEMV_SILU"  # auto (default) | on | off
SILU_MODES = ("auto", "on", "off")
# (weight kind, rows, 2I, K) whose gate/up GEMV measured faster with silu(gate) * up in its
# epilogue than followed by the SiLU-mul kernel. H200, batch-1 decode, on / off / on in one
# call (2026-12-06): Llama-8B fp8 385.7 / 381.1 / 385.8 tok/s; bf16 249.7 / 252.5 / 249.6,
# Llama-1B fp8 1,466.7 / 1,483.0 / 1,466.3, bf16 1,110.2 / 1,116.6 / 1,110.4 (slower: a program
# then reads its rows from two places, half the channels each)
SILU_FASTER = {("fp8", 1, 28672, 4096)}


def silu_gemv_mode() -> str:
    """ENV_SILU: where a feed-forward's gate/up projection that runs the GEMV applies
    silu(gate) * up in its epilogue (ops.linear.linear_silu_mul: one kernel a layer fewer, the
    same values as the SiLU-mul kernel after it): auto, the SILU_FASTER shapes; on, every one;
    off, none (the GEMV, then that kernel)."""
    return env_choice(ENV_SILU, "auto", SILU_MODES)


def silu_in_gemv(kind: str, m: int, n: int, k: int, mode: str) -> bool:
    """Whether an [n, k] gate/up product of m rows, weight kind "fp8" / "int8" / "bf16", takes
    the GEMV's gated epilogue under `mode` (silu_gemv_mode). Never for more rows than the GEMV
    takes (MAX_ROWS): prefill chunks and wide batches run the matmul, then the SiLU-mul kernel."""
    if not 1 <= m <= MAX_ROWS:
        return False
    return mode == "on" or (mode == "auto" and (kind, block_rows(m), n, k) in SILU_FASTER)


ENV_ROPE = "TORCH_RUNNER_GEMV_ROPE"  # on (default) | off
ROPE_MODES = ("off", "on")


def rope_gemv_mode() -> str:
    """ENV_ROPE: whether a decode q/k/v projection that runs the GEMV rotates q and k and writes
    k and v to the pool in its epilogue (ops.linear.linear_rope_kv: the rope + KV-write kernel
    fewer a layer, the same values): on, or off (the GEMV, then that kernel). On by default since
    2026-12-07: 1B fp8 +0.7% (H200), +0.8% (H100); 8B fp8 +0.5% (H100), the same greedy tokens."""
    return env_choice(ENV_ROPE, "on", ROPE_MODES)


ENV_PRELOAD = "TORCH_RUNNER_GEMV_PRELOAD"  # on (default) | off
PRELOAD_MODES = ("off", "on")


def preload_mode() -> str:
    """ENV_PRELOAD: whether a GEMV program loads its first weight slice before it waits for the
    previous kernel under PDL (ops/pdl.py), so those bytes stream in while that kernel finishes
    (x, which it writes, is read after the wait). The same values either way. H100, batch-1
    decode, the same greedy tokens: the FMA loop (one call, 2026-12-07), off / on tok/s:
    Llama-1B fp8 1,345.9 / 1,370.5, bf16 915.5 / 946.6; 8B fp8 305.6 / 309.4, bf16 186.3 /
    189.7; then the tensor-core loop too (another call, both orders): 8B fp8 311.7 / 315.3-315.5,
    1B fp8 1,380.4 / 1,386.2."""
    return env_choice(ENV_PRELOAD, "on", PRELOAD_MODES)


def fp8_takes_bits(m: int, n: int, k: int, mode: str) -> bool:
    """Whether one row of an fp8 GEMV reads the weight by bit placement under `mode`."""
    if mode == "off" or m != 1:
        return False
    return mode == "on" or FP8_READS.get((1, n, k)) == READ_BITS


def fp8_reads_raw(m: int, n: int, k: int) -> bool:
    """Whether one row of an fp8 GEMV carries the raw bytes (else the WIDEN_1BYTE default)."""
    return m == 1 and FP8_READS.get((1, n, k)) == READ_RAW


ENV_PREFETCH = "TORCH_RUNNER_GEMV_PREFETCH_LINES"  # PDL launches: L2 lines per weight row
PREFETCH_CHOICES = (0, 1, 2, 4, 8, 16, 32, 64)


def prefetch_lines() -> int:
    """ENV_PREFETCH (default 0: none): the 128-byte lines of each weight row a GEMV program asks
    L2 for before it waits for the previous kernel under PDL (ops/pdl.py). Measured on an H200
    (Llama-8B batch-1 decode, one call): 0 / 4 / 8 / 16 / 32 lines, fp8 383.8 / 380.8 / 376.5 /
    361.2 / 329.7 tok/s, bf16 252.8 / 244.3 / 242.8 / - / 228.7: the prefetch takes bandwidth
    from the kernel still running; kept as a switch for other GPUs."""
    return int(env_choice(ENV_PREFETCH, "0", [str(n) for n in PREFETCH_CHOICES]))


def fp8_takes_dot(m: int, n: int, k: int) -> bool:
    """Whether one row of an fp8 GEMV runs the tensor-core loop (the table's READ_DOT)."""
    return m == 1 and FP8_READS.get((1, n, k)) == READ_DOT


def dot_stages(m: int, n: int, k: int, plain: bool) -> int | None:
    """Triton's num_stages for the tensor-core loop of this shape (None: Triton's default)."""
    key = (block_rows(m), n, k)
    return BF16_DOT.get(key) if plain else DOT_STAGES.get(key)


def fp8_takes_gemv(m: int, n: int, k: int, max_rows: int) -> bool:
    """Whether an fp8 product of `m` rows by an [n, k] weight runs the GEMV (else `_scaled_mm`):
    never past `max_rows`; for a measured shape, unless `_scaled_mm` measured faster; for any
    other shape, up to UNMEASURED_MAX_ROWS rows."""
    if m > min(max_rows, MAX_ROWS):
        return False
    key = (block_rows(m), n, k)
    if key in CONFIGS:
        return key not in SCALED_MM_FASTER
    return m <= UNMEASURED_MAX_ROWS


# Plain bf16 weights at one row (batch-1 decode): the same kernel with no scale, against cuBLAS
# (F.linear), which reached 1.4-2.4 TB/s on the Llama-1B's small matrices and ~4.2 on the heads
# (tools/bench_gemv.py, H200, 2026-12-02). Filled by `tools/bench_gemv.py --dtype bf16
# --write-configs` (read at start-up through ENV_BF16_GEMV_CONFIGS, or committed here).
BF16_MAX_ROWS = 1  # the many-row reduction made 2+ rows compute-bound for 1-byte weights
# (BLOCK_M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, SPLIT_K)
# measured on an H200, 2026-12-03 (tools/bench_gemv.py --dtype bf16 --shapes llama-1b,llama-8b):
# the best tile beat cuBLAS on every shape, 1.03-1.42x (docs/performance-log.md)
BF16_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 3072, 2048): (4, 1024, 4, 1),
    (1, 2048, 2048): (2, 1024, 4, 1),
    (1, 16384, 2048): (2, 1024, 4, 1),
    (1, 2048, 8192): (2, 1024, 4, 1),
    (1, 128256, 2048): (2, 1024, 4, 1),
    (1, 6144, 4096): (2, 1024, 4, 1),
    (1, 4096, 4096): (8, 1024, 4, 1),
    (1, 28672, 4096): (2, 1024, 4, 1),
    (1, 4096, 14336): (8, 1024, 4, 1),
    (1, 128256, 4096): (2, 2048, 8, 1),
    # gpt-oss-20b's dense parts, measured on an H100, 2026-12-06 (--shapes gpt-oss-20b): cuBLAS /
    # best tile 1.05 (qkv), 1.47 (o), 3.89 (router), 1.07 (head); batch-1 decode +13%
    (1, 5120, 2880): (4, 1024, 4, 1),
    (1, 2880, 4096): (2, 2048, 4, 1),
    (1, 32, 2880): (1, 2048, 8, 1),
    (1, 201088, 2880): (1, 1024, 4, 1),
}
BF16_CUBLAS_FASTER: set[tuple[int, int, int]] = set()  # measured shapes where cuBLAS won
# shapes whose tile runs the tensor-core loop -> its num_stages
BF16_DOT: dict[tuple[int, int, int], int] = {}
ENV_BF16_GEMV = "TORCH_RUNNER_BF16_GEMV"  # auto (default) | on | off
ENV_BF16_GEMV_CONFIGS = "TORCH_RUNNER_BF16_GEMV_CONFIGS"  # a --write-configs JSON file
BF16_MODES = ("auto", "on", "off")


def pick_bf16_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """The bf16 table's tile for [m, k] @ [n, k].T, else a rule (unmeasured): 1024-column slices
    (16 bytes per thread, 2-14 slices a row at these K), 4 channels (8 past N = 8192) so the
    small matrices still give 512+ programs, 8 warps for the 8-channel tile, unsplit."""
    found = BF16_CONFIGS.get((block_rows(m), n, k))
    if found is not None:
        return found
    block_n = 4 if n <= 8192 else 8
    return block_n, min(1024, 1 << max(k - 1, 1).bit_length()), 4 if block_n == 4 else 8, 1


def set_bf16_configs(
    table: dict[tuple[int, int, int], tuple[int, int, int, int]],
    cublas_faster: set[tuple[int, int, int]] = frozenset(),
    dot: dict[tuple[int, int, int], int] | None = None,
) -> None:
    """Replace the bf16 table, the shapes where cuBLAS measured faster and those whose tile runs
    the tensor-core loop (with its num_stages): a sweep's result."""
    BF16_CONFIGS.clear()
    BF16_CONFIGS.update(table)
    BF16_CUBLAS_FASTER.clear()
    BF16_CUBLAS_FASTER.update(cublas_faster)
    BF16_DOT.clear()
    BF16_DOT.update(dot or {})


def read_bf16_configs(path: str) -> None:
    """Load tools/bench_gemv.py's --write-configs JSON: {"configs": [[[bm, n, k], [bn, bk,
    warps, split]], ...], "cublas_faster": [[bm, n, k], ...]} into the bf16 table."""
    with open(path) as f:
        data = json.load(f)
    set_bf16_configs({tuple(key): tuple(cfg) for key, cfg in data["configs"]},
                     {tuple(key) for key in data.get("cublas_faster", [])},
                     {tuple(key): stages for key, stages in data.get("dot", [])})  # fmt: skip


def bf16_gemv_mode() -> str:
    """The start-up switch, read once by ops/linear.py: ENV_BF16_GEMV "auto" (default) runs the
    GEMV for the shapes the table measured faster than cuBLAS, "on" for every one-row bf16 shape
    (the rule's tile where unmeasured), "off" never; ENV_BF16_GEMV_CONFIGS, when set, is a
    --write-configs file that replaces the table first."""
    value = env_choice(ENV_BF16_GEMV, "auto", BF16_MODES)
    path = os.environ.get(ENV_BF16_GEMV_CONFIGS)
    if path:
        read_bf16_configs(path)
    return value


def bf16_takes_dot(m: int, n: int, k: int) -> bool:
    """Whether a one-row bf16 GEMV of this shape runs the tensor-core loop (BF16_DOT)."""
    return (block_rows(m), n, k) in BF16_DOT


def bf16_takes_gemv(m: int, n: int, k: int, mode: str) -> bool:
    """Whether a bf16 product of `m` rows by an [n, k] weight runs the GEMV under `mode`."""
    if mode == "off" or m > BF16_MAX_ROWS:
        return False
    key = (block_rows(m), n, k)
    if mode == "on":
        return True
    return key in BF16_CONFIGS and key not in BF16_CUBLAS_FASTER
