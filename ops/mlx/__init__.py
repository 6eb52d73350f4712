"""MLX variants of the ops, same signatures as the torch references; imported only when routed.

Each module has two layers:
- `*_mx` kernels: pure functions of mlx arrays (no torch, no crossing). They compose.
- torch-facing wrappers with the torch op's signature, each ONE `bridge.mlx_call` /
  `mlx_call_multi` crossing (one producer fence, one `mx.eval`).

MLX islands: a crossing costs a fence, an eval and (on CPU) a copy each way, so a caller that
runs several consecutive ops can compose the `*_mx` kernels inside ONE `mlx_call_multi`:

    from bridge import mlx_call_multi
    from ops.mlx.attention import sdpa_mx
    from ops.mlx.norm import rms_norm_mx
    from ops.mlx.rope import apply_rope_mx

    def attention_block(x, norm_w, wq, wk, wv, wo, positions, inv_freq):  # all mx arrays
        h = rms_norm_mx(x, norm_w, 1e-5)
        ...                                   # projections, apply_rope_mx, sdpa_mx, wo
        return (out,)

    (out,) = mlx_call_multi(attention_block, x, norm_w, wq, wk, wv, wo, positions, inv_freq)

`island(fn, *tensors)` below is that call. tools/bench_ops.py measures whether it pays
(docs/perf_sections/ops.md). This package imports mlx: import it only when MLX is on.
"""

from __future__ import annotations

from bridge import mlx_call_multi


def island(fn, *tensors, **kwargs):
    """Run `fn` (mlx arrays in, tuple of mlx arrays out) on torch tensors in ONE crossing."""
    return mlx_call_multi(fn, *tensors, **kwargs)
