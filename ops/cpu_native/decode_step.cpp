// One decode step of a pre-norm Llama-style decoder (fused q/k/v and gate/up, SiLU MLP, full
// attention, no q/k norm) as one torch op: per layer rms_norm -> qkv -> rope + K/V write +
// attention -> o_proj + residual -> rms_norm -> gate_up -> silu * up -> down_proj + residual, then
// the final norm. The same kernels in the same order as the flat decoder's per-op native calls
// (so the same bits), without ~10 Python-level op calls, allocations and argument parses a layer.
//
// weights: 14 per layer [ln1, qkv a, qkv b, qkv bias, o a, o b, o bias, ln2, gate_up a, b, bias,
// down a, b, bias] then the final norm; a linear's (a, b) is (weight, None) dense, (codes, scales)
// int8 (tiled: [N / 4, Kp / 32, 4, 32] codes), (qs, dm) int4, (tiles, None) packed dense,
// kinds[4 per layer] saying which (linear.h's Kind: 0 dense, 1 int8, 2 int4, 3 int8 holding -128
// codes, 4 packed dense, 5 / 6 tiled int8 without / with -128 codes); eps: 2 per layer + 1.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "linear.h"
#include "pointwise.h"

namespace {

using tr_native::Kind;
using tr_native::kBlock;
using tr_native::LinearRef;
constexpr int64_t kPerLayer = 14;

using Weights = c10::List<std::optional<at::Tensor>>;

at::Tensor need(const Weights& ws, int64_t i, const char* what) {
  const std::optional<at::Tensor> t = ws.get(i);
  TORCH_CHECK(t.has_value() && t->defined(), "decode_step: weights[", i, "] (", what, ") is None");
  return *t;
}

// A linear's fields from weights[at, at + 1], checked against [n?, k] (n < 0: any)
LinearRef linear_ref(const Weights& ws, int64_t at, int64_t kind, int64_t k, const char* what) {
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
    TORCH_CHECK(a.dim() == 4 && a.size(1) * 16 == k && a.size(2) == tr_native::kRows && a.size(3) == 16 &&
                    (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                "decode_step: ", what, " must be packed fp32 / bf16 [N / 4, ", k, " / 16, 4, 16]; got ",
                a.sizes());
    return {Kind::kDensePacked, a.data_ptr(), nullptr, a.scalar_type() == at::kBFloat16,
            n * tr_native::kRows, k};
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
    TORCH_CHECK(a.dim() == 4 && a.scalar_type() == at::kChar &&
                    a.size(1) == (k + kBlock - 1) / kBlock && a.size(2) == tr_native::kRows &&
                    a.size(3) == kBlock && b.numel() == n * tr_native::kRows &&
                    b.scalar_type() == at::kFloat,
                "decode_step: ", what, " tiled int8 codes must be [N / 4, ceil(", k,
                " / 32), 4, 32], fp32 scales [N]");
    return {static_cast<Kind>(kind), a.data_ptr(), b.data_ptr(), false, n * tr_native::kRows, k};
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

template <typename T>
const T* bias_of(const Weights& ws, int64_t at, int64_t n, at::ScalarType dtype, const char* what) {
  const std::optional<at::Tensor> t = ws.get(at);
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->numel() == n && t->scalar_type() == dtype,
              "decode_step: ", what, " bias must be contiguous [", n, "] of the activations' dtype");
  return static_cast<const T*>(t->data_ptr());
}

template <typename T>
void norm_into(const T* x, const at::Tensor& w, int64_t m, int64_t h, double eps, T* out) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == h &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "decode_step: a norm weight must be contiguous fp32 / bf16 [", h, "]");
  if (w.scalar_type() == at::kFloat) {
    tr_native::rms_rows(x, w.data_ptr<float>(), out, m, h, static_cast<float>(eps));
  } else {
    tr_native::rms_rows(x, w.data_ptr<c10::BFloat16>(), out, m, h, static_cast<float>(eps));
  }
}

