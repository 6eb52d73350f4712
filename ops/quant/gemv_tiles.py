"""The GEMV's tiles and where it runs (ops/quant/gemv_triton.py), as data: no triton import, so
the choice is testable where Triton is absent (CI).

Measured on one H200 (2026-12-02, tools/bench_fp8_linear.py --rows 1,2,4,8: `do_bench` medians
with the L2 cleared before each call; docs/performance-log.md): for every projection of the
Llama-3.2-1B / 3.1-8B geometries and each row bucket, the fastest of the sweep's tiles, and the
shapes where `_scaled_mm` (activations quantized to e4m3, tensor cores) beat the best tile.
At one row the GEMV won every shape (1.03-1.5x faster than bf16 F.linear, 1.06-8.9x faster than
`_scaled_mm`); from 2 rows its per-slice reduction makes the wide shapes compute-bound (2 rows
cost ~1.9x one on the heads), and at 4-8 rows `_scaled_mm` wins most of them.
"""

from __future__ import annotations

MAX_ROWS = 8  # BLOCK_M: the kernel keeps every row's accumulator in registers
UNMEASURED_MAX_ROWS = 1  # fp8 shapes not in the table take the GEMV up to this many rows
# (BLOCK_M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, SPLIT_K), H200, 2026-12-02
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 3072, 2048): (4, 1024, 8, 1), (1, 2048, 2048): (4, 1024, 8, 1),
    (1, 16384, 2048): (8, 256, 4, 1), (1, 2048, 8192): (8, 1024, 8, 1),
    (1, 128256, 2048): (8, 256, 4, 1), (1, 6144, 4096): (8, 256, 4, 1),
    (1, 4096, 4096): (8, 512, 8, 1), (1, 28672, 4096): (4, 512, 4, 1),
    (1, 4096, 14336): (4, 1024, 8, 1), (1, 128256, 4096): (8, 256, 4, 1),
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


def block_rows(m: int) -> int:
    """The BLOCK_M a batch of `m` rows compiles for (a power of two, 1..MAX_ROWS)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows; got {m}")
    return 1 << (m - 1).bit_length()


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT_K) for an [m, k] @ [n, k].T product: the measured
    table, else 8 (16 for wide N) channels by 512-byte slices, 4 warps, unsplit (split-K won no
    measured shape at one row)."""
    found = CONFIGS.get((block_rows(m), n, k))
    if found is not None:
        return found
    return (8 if n <= 8192 else 16), min(512, 1 << max(k - 1, 1).bit_length()), 4, 1


def set_configs(table: dict[tuple[int, int, int], tuple[int, int, int, int]]) -> None:
    """Replace the tile table (a benchmark's sweep result); shapes not in it take the rule."""
    CONFIGS.clear()
    CONFIGS.update(table)


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
