"""Rotary position embeddings: frequency init from an HF config, and application at positions.

Why our own init instead of calling transformers: ops must stay importable and correct without
a model object, and the tests check these formulas against transformers' ROPE_INIT_FUNCTIONS so a
change upstream shows up as a failure instead of a silent drift. Layout is HF's rotate_half
(first half / second half of the rotary dims), which gpt-oss's chunked form equals.
"""

from __future__ import annotations

import math

import torch

from ops.fused import kernels_for

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_params(config, layer_type: str | None) -> dict:
    standardize = getattr(config, "standardize_rope_params", None)
    if callable(standardize):
        standardize()
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    if "rope_theta" not in params:
        theta = getattr(config, "rope_theta", None) or getattr(config, "default_theta", None)
        if theta is None:
            raise ValueError("rope_init: config.rope_parameters has no 'rope_theta'")
        params = {**params, "rope_theta": theta}
    return params


def _yarn(params: dict, base: float, dim: int, config) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if m and m_all:
            attention_factor = float(mscale(factor, m) / mscale(factor, m_all))
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # share of each frequency kept unscaled
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention_factor


def _llama3(params: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = params["factor"]
    low_ff, high_ff = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_init(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [D_rot / 2] fp32, attention_scaling) for an HF PretrainedConfig.

    Reads `config.rope_parameters` (transformers 5): rope_theta, rope_type in ROPE_TYPES,
    factor, ..., partial_rotary_factor. `layer_type` selects a per-layer-type entry (Gemma 3 keeps
    {"full_attention": {...}, "sliding_attention": {...}}).
    """
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_init: rope_parameters.rope_type={rope_type!r} is not supported; "
            f"allowed values: {', '.join(ROPE_TYPES)}"
        )
    base = float(params["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type == "yarn":
        return _yarn(params, base, dim, config)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(params, inv_freq)
    return inv_freq, 1.0


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, N, D_rot] in `dtype` for absolute positions [B, N] (HF's rotary forward)."""
    freqs = positions[..., None].float() * inv_freq.to(
        positions.device, torch.float32
    )  # [B, N, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, N, D_rot]
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [B, N, 1, D_rot] for q/k laid out [B, N, H, D]; see `rotate`.

    Built once per forward and shared by every layer of one rope kind (computing cos/sin in
    each layer was 2 x num_layers extra trig kernels per step). Same values as `rope_cos_sin`;
    the first half of `sin` is negated so the rotation needs no `neg` + `cat` per tensor.
    """
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling, dtype)  # [B, 1, N, D_rot]
    half = sin.shape[-1] // 2
    sign = torch.ones(sin.shape[-1], dtype=dtype, device=sin.device)
    sign[:half] = -1
    return cos.transpose(1, 2), (sin * sign).transpose(1, 2)  # [B, N, 1, D_rot]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, N, H, D] by `rope_tables` output; bit-identical to `apply_rope`.

    rotate_half(x) * sin = [-x2, x1] * [s, s] = [x2, x1] * [-s, s], and [x2, x1] is one flip
    of the two halves; -x2 * s == x2 * -s exactly, so no value changes.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    swapped = x_rot.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)  # [x2, x1]
    out = x_rot * cos + swapped * signed_sin
    return out if x_pass is None else torch.cat([out, x_pass], dim=-1)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    """One decode token per row: rotate q and k of qkv [T, Hq + 2 Hkv, D] by the `rope_tables`
    rows cos / signed_sin [T, D_rot], store k and v into the paged pool k_pool / v_pool
    [slots, Hkv, D] at `slots` [T], return the rotated q [T, Hq, D].

    The torch composition (`rotate`, then `index_copy_`) is the reference and the path off
    CUDA; on CUDA it is one Triton kernel (ops/fused) with the same values: it replaces rope's
    four kernels, the k/v copies and the two pool writes of every layer.
    """
    t, heads, d = qkv.shape
    hkv = (heads - num_q_heads) // 2
    if heads != num_q_heads + 2 * hkv or k_pool.shape[1:] != (hkv, d):
        raise ValueError(
            f"rope_kv_write: qkv [T, Hq + 2 Hkv, D] = {tuple(qkv.shape)} with Hq={num_q_heads} "
            f"does not match the pool's [slots, Hkv, D] = {tuple(k_pool.shape)}"
        )
    kernels = kernels_for(qkv)
    if kernels is not None:
        return kernels.rope_kv_write(qkv, cos, signed_sin, k_pool, v_pool, slots, num_q_heads)
    qk = rotate(qkv[:, None, : num_q_heads + hkv], cos[:, None, None], signed_sin[:, None, None])
    k_pool.index_copy_(0, slots, qk[:, 0, num_q_heads:])
    v_pool.index_copy_(0, slots, qkv[:, num_q_heads + hkv :])
    return qk[:, 0, :num_q_heads]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass is None else torch.cat([out, x_pass], dim=-1)


def check_rope_positions(q: torch.Tensor, positions: torch.Tensor) -> None:
    """Reject positions that are not [B, N] for q [B, H, N, D] (shared with the MLX rope)."""
    if tuple(positions.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"apply_rope: positions must be [B, N] = {(q.shape[0], q.shape[2])}; "
            f"got {tuple(positions.shape)}"
        )


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, N, D] and k [B, Hkv, N, D] at absolute positions [B, N].

    Only the first 2 * len(inv_freq) dims rotate (partial rotary); math in q's dtype, as HF does.
    """
    check_rope_positions(q, positions)
    if 2 * inv_freq.shape[-1] > q.shape[-1]:
        raise ValueError(
            f"apply_rope: inv_freq has {inv_freq.shape[-1]} entries, more than head_dim/2 = "
            f"{q.shape[-1] // 2}"
        )
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