template <typename T>
void run_step(T* h, int64_t b, int64_t hidden, const T* cos, const T* ssin, const Weights& ws,
              at::IntArrayRef kinds, at::ArrayRef<double> eps, at::TensorList pools_k,
              at::TensorList pools_v, const int64_t* write_slots, const int64_t* gather_slots,
              const int64_t* kv_lens, int64_t s_max, int64_t hq, int64_t hkv, double scale, T* out) {
  const int64_t layers = static_cast<int64_t>(pools_k.size()), dtype_size = sizeof(T);
  const at::ScalarType dtype = dtype_size == 4 ? at::kFloat : at::kBFloat16;
  const int64_t d = pools_k[0].size(2), width = (hq + 2 * hkv) * d;
  std::vector<T> xn(b * hidden), qkv(b * width), att(b * hq * d), gu, mixed;
  tr_native::Scratch scratch;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t at = l * kPerLayer;
    const at::Tensor &pk = pools_k[l], &pv = pools_v[l];
    TORCH_CHECK(pk.is_contiguous() && pv.is_contiguous() && pk.dim() == 3 && pk.size(1) == hkv &&
                    pk.size(2) == d && pk.sizes() == pv.sizes() && pk.scalar_type() == dtype &&
                    pv.scalar_type() == dtype,
                "decode_step: layer ", l, "'s pools must be contiguous [P, ", hkv, ", ", d,
                "] of the activations' dtype");
    const LinearRef qkv_w = linear_ref(ws, at + 1, kinds[4 * l], hidden, "qkv");
    const LinearRef o_w = linear_ref(ws, at + 4, kinds[4 * l + 1], hq * d, "o_proj");
    const LinearRef gu_w = linear_ref(ws, at + 8, kinds[4 * l + 2], hidden, "gate_up");
    TORCH_CHECK(qkv_w.n == width && o_w.n == hidden && gu_w.n % 2 == 0,
                "decode_step: layer ", l, " has a qkv / o_proj / gate_up of the wrong width");
    const int64_t inner = gu_w.n / 2;
    const LinearRef down_w = linear_ref(ws, at + 11, kinds[4 * l + 3], inner, "down_proj");
    TORCH_CHECK(down_w.n == hidden, "decode_step: layer ", l, "'s down_proj must give ", hidden);
    gu.resize(b * 2 * inner);
    mixed.resize(b * inner);

    norm_into(h, need(ws, at, "input_layernorm"), b, hidden, eps[2 * l], xn.data());
    tr_native::linear_into(qkv_w, xn.data(), b, bias_of<T>(ws, at + 3, width, dtype, "qkv"),
                           static_cast<const T*>(nullptr), qkv.data(), scratch);
    tr_native::decode_attention_rows(qkv.data(), b, width, cos, ssin, pk.data_ptr<T>(),
                                     pv.data_ptr<T>(), write_slots, gather_slots, kv_lens, s_max,
                                     hq, hkv, d, scale, att.data());
    tr_native::linear_into(o_w, att.data(), b, bias_of<T>(ws, at + 6, hidden, dtype, "o_proj"),
                           h, h, scratch);  // h += o_proj(att): each output reads its own h first
    norm_into(h, need(ws, at + 7, "post_attention_layernorm"), b, hidden, eps[2 * l + 1], xn.data());
    tr_native::linear_into(gu_w, xn.data(), b, bias_of<T>(ws, at + 10, 2 * inner, dtype, "gate_up"),
                           static_cast<const T*>(nullptr), gu.data(), scratch);
    tr_native::silu_mul_rows(gu.data(), mixed.data(), b, inner);
    tr_native::linear_into(down_w, mixed.data(), b,
                           bias_of<T>(ws, at + 13, hidden, dtype, "down_proj"), h, h, scratch);
  }
  norm_into(h, need(ws, layers * kPerLayer, "norm"), b, hidden, eps[2 * layers], out);
}

// h [B, H] (the embedded tokens; not modified) -> the final-norm hidden [B, H]; see the top
at::Tensor decode_step(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& ssin,
                       const Weights& weights, at::IntArrayRef kinds, at::ArrayRef<double> eps,
                       at::TensorList pools_k, at::TensorList pools_v, const at::Tensor& write_slots,
                       const at::Tensor& gather_slots, const at::Tensor& kv_lens, int64_t hq,
                       int64_t hkv, double scale) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() &&
                  (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
              "decode_step: h must be a contiguous fp32 / bf16 [B, H]; got ", h.sizes());
  const int64_t layers = static_cast<int64_t>(pools_k.size()), b = h.size(0);
  TORCH_CHECK(layers >= 1 && pools_v.size() == pools_k.size() &&
                  static_cast<int64_t>(weights.size()) == layers * kPerLayer + 1 &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers + 1,
              "decode_step: want one K and V pool per layer, ", kPerLayer,
              " weights per layer + 1, 4 kinds per layer and 2 eps per layer + 1; got ",
              pools_k.size(), " / ", pools_v.size(), " pools, ", weights.size(), " weights, ",
              kinds.size(), " kinds, ", eps.size(), " eps");
  const int64_t d = pools_k[0].size(2);
  TORCH_CHECK(d % 8 == 0 && hkv >= 1 && hq % hkv == 0, "decode_step: head_dim must be a multiple of 8"
              " and hq a multiple of hkv");
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
    run_step(hp, b, h.size(1), cos.data_ptr<T>(), ssin.data_ptr<T>(), weights, kinds, eps,
             pools_k, pools_v, write_slots.data_ptr<int64_t>(), gather_slots.data_ptr<int64_t>(),
             lens, s_max, hq, hkv, scale, out.data_ptr<T>());
  };
  if (h.scalar_type() == at::kFloat) {
    go(x.data_ptr<float>());
  } else {
    go(x.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_runner_native, m) {
  m.def(
      "decode_step(Tensor h, Tensor cos, Tensor ssin, Tensor?[] weights, int[] kinds, float[] eps, "
      "Tensor(a!)[] pools_k, Tensor(b!)[] pools_v, Tensor write_slots, Tensor gather_slots, "
      "Tensor kv_lens, int hq, int hkv, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) { m.impl("decode_step", &decode_step); }
