// Linear layers: the skinny bf16/fp32 GEMV, FP8 weights, and the AMX GEMM ops.

#include "common.h"
#include "amx.h"
#include "ops.h"

namespace llm_cpu {

namespace {

// ---------------------------------------------------------------- skinny GEMM
// y[M, N] = x[M, K] @ w[N, K]^T for the few rows of a decode step. The step
// is bound by reading the weights once, so the loop streams w row by row
// (four rows at a time, split across threads by output channel) and keeps x,
// a few KB, in L1. With AVX512-BF16 the dot products are vdpbf16ps on bf16
// pairs; elsewhere plain loops that gcc vectorizes (bf16 widened to fp32).
constexpr int64_t kRowBlock = 4;

template <typename T>
void gemv_rows_generic(const T* x, const T* w, T* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const T* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += to_f(xr[k]) * to_f(wr[k]);
      y[m * N + n] = from_f<T>(acc);
    }
  }
}

#ifdef LLM_HAVE_AVX512BF16
inline __m512bh load_bh(const BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

void gemv_rows_bf16(const BFloat16* x, const BFloat16* w, BFloat16* y, int64_t M, int64_t N,
                    int64_t K, int64_t n0, int64_t n1) {
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : static_cast<__mmask32>((1ull << (K - full)) - 1);
  int64_t n = n0;
  for (; n + kRowBlock <= n1; n += kRowBlock) {
    const BFloat16* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const BFloat16* xr = x + m * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t k = 0; k < full; k += 32) {
        if (m == 0) {  // the next row block, while this one is being used
          const char* pf = reinterpret_cast<const char*>(w0 + kRowBlock * K + k);
          _mm_prefetch(pf, _MM_HINT_T0);
          _mm_prefetch(pf + K * 2, _MM_HINT_T0);
          _mm_prefetch(pf + K * 4, _MM_HINT_T0);
          _mm_prefetch(pf + K * 6, _MM_HINT_T0);
        }
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
        a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(w0 + k));
        a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(w0 + K + k));
        a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(w0 + 2 * K + k));
        a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(w0 + 3 * K + k));
      }
      if (tail) {
        const __m512bh xv = load_bh(xr + full, tail);
        a0 = _mm512_dpbf16_ps(a0, xv, load_bh(w0 + full, tail));
        a1 = _mm512_dpbf16_ps(a1, xv, load_bh(w0 + K + full, tail));
        a2 = _mm512_dpbf16_ps(a2, xv, load_bh(w0 + 2 * K + full, tail));
        a3 = _mm512_dpbf16_ps(a3, xv, load_bh(w0 + 3 * K + full, tail));
      }
      BFloat16* yr = y + m * N + n;
      yr[0] = from_f<BFloat16>(_mm512_reduce_add_ps(a0));
      yr[1] = from_f<BFloat16>(_mm512_reduce_add_ps(a1));
      yr[2] = from_f<BFloat16>(_mm512_reduce_add_ps(a2));
      yr[3] = from_f<BFloat16>(_mm512_reduce_add_ps(a3));
    }
  }
  gemv_rows_generic(x, w, y, M, N, K, n, n1);
}
#endif

template <typename T>
void gemv_rows(const T* x, const T* w, T* y, int64_t M, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  gemv_rows_generic(x, w, y, M, N, K, n0, n1);
}

#ifdef LLM_HAVE_AVX512BF16
template <>
void gemv_rows<BFloat16>(const BFloat16* x, const BFloat16* w, BFloat16* y, int64_t M,
                         int64_t N, int64_t K, int64_t n0, int64_t n1) {
  gemv_rows_bf16(x, w, y, M, N, K, n0, n1);
}
#endif

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(float_or_bf16(x) && w.scalar_type() == x.scalar_type() && x.dim() == 2 &&
                  w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: x [M, K] and w [N, K] must share K and a dtype (float32/bfloat16)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // at least ~64 KB of weights per task, in whole row blocks
  const int64_t grain = std::max<int64_t>(kRowBlock, (65536 / (K * w.element_size())) / kRowBlock * kRowBlock);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "skinny_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, grain / kRowBlock,
                     [&](int64_t b, int64_t e) {
      const int64_t n0 = b * kRowBlock, n1 = std::min(N, e * kRowBlock);
      gemv_rows(xp, wp, yp, M, N, K, n0, n1);
    });
  });
  return y;
}

// ---------------------------------------------------------------- FP8 weights
// The per-row scale is applied by the caller (y = (x @ q^T) * s).
// y[M, N] = x[M, K] @ e4m3(w)[N, K]^T, fp32, each weight row decoded once.
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& w) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && x.dim() == 2 &&
                  w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) <= 65536,
              "fp8_gemv: x must be float32 [M, K] and w uint8 (e4m3 bits) [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = wp + n * K;
      for (int64_t k = 0; k < K; ++k) row[k] = e4m3_to_f32(wr[k]);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * row[k];
        yp[m * N + n] = acc;
      }
    }
  });
  return y;
}

// out[N, K] (bf16) = e4m3(w), exact: e4m3 has 3 mantissa bits.
void fp8_dequant_bf16(const at::Tensor& w, at::Tensor out) {
  check_cpu(w, "w");
  check_cpu(out, "out");
  TORCH_CHECK(w.scalar_type() == at::kByte && out.scalar_type() == at::kBFloat16 &&
                  w.sizes() == out.sizes(),
              "fp8_dequant_bf16: w must be uint8 (e4m3 bits) and out bfloat16 of its shape");
  const int64_t N = w.size(0), K = w.numel() / std::max<int64_t>(N, 1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t i = n0 * K; i < n1 * K; ++i) {
      const float f = e4m3_to_f32(wp[i]);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      op[i] = static_cast<uint16_t>(bits >> 16);
    }
  });
}

namespace {

bool amx_shape_ok(int64_t N, int64_t K) { return N % 32 == 0 && K % 32 == 0 && K > 0; }

}  // namespace

bool amx_available() {
#ifdef LLM_HAVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 -> [N / 16, K / 32, 16, 32] bf16 in tile order (see above)
at::Tensor amx_pack(const at::Tensor& w) {
  check_cpu(w, "w");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 &&
                  amx_shape_ok(w.size(0), w.size(1)),
              "amx_pack: w must be bfloat16 [N, K] with N and K multiples of 32");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({N / 16, K / 32, 16, 32}, w.options());
  const BFloat16* src = w.data_ptr<BFloat16>();
  BFloat16* dst = out.data_ptr<BFloat16>();
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        BFloat16* tile = dst + (nb * (K / 32) + kb) * 512;
        for (int64_t kp = 0; kp < 16; ++kp) {
          for (int64_t n = 0; n < 16; ++n) {
            for (int64_t j = 0; j < 2; ++j) {
              tile[kp * 32 + n * 2 + j] = src[(nb * 16 + n) * K + kb * 32 + 2 * kp + j];
            }
          }
        }
      }
    }
  });
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU (or kernel) does not allow AMX");
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_linear: packed must come from amx_pack");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "amx_linear: x must be bfloat16 [M, ", K, "]");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef LLM_HAVE_AMX
  const BFloat16* xp = x.data_ptr<BFloat16>();
  const BFloat16* pp = packed.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
    amx_gemm_panels(xp, pp, yp, M, N, K, p0, p1);
  });
#endif
  return y;
}

}  // namespace llm_cpu
