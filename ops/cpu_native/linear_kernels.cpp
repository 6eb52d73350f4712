// The batch-1 linear kernels of linear.h as torch ops (torch.ops.torch_runner_native.*): argument
// checks, the output tensor, and a dispatch on the activation dtype (fp32 or bf16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "linear.h"

namespace {

using tr_native::Kind;
using tr_native::kBlock;
using tr_native::LinearRef;

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous 2-D CPU tensor [M, K]; got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x dtype must be float32 or bfloat16; got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, op, ": x has K=", x.size(1), ", the weight takes K=", k);
}

void check_extra(const std::optional<at::Tensor>& t, const at::Tensor& x, at::IntArrayRef shape,
                 const char* name) {
  if (!t) return;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->sizes() == shape,
              name, ": must be contiguous, of x's dtype ", x.scalar_type(), " and shape ", shape,
              "; got ", t->scalar_type(), " ", t->sizes());
}

// out = x @ W.T (+ bias) (+ residual) in x's dtype
at::Tensor run(const LinearRef& lw, const at::Tensor& x, const std::optional<at::Tensor>& bias,
               const std::optional<at::Tensor>& residual) {
  const int64_t m = x.size(0);
  check_extra(bias, x, {lw.n}, "bias");
  check_extra(residual, x, {m, lw.n}, "residual");
  at::Tensor out = at::empty({m, lw.n}, x.options());
  tr_native::Scratch scratch;
  auto go = [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    const T* bp = bias ? static_cast<const T*>(bias->data_ptr()) : nullptr;
    const T* rp = residual ? static_cast<const T*>(residual->data_ptr()) : nullptr;
    tr_native::linear_into(lw, xp, m, bp, rp, static_cast<T*>(out.data_ptr()), scratch);
  };
  if (x.scalar_type() == at::kFloat) {
    go(x.data_ptr<float>());
  } else {
    go(x.data_ptr<c10::BFloat16>());
  }
  return out;
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dense_linear: weight must be contiguous [N, K]");
  check_x(x, w.size(1), "dense_linear");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "dense_linear: weight dtype must be float32 or bfloat16; got ", w.scalar_type());
  const LinearRef lw{Kind::kDense, w.data_ptr(), nullptr, w.scalar_type() == at::kBFloat16,
                     w.size(0), w.size(1)};
  return run(lw, x, bias, residual);
}

// w: the packed tiling [N / 4, K / 16, 4, 16] of an fp32 / bf16 [N, K] weight (linear.h)
at::Tensor dense_packed_linear(const at::Tensor& x, const at::Tensor& w,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == tr_native::kRows && w.size(3) == 16 && w.is_contiguous(),
              "dense_packed_linear: weight must be contiguous [N / 4, K / 16, 4, 16]; got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "dense_packed_linear: weight dtype must be float32 or bfloat16; got ", w.scalar_type());
  const int64_t n = w.size(0) * tr_native::kRows, k = w.size(1) * 16;
  check_x(x, k, "dense_packed_linear");
  const LinearRef lw{Kind::kDensePacked, w.data_ptr(), nullptr, w.scalar_type() == at::kBFloat16, n, k};
  return run(lw, x, bias, residual);
}

// qw: int8 codes [N, Kp] or their tiling [N / 4, Kp / 32, 4, 32] (linear.h's int8_dot kTiled)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                       int64_t k, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, bool full_range) {
  const bool tiled = qw.dim() == 4;
  const int64_t kp = (k + kBlock - 1) / kBlock * kBlock;
  const int64_t n = tiled ? qw.size(0) * tr_native::kRows : qw.size(0);
  const bool fits = tiled ? qw.size(1) * kBlock == kp && qw.size(2) == tr_native::kRows &&
                                qw.size(3) == kBlock
                          : qw.dim() == 2 && qw.size(1) == kp;
  TORCH_CHECK(fits && qw.is_contiguous() && qw.scalar_type() == at::kChar,
              "int8_linear: qweight must be contiguous int8 [N, ceil(K / 32) * 32] or its tiling "
              "[N / 4, ceil(K / 32), 4, 32]; got ", qw.sizes(), " for K=", k);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == n,
              "int8_linear: scales must be float32 [N]");
  check_x(x, k, "int8_linear");
  const Kind kind = tiled ? (full_range ? Kind::kInt8FullTiled : Kind::kInt8Tiled)
                          : (full_range ? Kind::kInt8Full : Kind::kInt8);
  return run({kind, qw.data_ptr(), scales.data_ptr(), false, n, k}, x, bias, residual);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.is_contiguous() && qs.scalar_type() == at::kByte,
              "int4_linear: qs must be contiguous uint8 [N, K / 32, 16]; got ", qs.sizes());
  const int64_t n = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf &&
                  dm.sizes() == at::IntArrayRef({n, 2, nb}),
              "int4_linear: dm must be contiguous float16 [N, 2, K / 32]; got ", dm.sizes());
  check_x(x, nb * kBlock, "int4_linear");
  return run({Kind::kInt4, qs.data_ptr(), dm.data_ptr(), false, n, nb * kBlock}, x, bias, residual);
}

// x [M, K] -> (codes int8 [M, Kp], d [M, Kp / 32], d * sum(codes) [M, Kp / 32]): the tests' view
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  check_x(x, x.size(1), "quantize_q8");
  tr_native::Scratch q;
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    tr_native::quantize_rows(x.data_ptr<float>(), m, k, q);
  } else {
    tr_native::quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, q);
  }
  at::Tensor codes = at::empty({m, q.kp}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, q.nb}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({m, q.nb}, x.options().dtype(at::kFloat));
  std::copy(q.q.begin(), q.q.end(), codes.data_ptr<int8_t>());
  std::copy(q.d.begin(), q.d.end(), d.data_ptr<float>());
  std::copy(q.s.begin(), q.s.end(), s.data_ptr<float>());
  return {codes, d, s};
}

}  // namespace

TORCH_LIBRARY(torch_runner_native, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("dense_packed_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qw, Tensor scales, int k, Tensor? bias, Tensor? residual, "
        "bool full_range) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qs, Tensor dm, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) {
  m.impl("dense_linear", &dense_linear);
  m.impl("dense_packed_linear", &dense_packed_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("quantize_q8", &quantize_q8);
}
