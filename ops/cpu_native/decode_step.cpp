// One decode step of a pre-norm Llama-style decoder (fused q/k/v and gate/up, SiLU MLP, full
// attention, no q/k norm) as one torch op: per layer rms_norm -> qkv -> rope + K/V write +
// attention -> o_proj + residual -> rms_norm -> gate_up -> silu * up -> down_proj + residual, then
// the final norm. The same kernels in the same order as the flat decoder's per-op native calls
// (so the same bits), without ~10 Python-level op calls, allocations and argument parses a layer.
// The weights' layout: decode_plan.h. Two entry points: the decode_step op (checks and resolves
// the weights every call), and DecodePlan (once; its run takes only the step's tensors).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "decode_plan.h"
#include "pointwise.h"

namespace {

using tr_native::LayerPlan;
using tr_native::StepPlan;

template <typename T>
void norm_into(const T* x, const at::Tensor& w, int64_t m, int64_t h, double eps, T* out) {
  if (w.scalar_type() == at::kFloat) {
    tr_native::rms_rows(x, w.data_ptr<float>(), out, m, h, static_cast<float>(eps));
  } else {
    tr_native::rms_rows(x, w.data_ptr<c10::BFloat16>(), out, m, h, static_cast<float>(eps));
  }
}

template <typename T>
const T* bias(const LayerPlan& lp, int i) {
  return lp.bias[i].defined() ? static_cast<const T*>(lp.bias[i].data_ptr()) : nullptr;
}

template <typename T>
void run_step(const StepPlan& plan, T* h, int64_t b, const T* cos, const T* ssin,
              const int64_t* write_slots, const int64_t* gather_slots, const int64_t* kv_lens,
              int64_t s_max, T* out) {
  const int64_t hidden = plan.hidden, hq = plan.hq, hkv = plan.hkv, d = plan.d;
  const int64_t width = (hq + 2 * hkv) * d;
  std::vector<T> xn(b * hidden), qkv(b * width), att(b * hq * d), gu, mixed;
  tr_native::Scratch scratch;
  for (const LayerPlan& lp : plan.layers) {
    const int64_t inner = lp.linears[2].n / 2;
    gu.resize(b * 2 * inner);
    mixed.resize(b * inner);
    norm_into(h, lp.ln1, b, hidden, lp.eps1, xn.data());
    tr_native::linear_into(lp.linears[0], xn.data(), b, bias<T>(lp, 0), static_cast<const T*>(nullptr),
                           qkv.data(), scratch);
    tr_native::decode_attention_rows(qkv.data(), b, width, cos, ssin, lp.pool_k.data_ptr<T>(),
                                     lp.pool_v.data_ptr<T>(), write_slots, gather_slots, kv_lens,
                                     s_max, hq, hkv, d, plan.scale, att.data());
    // h += o_proj(att): each output reads its own h first
    tr_native::linear_into(lp.linears[1], att.data(), b, bias<T>(lp, 1), h, h, scratch);
    norm_into(h, lp.ln2, b, hidden, lp.eps2, xn.data());
    tr_native::linear_into(lp.linears[2], xn.data(), b, bias<T>(lp, 2), static_cast<const T*>(nullptr),
                           gu.data(), scratch);
    tr_native::silu_mul_rows(gu.data(), mixed.data(), b, inner);
    tr_native::linear_into(lp.linears[3], mixed.data(), b, bias<T>(lp, 3), h, h, scratch);
  }
  norm_into(h, plan.norm, b, hidden, plan.eps, out);
}

// h [B, H] (the embedded tokens; not modified) -> the final-norm hidden [B, H]; see the top
at::Tensor run_plan(const StepPlan& plan, const at::Tensor& h, const at::Tensor& cos,
                    const at::Tensor& ssin, const at::Tensor& write_slots,
                    const at::Tensor& gather_slots, const at::Tensor& kv_lens) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == plan.hidden &&
                  (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
              "decode_step: h must be a contiguous fp32 / bf16 [B, ", plan.hidden, "]; got ", h.sizes());
  TORCH_CHECK(!plan.act || *plan.act == h.scalar_type(),
              "decode_step: h must be of the pools' and biases' dtype");
  const int64_t b = h.size(0), d = plan.d;
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == b * d &&
                  ssin.numel() == b * d && cos.scalar_type() == h.scalar_type() &&
                  ssin.scalar_type() == h.scalar_type(),
              "decode_step: cos / sin must be contiguous [B, D] of h's dtype");
  for (const at::Tensor* t : {&write_slots, &gather_slots, &kv_lens}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "decode_step: slots and lengths must be contiguous int64");
  }
  TORCH_CHECK(write_slots.numel() == b && kv_lens.numel() == b && b >= 1 &&
                  gather_slots.numel() % b == 0,
              "decode_step: one write slot and length per row, [B, S] gather slots");
  const int64_t s_max = gather_slots.numel() / b;
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= s_max, "decode_step: kv_len out of range");
  }
  at::Tensor x = h.clone(), out = at::empty_like(h);
  auto go = [&](auto* hp) {
    using T = std::remove_pointer_t<decltype(hp)>;
    run_step(plan, hp, b, cos.data_ptr<T>(), ssin.data_ptr<T>(), write_slots.data_ptr<int64_t>(),
             gather_slots.data_ptr<int64_t>(), lens, s_max, out.data_ptr<T>());
  };
  if (h.scalar_type() == at::kFloat) {
    go(x.data_ptr<float>());
  } else {
    go(x.data_ptr<c10::BFloat16>());
  }
  return out;
}

at::Tensor decode_step(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& ssin,
                       const tr_native::Weights& weights, at::IntArrayRef kinds,
                       at::ArrayRef<double> eps, at::TensorList pools_k, at::TensorList pools_v,
                       const at::Tensor& write_slots, const at::Tensor& gather_slots,
                       const at::Tensor& kv_lens, int64_t hq, int64_t hkv, double scale) {
  const StepPlan plan = tr_native::make_plan(weights, kinds, eps, pools_k, pools_v, hq, hkv, scale);
  return run_plan(plan, h, cos, ssin, write_slots, gather_slots, kv_lens);
}

// The plan kept between steps (it holds its weights and pools alive)
struct DecodePlan : torch::CustomClassHolder {
  StepPlan plan;
  DecodePlan(const tr_native::Weights& weights, std::vector<int64_t> kinds, std::vector<double> eps,
             std::vector<at::Tensor> pools_k, std::vector<at::Tensor> pools_v, int64_t hq,
             int64_t hkv, double scale)
      : plan(tr_native::make_plan(weights, kinds, eps, pools_k, pools_v, hq, hkv, scale)) {}
  at::Tensor run(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& ssin,
                 const at::Tensor& write_slots, const at::Tensor& gather_slots,
                 const at::Tensor& kv_lens) {
    return run_plan(plan, h, cos, ssin, write_slots, gather_slots, kv_lens);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_runner_native, m) {
  m.def(
      "decode_step(Tensor h, Tensor cos, Tensor ssin, Tensor?[] weights, int[] kinds, float[] eps, "
      "Tensor(a!)[] pools_k, Tensor(b!)[] pools_v, Tensor write_slots, Tensor gather_slots, "
      "Tensor kv_lens, int hq, int hkv, float scale) -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<const tr_native::Weights&, std::vector<int64_t>, std::vector<double>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, double>())
      .def("run", &DecodePlan::run);
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) { m.impl("decode_step", &decode_step); }
