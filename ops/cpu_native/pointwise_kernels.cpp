// The small ops of pointwise.h as torch ops (torch.ops.torch_runner_native.*): rms_norm, silu_mul
// and decode_attention, with their argument checks. Each replaces 5-25 aten ops of a few us each.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "pointwise.h"

namespace {

using tr_native::rms_rows;
using tr_native::silu_mul_rows;

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous 2-D CPU tensor; got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16; got ", x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t m = x.size(0), h = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.size(0) == h &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "rms_norm: weight must be contiguous float32 / bfloat16 [", h, "]; got ",
              w.scalar_type(), " ", w.sizes());
  at::Tensor out = at::empty_like(x);
  const float e = static_cast<float>(eps);
  const bool w32 = w.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) {
    if (w32) rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), m, h, e);
    else rms_rows(x.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), m, h, e);
  } else {
    using B = c10::BFloat16;
    if (w32) rms_rows(x.data_ptr<B>(), w.data_ptr<float>(), out.data_ptr<B>(), m, h, e);
    else rms_rows(x.data_ptr<B>(), w.data_ptr<B>(), out.data_ptr<B>(), m, h, e);
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gate_up must have an even width; got ", gu.size(1));
  const int64_t m = gu.size(0), inner = gu.size(1) / 2;
  at::Tensor out = at::empty({m, inner}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_rows(gu.data_ptr<float>(), out.data_ptr<float>(), m, inner);
  } else {
    silu_mul_rows(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), m, inner);
  }
  return out;
}

// qkv [B, (Hq + 2 Hkv) D] (one token per row), cos / ssin [B, D], pools [P, Hkv, D] (written),
// write_slots [B], gather_slots [B, S] (row i's keys: its first kv_lens[i]) -> [B, Hq D]
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& ssin,
                            at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& write_slots,
                            const at::Tensor& gather_slots, const at::Tensor& kv_lens, int64_t hq,
                            int64_t hkv, double scale) {
  check_rows(qkv, "decode_attention");
  const int64_t b = qkv.size(0), d = pool_k.size(2);
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous() && pool_k.dim() == 3 &&
                  pool_k.size(1) == hkv && pool_k.sizes() == pool_v.sizes() &&
                  pool_k.scalar_type() == qkv.scalar_type() && d % 8 == 0 && hq % hkv == 0,
              "decode_attention: pools must be contiguous [P, ", hkv, ", D] of qkv's dtype, D % 8 == 0");
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "decode_attention: qkv must be [B, (Hq + 2 Hkv) D]");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == b * d &&
                  ssin.numel() == b * d && cos.scalar_type() == qkv.scalar_type() &&
                  ssin.scalar_type() == qkv.scalar_type(),
              "decode_attention: cos / sin must be contiguous [B, D] of qkv's dtype");
  for (const at::Tensor* t : {&write_slots, &gather_slots, &kv_lens}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "decode_attention: slots and lengths must be contiguous int64");
  }
  TORCH_CHECK(write_slots.numel() == b && kv_lens.numel() == b && gather_slots.numel() % b == 0,
              "decode_attention: one write slot and length per row, [B, S] gather slots");
  const int64_t s_max = gather_slots.numel() / b;
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= s_max, "decode_attention: kv_len out of range");
  }
  at::Tensor out = at::empty({b, hq * d}, qkv.options());
  auto go = [&](auto* x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    tr_native::decode_attention_rows(x, b, qkv.size(1), cos.data_ptr<T>(), ssin.data_ptr<T>(),
                                     pool_k.data_ptr<T>(), pool_v.data_ptr<T>(),
                                     write_slots.data_ptr<int64_t>(), gather_slots.data_ptr<int64_t>(),
                                     lens, s_max, hq, hkv, d, scale, out.data_ptr<T>());
  };
  if (qkv.scalar_type() == at::kFloat) {
    go(qkv.data_ptr<float>());
  } else {
    go(qkv.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_runner_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor ssin, Tensor(a!) pool_k, Tensor(b!) pool_v, "
      "Tensor write_slots, Tensor gather_slots, Tensor kv_lens, int hq, int hkv, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
}
