// A decode step's fixed arguments, checked and resolved once (decode_step.cpp runs them): per layer
// the four linears' LinearRefs, norm weights, biases and eps, and the layer's K / V pools. Made
// per call by the decode_step op, or once by a DecodePlan object, whose run then takes only the
// step's tensors: passing ~480 tensors from Python cost ~0.3 ms a step (SmolLM2, 2-core EPYC).
//
// weights: 14 per layer [ln1, qkv a, qkv b, qkv bias, o a, o b, o bias, ln2, gate_up a, b, bias,
// down a, b, bias] then the final norm; a linear's (a, b) is (weight, None) dense, (codes, scales)
// int8 (tiled: [N / 4, Kp / 32, 4, 32] codes), (qs, dm) int4, (tiles, None) packed dense,
// kinds[4 per layer] saying which (linear.h's Kind: 0 dense, 1 int8, 2 int4, 3 int8 holding -128
// codes, 4 packed dense, 5 / 6 tiled int8 without / with -128 codes); eps: 2 per layer + 1.
#pragma once
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "linear.h"

namespace tr_native {

constexpr int64_t kPerLayer = 14;
using Weights = c10::List<std::optional<at::Tensor>>;

struct LayerPlan {
  at::Tensor ln1, ln2, bias[4];  // bias: qkv, o_proj, gate_up, down_proj (undefined: none)
  LinearRef linears[4];          // the same order
  double eps1, eps2;
  at::Tensor pool_k, pool_v;     // [P, Hkv, D]
};

struct StepPlan {
  std::vector<LayerPlan> layers;
  at::Tensor norm;
  double eps;
  int64_t hidden, hq, hkv, d;
  double scale;
  std::optional<at::ScalarType> act;  // the activations' dtype the biases and pools fix, if any
  std::vector<at::Tensor> keep;       // every weight: the LinearRefs point into them
};

inline at::Tensor need(const Weights& ws, int64_t i, const char* what) {
  const std::optional<at::Tensor> t = ws.get(i);
  TORCH_CHECK(t.has_value() && t->defined(), "decode_step: weights[", i, "] (", what, ") is None");
  return *t;
}

// A linear's fields from weights[at, at + 1], checked against [n?, k]
inline LinearRef linear_ref(const Weights& ws, int64_t at, int64_t kind, int64_t k, const char* what) {
  const at::Tensor a = need(ws, at, what);
  TORCH_CHECK(a.is_contiguous(), "decode_step: ", what, " weight must be contiguous");
  const int64_t n = a.size(0);
  if (kind == static_cast<int64_t>(Kind::kDense)) {
    TORCH_CHECK(a.dim() == 2 && a.size(1) == k &&
                    (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                "decode_step: ", what, " must be fp32 / bf16 [N, ", k, "]; got ", a.sizes());
    return {Kind::kDense, a.data_ptr(), nullptr, a.scalar_type() == at::kBFloat16, n, k};
  }
  if (kind == static_cast<int64_t>(Kind::kDensePacked)) {
    TORCH_CHECK(a.dim() == 4 && a.size(1) * 16 == k && a.size(2) == kRows && a.size(3) == 16 &&
                    (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                "decode_step: ", what, " must be packed fp32 / bf16 [N / 4, ", k, " / 16, 4, 16]; got ",
                a.sizes());
    return {Kind::kDensePacked, a.data_ptr(), nullptr, a.scalar_type() == at::kBFloat16, n * kRows, k};
  }
  const at::Tensor b = need(ws, at + 1, what);
  TORCH_CHECK(b.is_contiguous(), "decode_step: ", what, " scales must be contiguous");
  if (kind == static_cast<int64_t>(Kind::kInt8) || kind == static_cast<int64_t>(Kind::kInt8Full)) {
    TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kChar &&
                    a.size(1) == (k + kBlock - 1) / kBlock * kBlock && b.numel() == n &&
                    b.scalar_type() == at::kFloat,
                "decode_step: ", what, " int8 codes must be [N, ceil(", k, " / 32) * 32], fp32 scales [N]");
    return {static_cast<Kind>(kind), a.data_ptr(), b.data_ptr(), false, n, k};
  }
  if (kind == static_cast<int64_t>(Kind::kInt8Tiled) ||
      kind == static_cast<int64_t>(Kind::kInt8FullTiled)) {
    TORCH_CHECK(a.dim() == 4 && a.scalar_type() == at::kChar && a.size(1) == (k + kBlock - 1) / kBlock &&
                    a.size(2) == kRows && a.size(3) == kBlock && b.numel() == n * kRows &&
                    b.scalar_type() == at::kFloat,
                "decode_step: ", what, " tiled int8 codes must be [N / 4, ceil(", k,
                " / 32), 4, 32], fp32 scales [N]");
    return {static_cast<Kind>(kind), a.data_ptr(), b.data_ptr(), false, n * kRows, k};
  }
  TORCH_CHECK(kind == static_cast<int64_t>(Kind::kInt4), "decode_step: kind of ", what,
              " must be 0 (dense), 1 (int8), 2 (int4), 3 (int8 with -128 codes), 4 (packed dense), 5 / 6 "
              "(tiled int8, without / with -128 codes); got ", kind);
  TORCH_CHECK(a.dim() == 3 && a.scalar_type() == at::kByte && a.size(1) * kBlock == k &&
                  a.size(2) == 16 && b.scalar_type() == at::kHalf &&
                  b.sizes() == at::IntArrayRef({n, 2, a.size(1)}),
              "decode_step: ", what, " int4 must be qs uint8 [N, ", k, " / 32, 16], dm fp16 [N, 2, K / 32]");
  return {Kind::kInt4, a.data_ptr(), b.data_ptr(), false, n, k};
}

// Every check that does not depend on the step's tensors, once
inline StepPlan make_plan(const Weights& ws, at::IntArrayRef kinds, at::ArrayRef<double> eps,
                          at::TensorList pools_k, at::TensorList pools_v, int64_t hq, int64_t hkv,
                          double scale) {
  const int64_t layers = static_cast<int64_t>(pools_k.size());
  TORCH_CHECK(layers >= 1 && pools_v.size() == pools_k.size() &&
                  static_cast<int64_t>(ws.size()) == layers * kPerLayer + 1 &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers + 1,
              "decode_step: want one K and V pool per layer, ", kPerLayer,
              " weights per layer + 1, 4 kinds per layer and 2 eps per layer + 1; got ",
              pools_k.size(), " / ", pools_v.size(), " pools, ", ws.size(), " weights, ",
              kinds.size(), " kinds, ", eps.size(), " eps");
  const int64_t d = pools_k[0].size(-1);
  TORCH_CHECK(d % 8 == 0 && hkv >= 1 && hq % hkv == 0, "decode_step: head_dim must be a multiple of 8"
              " and hq a multiple of hkv");
  StepPlan plan;
  plan.hidden = need(ws, layers * kPerLayer, "norm").numel();  // the final norm's size: H
  plan.hq = hq, plan.hkv = hkv, plan.d = d, plan.scale = scale, plan.eps = eps[2 * layers];
  const int64_t hidden = plan.hidden, width = (hq + 2 * hkv) * d;
  auto fix_act = [&](const at::Tensor& t, const char* what) {  // one activation dtype for all
    TORCH_CHECK(!plan.act || *plan.act == t.scalar_type(), "decode_step: ", what,
                " must be of the activations' dtype, as every bias and pool");
    plan.act = t.scalar_type();
  };
  auto norm_weight = [&](int64_t at, const char* what) {
    at::Tensor w = need(ws, at, what);
    TORCH_CHECK(w.is_contiguous() && w.numel() == hidden &&
                    (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
                "decode_step: a norm weight must be contiguous fp32 / bf16 [", hidden, "]");
    return w;
  };
  plan.norm = norm_weight(layers * kPerLayer, "norm");
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t at = l * kPerLayer;
    const at::Tensor &pk = pools_k[l], &pv = pools_v[l];
    TORCH_CHECK(pk.is_contiguous() && pv.is_contiguous() && pk.dim() == 3 && pk.size(1) == hkv &&
                    pk.size(2) == d && pk.sizes() == pv.sizes() && pk.scalar_type() == pv.scalar_type(),
                "decode_step: layer ", l, "'s pools must be contiguous [P, ", hkv, ", ", d,
                "] of the activations' dtype");
    fix_act(pk, "every pool");
    LayerPlan lp;
    lp.ln1 = norm_weight(at, "input_layernorm");
    lp.ln2 = norm_weight(at + 7, "post_attention_layernorm");
    lp.eps1 = eps[2 * l], lp.eps2 = eps[2 * l + 1];
    lp.pool_k = pk, lp.pool_v = pv;
    lp.linears[0] = linear_ref(ws, at + 1, kinds[4 * l], hidden, "qkv");
    lp.linears[1] = linear_ref(ws, at + 4, kinds[4 * l + 1], hq * d, "o_proj");
    lp.linears[2] = linear_ref(ws, at + 8, kinds[4 * l + 2], hidden, "gate_up");
    TORCH_CHECK(lp.linears[0].n == width && lp.linears[1].n == hidden && lp.linears[2].n % 2 == 0,
                "decode_step: layer ", l, " has a qkv / o_proj / gate_up of the wrong width");
    const int64_t inner = lp.linears[2].n / 2;
    lp.linears[3] = linear_ref(ws, at + 11, kinds[4 * l + 3], inner, "down_proj");
    TORCH_CHECK(lp.linears[3].n == hidden, "decode_step: layer ", l, "'s down_proj must give ", hidden);
    const int64_t bias_at[4] = {at + 3, at + 6, at + 10, at + 13};
    for (int i = 0; i < 4; ++i) {
      const std::optional<at::Tensor> t = ws.get(bias_at[i]);
      if (!t.has_value() || !t->defined()) continue;
      TORCH_CHECK(t->is_contiguous() && t->numel() == lp.linears[i].n,
                  "decode_step: layer ", l, "'s bias ", i, " must be contiguous [", lp.linears[i].n,
                  "] of the activations' dtype");
      fix_act(*t, "every bias");
      lp.bias[i] = *t;
    }
    plan.layers.push_back(std::move(lp));
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::optional<at::Tensor> t = ws.get(i);
    if (t.has_value() && t->defined()) plan.keep.push_back(*t);
  }
  return plan;
}

}  // namespace tr_native
