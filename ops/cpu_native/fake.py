"""Fake (meta) impls of the native ops: shapes for torch.compile / the inductor-compiled step."""

from __future__ import annotations

import torch


def register() -> None:
    """Register the fake impls; build.native_ops calls it once the library has defined the ops
    (at import time they do not exist yet, so importing this module alone registers nothing)."""

    @torch.library.register_fake("torch_runner_native::dense_linear")
    def _dense(x, w, bias, residual):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("torch_runner_native::dense_packed_linear")
    def _dense_packed(x, w, bias, residual):
        return x.new_empty(x.shape[0], w.shape[0] * w.shape[2])

    @torch.library.register_fake("torch_runner_native::int8_linear")
    def _int8(x, qw, scales, k, bias, residual, full_range):
        return x.new_empty(x.shape[0], scales.shape[0])

    @torch.library.register_fake("torch_runner_native::int4_linear")
    def _int4(x, qs, dm, bias, residual):
        return x.new_empty(x.shape[0], qs.shape[0])

    @torch.library.register_fake("torch_runner_native::quantize_q8")
    def _quantize(x):
        kp = -(-x.shape[1] // 32) * 32
        return (
            x.new_empty(x.shape[0], kp, dtype=torch.int8),
            x.new_empty(x.shape[0], kp // 32, dtype=torch.float32),
            x.new_empty(x.shape[0], kp // 32, dtype=torch.float32),
        )

    @torch.library.register_fake("torch_runner_native::rms_norm")
    def _rms_norm(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("torch_runner_native::silu_mul")
    def _silu_mul(gu):
        return gu.new_empty(gu.shape[0], gu.shape[1] // 2)

    @torch.library.register_fake("torch_runner_native::decode_attention")
    def _decode_attention(qkv, cos, ssin, pool_k, pool_v, write_slots, gather_slots, kv_lens, hq,
                          hkv, scale):  # fmt: skip
        return qkv.new_empty(qkv.shape[0], hq * pool_k.shape[2])

    @torch.library.register_fake("torch_runner_native::decode_step")
    def _decode_step(h, cos, ssin, weights, kinds, eps, pools_k, pools_v, write_slots, gather_slots,
                     kv_lens, hq, hkv, scale):  # fmt: skip
        return torch.empty_like(h)

    @torch.library.register_fake("torch_runner_native::greedy_pick")
    def _greedy_pick(x):
        return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], dtype=torch.bool)

    @torch.library.register_fake("torch_runner_native::split_linear")
    def _split_linear(x, hi, lo, bias, residual):
        return x.new_empty(x.shape[0], hi.shape[0] * hi.shape[2])

    @torch.library.register_fake("torch_runner_native::split_greedy")
    def _split_greedy(x, hi, lo, err, vocab, wmax):
        return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], dtype=torch.bool)
