// RMSNorm, add + RMSNorm (residual updated in place) and SiLU-and-mul.

#include "common.h"
#include "ops.h"

namespace llm_cpu {

namespace {

// ---------------------------------------------------------------- RMSNorm
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(x[i]) * r * to_f(w[i]));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(float_or_bf16(x) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight must both be float32 or both bfloat16");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, (float)eps);
    });
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_cpu(x, "x");
  check_cpu(residual, "residual");
  check_cpu(weight, "weight");
  TORCH_CHECK(float_or_bf16(x) && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, residual and weight must share one dtype (float32 or bfloat16)");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* rr = rp + r * n;
        const scalar_t* xr = xp + r * n;
        for (int64_t i = 0; i < n; ++i) rr[i] = from_f<scalar_t>(to_f(rr[i]) + to_f(xr[i]));
        rms_row(rr, wp, op + r * n, n, (float)eps);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------- SwiGLU
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(float_or_bf16(x), "silu_and_mul: x must be float32 or bfloat16");
  const int64_t n2 = x.size(-1), n = n2 / 2, rows = x.numel() / n2;
  TORCH_CHECK(n2 % 2 == 0, "silu_and_mul: last dimension must be even");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = xp + r * n2;
        const scalar_t* u = g + n;
        scalar_t* o = op + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const float gv = to_f(g[i]);
          const float e = fast_exp(-std::fabs(gv));  // sigmoid without overflow
          const float sig = (gv >= 0.f ? 1.f : e) / (1.f + e);
          o[i] = from_f<scalar_t>(gv * sig * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace llm_cpu
