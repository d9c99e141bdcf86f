// CPU operators of the native engine, registered as torch ops (torch.ops.llm_cpu.*).
//
// Every parallel loop runs on torch's own thread pool through at::parallel_for,
// so there is one pool and no oversubscription. All math is fp32; tensors come
// in fp32 or bf16 (the weight dtype the engine picked for this CPU) and the KV
// cache is fp32 or bf16. Loops are plain C++ written so that gcc vectorizes
// them for whatever ISA the machine has (-march=native: AVX2 or AVX-512).
//
// Layouts:
//   qkv        [T, (H + 2 * Hkv) * D]   fused projection output, one row a token
//   cos, sin   [max_pos, D / 2] fp32     RoPE tables ("rotate half" layout)
//   k/v cache  [num_blocks, block_size, Hkv, D]; slot = block * block_size + offset
//   block_tables [B, max_blocks] int64, context_lens [B] int64
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LLM_HAVE_AVX512 1
#if defined(__AVX512BF16__)
#define LLM_HAVE_AVX512BF16 1
#endif
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::BFloat16;
using Float8 = c10::Float8_e4m3fn;
constexpr float kFp8Max = 448.f;

// exp(x) for x <= 0 to ~2 ulp, branch-free so loops over it vectorize (libm's
// expf does not without -ffast-math): 2^(x*log2e) split into integer and
// fraction, a degree-6 polynomial for 2^f, the integer put in the exponent.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t e = static_cast<int32_t>(fi) + 127;
  float scale;
  const int32_t bits = e << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}

// e4m3 bytes -> fp32 without a table: for a normal value the 7 magnitude bits
// shifted into the fp32 exponent/mantissa, plus a bias of (127 - 7) in the
// exponent, are the exact value; a subnormal is m * 2^-9. Branch-free, so the
// loops vectorize.
inline float e4m3_to_f32(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const uint32_t bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float sub = static_cast<float>(mag & 7u) * (1.0f / 512.0f);
  const float v = (mag >> 3) ? normal : sub;
  return (b & 0x80u) ? -v : v;
}

// an FP8 KV cache read in registers (values are clamped to +-448 when
// written, so the e4m3 NaN pattern never occurs)
template <>
inline float to_f<Float8>(Float8 v) {
  return e4m3_to_f32(v.x);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

bool kv_cache_type(const at::Tensor& t) {
  return float_or_bf16(t) || t.scalar_type() == at::kFloat8_e4m3fn;
}

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

// ---------------------------------------------------------------- RoPE + KV write
// Returns fp32 [T, H + 2 * Hkv, D]: q and k rotated, v copied. When caches are
// given (fp32, bf16, or e4m3 with per-head scales), also writes each token's k
// and v at its slot (FP8: divided by the head's scale, clamped to +-448, then
// rounded to nearest even like torch's cast).
template <typename C>
inline C to_cache(float v, float inv_scale) {
  if constexpr (std::is_same_v<C, Float8>) {
    return Float8(std::min(std::max(v * inv_scale, -kFp8Max), kFp8Max));
  } else {
    return from_f<C>(v);
  }
}

template <typename T, typename C, typename O>
void rotary_rows(const T* qkv, const float* cos, const float* sin, const int64_t* pos,
                 const int64_t* slots, C* kc, C* vc, const float* k_inv, const float* v_inv,
                 O* out, int64_t t0, int64_t t1, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t half = D / 2, heads = H + 2 * Hkv, row = heads * D;
  std::vector<float> buf(static_cast<size_t>(row));  // one row in fp32, then out and the cache
  float* dst = buf.data();
  for (int64_t t = t0; t < t1; ++t) {
    const T* src = qkv + t * row;
    const float* c = cos + pos[t] * half;
    const float* s = sin + pos[t] * half;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const T* x = src + h * D;
      float* y = dst + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
    for (int64_t i = (H + Hkv) * D; i < row; ++i) dst[i] = to_f(src[i]);
    O* o = out + t * row;
    for (int64_t i = 0; i < row; ++i) o[i] = from_f<O>(dst[i]);
    if (kc != nullptr) {
      C* kd = kc + slots[t] * Hkv * D;
      C* vd = vc + slots[t] * Hkv * D;
      const float* ks = dst + H * D;
      const float* vs = dst + (H + Hkv) * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float ki = k_inv ? k_inv[h] : 1.f, vi = v_inv ? v_inv[h] : 1.f;
        for (int64_t i = h * D; i < (h + 1) * D; ++i) {
          kd[i] = to_cache<C>(ks[i], ki);
          vd[i] = to_cache<C>(vs[i], vi);
        }
      }
    }
  }
}

at::Tensor rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slot_mapping,
                      const std::optional<at::Tensor>& k_cache,
                      const std::optional<at::Tensor>& v_cache, int64_t num_heads,
                      int64_t num_kv_heads, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale,
                      std::optional<at::ScalarType> out_dtype) {
  check_cpu(qkv, "qkv");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  check_cpu(positions, "positions");
  check_cpu(slot_mapping, "slot_mapping");
  TORCH_CHECK(float_or_bf16(qkv), "rotary_qkv: qkv must be float32 or bfloat16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_qkv: cos/sin tables must be float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "rotary_qkv: positions and slot_mapping must be int64");
  const int64_t T = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  const int64_t D = qkv.size(1) / heads;
  TORCH_CHECK(D * heads == qkv.size(1) && D % 2 == 0 && cos.size(1) * 2 == D,
              "rotary_qkv: qkv width does not match the head counts and the RoPE table");
  const bool write = k_cache.has_value() && v_cache.has_value();
  if (write) {
    check_cpu(*k_cache, "k_cache");
    check_cpu(*v_cache, "v_cache");
    TORCH_CHECK(k_cache->scalar_type() == v_cache->scalar_type() && kv_cache_type(*k_cache),
                "rotary_qkv: caches must be float32, bfloat16 or float8_e4m3fn");
  }
  const bool fp8 = write && k_cache->scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "rotary_qkv: k_scale and v_scale are required for, and only for, an FP8 cache");
  at::Tensor k_inv, v_inv;
  if (fp8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->numel() == num_kv_heads &&
                    v_scale->scalar_type() == at::kFloat && v_scale->numel() == num_kv_heads,
                "rotary_qkv: k_scale and v_scale must be float32 [Hkv]");
    k_inv = k_scale->reciprocal().contiguous();
    v_inv = v_scale->reciprocal().contiguous();
  }
  const float* kip = fp8 ? k_inv.data_ptr<float>() : nullptr;
  const float* vip = fp8 ? v_inv.data_ptr<float>() : nullptr;
  const auto odt = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(odt == at::kFloat || odt == at::kBFloat16,
              "rotary_qkv: out_dtype must be float32 or bfloat16");
  auto out = at::empty({T, heads, D}, qkv.options().dtype(odt));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* slp = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rotary_qkv", [&] {
    using T_ = scalar_t;
    const T_* xp = qkv.data_ptr<T_>();
    auto run = [&](auto* kc, auto* vc) {
      at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
        if (odt == at::kFloat) {
          rotary_rows(xp, cp, sp, pp, slp, kc, vc, kip, vip, out.data_ptr<float>(), b, e,
                      num_heads, num_kv_heads, D);
        } else {
          rotary_rows(xp, cp, sp, pp, slp, kc, vc, kip, vip, out.data_ptr<BFloat16>(), b, e,
                      num_heads, num_kv_heads, D);
        }
      });
    };
    if (!write) {
      run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    } else if (k_cache->scalar_type() == at::kFloat) {
      run(k_cache->data_ptr<float>(), v_cache->data_ptr<float>());
    } else if (k_cache->scalar_type() == at::kBFloat16) {
      run(k_cache->data_ptr<BFloat16>(), v_cache->data_ptr<BFloat16>());
    } else {
      run(k_cache->data_ptr<Float8>(), v_cache->data_ptr<Float8>());
    }
  });
  return out;
}

// ---------------------------------------------------------------- decode attention
// One work item per (sequence, KV head): the item's G = H / Hkv query heads
// share every K/V row it reads. Blocks are read through the block table with
// an online softmax (running max and sum per head), so nothing is gathered or
// allocated per token. Each K/V row is widened to fp32 once (from fp32, bf16
// or e4m3) and then serves all G heads. An FP8 cache's per-head scales are
// folded in: k's into the softmax scale, v's into the final normalization.
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlock = 256;

// Every cache line of [p, p + bytes) into L1, ahead of use; with a second range
// (a block's V beside its K), the two are asked for line by line, interleaved.
inline void prefetch_bytes(const void* p, int64_t bytes, const void* q = nullptr) {
  const char* a = static_cast<const char*>(p);
  const char* b = static_cast<const char*>(q);
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(a + off, 0, 3);
    if (b != nullptr) __builtin_prefetch(b + off, 0, 3);
  }
}

// Asks for the rows of one head in the next block while this block computes:
// the hardware prefetcher does not follow a block table, and without this the
// kernel waits on memory for most of a long context.
template <typename C>
inline void prefetch_block_rows(const C* k, const C* v, int64_t rows, int64_t stride,
                                int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
  for (int64_t t = 0; t < rows; ++t) prefetch_bytes(k + t * stride, row_bytes, v + t * stride);
}

// Walks one sequence's KV head block by block through its block table:
// body(k_rows, v_rows, n) gets the block's first K and V row of the head and
// its n valid rows (row stride ``stride``); the next block's rows are
// prefetched before the body runs. Both decode kernels iterate through this.
template <typename C, typename Body>
inline __attribute__((always_inline)) void for_each_kv_block(
    const C* kc, const C* vc, const int64_t* bt, int64_t ctx, int64_t bs, int64_t stride,
    int64_t head_offset, int64_t D, Body&& body) {
  const int64_t nblk = (ctx + bs - 1) / bs;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    if (blk + 1 < nblk) {
      const int64_t next = bt[blk + 1] * bs * stride + head_offset;
      prefetch_block_rows(kc + next, vc + next, bs, stride, D);
    }
    const int64_t at = bt[blk] * bs * stride + head_offset;
    body(kc + at, vc + at, std::min(bs, ctx - blk * bs));
  }
}

// kD > 0 fixes the head dimension at compile time (fully unrolled, no loop
// tails: 2-3x faster for the common 64 and 128); kD == 0 takes it at run time.
// kG > 0 likewise fixes the query heads per KV head, so the G accumulators
// stay in registers across a block.
template <int64_t kD, int64_t kG, typename C, typename O>
void decode_item(const float* q, const C* kc, const C* vc, const int64_t* bt, int64_t ctx,
                 O* out, int64_t kvh, int64_t G_, int64_t Hkv, int64_t D_, int64_t bs,
                 float scale, float v_scale) {
  const int64_t D = kD > 0 ? kD : D_;
  const int64_t G = kG > 0 ? kG : G_;
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  alignas(64) float s[kMaxGroup][kMaxBlock];
  alignas(64) float row[kMaxHeadDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -1e30f;  // finite: fast_exp clamps, no inf - inf
    l[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  const int64_t stride = Hkv * D;
  for_each_kv_block(kc, vc, bt, ctx, bs, stride, kvh * D, D,
                    [&](const C* kb, const C* vb, int64_t n) {
    for (int64_t t = 0; t < n; ++t) {
      const C* kr = kb + t * stride;
      for (int64_t d = 0; d < D; ++d) row[d] = to_f(kr[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
        s[g][t] = dot * scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float bm = m[g];
      for (int64_t t = 0; t < n; ++t) bm = std::max(bm, s[g][t]);
      const float corr = fast_exp(m[g] - bm);
      m[g] = bm;
      l[g] *= corr;
      for (int64_t d = 0; d < D; ++d) acc[g][d] *= corr;
      for (int64_t t = 0; t < n; ++t) {
        const float p = fast_exp(s[g][t] - bm);
        s[g][t] = p;
        l[g] += p;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* vr = vb + t * stride;
      for (int64_t d = 0; d < D; ++d) row[d] = to_f(vr[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g][t];
        float* a = acc[g];
        for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
      }
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? v_scale / l[g] : 0.f;
    O* o = out + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = from_f<O>(acc[g][d] * inv);
  }
}

#ifdef LLM_HAVE_AVX512
// The same attention with AVX-512 intrinsics for fp32, bf16 and e4m3 caches, 16
// tokens at a time: the 16 q.k products of a head are reduced together by a
// transpose-and-add tree (four shuffle levels for 16 scores instead of 16
// horizontal sums), the block's softmax runs on one vector per head, and V is
// accumulated in registers. bf16 widens to fp32 by a shift, so the math is the
// generic kernel's (fp32 throughout).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e4m3 -> fp32, 16 at a time, as e4m3_to_f32 does it: a normal value is its 7
// magnitude bits shifted into place plus the exponent bias (127 - 7); a
// subnormal (exponent 0) is m * 2^-9. No fp32 subnormal is ever formed (those
// take a microcode assist per instruction).
inline __m512 load16(const Float8* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(7))),
                                   _mm512_set1_ps(1.0f / 512.0f));
  const __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)),
                                        normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// lane i of the result = the sum of the 16 lanes of v[i]
inline __m512 sum16x16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// fast_exp on 16 lanes (same polynomial); scalef puts in the integer part
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, fi);
}

// The online-softmax state of one KV head's kG query heads.
template <int64_t kD, int64_t kG>
struct HeadState {
  static constexpr int64_t kV = kD / 16;
  __m512 qv[kG][kV], acc[kG][kV];
  float m[kG], l[kG];

  void init(const float* q, float scale) {
    for (int64_t g = 0; g < kG; ++g) {
      m[g] = -1e30f;
      l[g] = 0.f;
      for (int64_t d = 0; d < kV; ++d) {
        qv[g][d] = _mm512_mul_ps(_mm512_loadu_ps(q + g * kD + 16 * d), _mm512_set1_ps(scale));
        acc[g][d] = _mm512_setzero_ps();
      }
    }
  }

  // the n_blk rows of one block (row stride ``stride``) starting at kb / vb
  template <typename C>
  inline __attribute__((always_inline)) void block(const C* kb, const C* vb, int64_t n_blk,
                                                   int64_t stride) {
    alignas(64) float p[kG][16];
    for (int64_t t0 = 0; t0 < n_blk; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, n_blk - t0);
      const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      __m512 prod[kG][16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t < n) {
          const C* kr = kb + (t0 + t) * stride;
          __m512 kv[kV];
          for (int64_t d = 0; d < kV; ++d) kv[d] = load16(kr + 16 * d);
          for (int64_t g = 0; g < kG; ++g) {
            __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int64_t d = 1; d < kV; ++d) a = _mm512_fmadd_ps(qv[g][d], kv[d], a);
            prod[g][t] = a;
          }
        } else {
          for (int64_t g = 0; g < kG; ++g) prod[g][t] = _mm512_setzero_ps();
        }
      }
      for (int64_t g = 0; g < kG; ++g) {
        const __m512 s =
            _mm512_mask_blend_ps(valid, _mm512_set1_ps(-1e30f), sum16x16(prod[g]));
        const float bm = std::max(m[g], _mm512_reduce_max_ps(s));
        const float corr = fast_exp(m[g] - bm);
        m[g] = bm;
        const __m512 pg =
            _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(s, _mm512_set1_ps(bm))));
        l[g] = l[g] * corr + _mm512_reduce_add_ps(pg);
        const __m512 cv = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < kV; ++d) acc[g][d] = _mm512_mul_ps(acc[g][d], cv);
        _mm512_store_ps(p[g], pg);
      }
      for (int64_t t = 0; t < n; ++t) {
        const C* vr = vb + (t0 + t) * stride;
        __m512 vv[kV];
        for (int64_t d = 0; d < kV; ++d) vv[d] = load16(vr + 16 * d);
        for (int64_t g = 0; g < kG; ++g) {
          const __m512 pb = _mm512_set1_ps(p[g][t]);
          for (int64_t d = 0; d < kV; ++d) acc[g][d] = _mm512_fmadd_ps(pb, vv[d], acc[g][d]);
        }
      }
    }
  }

  template <typename O>
  void finish(O* out, float v_scale) const {
    for (int64_t g = 0; g < kG; ++g) {
      const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? v_scale / l[g] : 0.f);
      alignas(64) float row[kD];
      for (int64_t d = 0; d < kV; ++d) _mm512_store_ps(row + 16 * d, _mm512_mul_ps(acc[g][d], inv));
      O* o = out + g * kD;
      for (int64_t d = 0; d < kD; ++d) o[d] = from_f<O>(row[d]);
    }
  }
};

template <int64_t kD, int64_t kG, typename C, typename O>
void decode_item_avx512(const float* q, const C* kc, const C* vc, const int64_t* bt,
                        int64_t ctx, O* out, int64_t kvh, int64_t Hkv, int64_t bs, float scale,
                        float v_scale) {
  static_assert(kD % 16 == 0 && kG > 0, "decode_item_avx512: D a multiple of 16, G fixed");
  HeadState<kD, kG> st;
  st.init(q, scale);
  const int64_t stride = Hkv * kD;
  for_each_kv_block(kc, vc, bt, ctx, bs, stride, kvh * kD, kD,
                    [&](const C* kb, const C* vb, int64_t n_blk) { st.block(kb, vb, n_blk, stride); });
  st.finish(out, v_scale);
}

// All KV heads of one sequence in one pass over its blocks: a block's rows
// (every head side by side, bs * Hkv * kD values) are read front to back once
// and the next block is prefetched whole, where one item per (sequence, head)
// reads a third of every row's cache lines per pass (measured: ~18 GB/s of
// cache read against ~26 GB/s streamed). The heads' states live on the stack.
constexpr int64_t kMaxSeqKvHeads = 8;
constexpr int64_t kSeqPrefetchBlocks = 1;

template <int64_t kD, int64_t kG, typename C, typename O>
void decode_seq_avx512(const float* q, const C* kc, const C* vc, const int64_t* bt, int64_t ctx,
                       O* out, int64_t Hkv, int64_t bs, float sc, const float* k_scale,
                       const float* v_scale) {
  HeadState<kD, kG> st[kMaxSeqKvHeads];
  for (int64_t h = 0; h < Hkv; ++h) st[h].init(q + h * kG * kD, k_scale ? sc * k_scale[h] : sc);
  const int64_t stride = Hkv * kD;
  const int64_t nblk = (ctx + bs - 1) / bs;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    if (blk + kSeqPrefetchBlocks < nblk) {
      const int64_t next = bt[blk + kSeqPrefetchBlocks] * bs * stride;
      const int64_t block_bytes = bs * stride * static_cast<int64_t>(sizeof(C));
      prefetch_bytes(kc + next, block_bytes, vc + next);  // the whole block: every head
    }
    const int64_t at = bt[blk] * bs * stride;
    const int64_t n = std::min(bs, ctx - blk * bs);
    for (int64_t h = 0; h < Hkv; ++h) st[h].block(kc + at + h * kD, vc + at + h * kD, n, stride);
  }
  for (int64_t h = 0; h < Hkv; ++h) {
    st[h].finish(out + h * kG * kD, v_scale ? v_scale[h] : 1.f);
  }
}
#endif

template <typename C, typename O>
void decode_all(const float* qp, int64_t q_stride, const C* kc, const C* vc, const int64_t* btp,
                int64_t max_blocks, const int64_t* clp, O* op, int64_t B, int64_t H,
                int64_t Hkv, int64_t D, int64_t bs, float sc, const float* k_scale,
                const float* v_scale) {
  const int64_t G = H / Hkv;
#ifdef LLM_HAVE_AVX512
  // enough sequences to keep every thread busy: one item per sequence
  if (D == 64 && G == 3 && Hkv <= kMaxSeqKvHeads && B >= 2 * at::get_num_threads()) {
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t e0) {
      for (int64_t b = b0; b < e0; ++b) {
        decode_seq_avx512<64, 3>(qp + b * q_stride, kc, vc, btp + b * max_blocks, clp[b],
                                 op + b * H * D, Hkv, bs, sc, k_scale, v_scale);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t it = b0; it < e0; ++it) {
      const int64_t b = it / Hkv, kvh = it % Hkv;
      const float* qi = qp + b * q_stride + kvh * G * D;
      O* oi = op + b * H * D + kvh * G * D;
      const int64_t* bti = btp + b * max_blocks;
      const float ks = k_scale ? sc * k_scale[kvh] : sc;
      const float vs = v_scale ? v_scale[kvh] : 1.f;
#ifdef LLM_HAVE_AVX512
      {  // fp32, bf16 and e4m3 caches alike (load16 widens each)
        if (D == 64 && G == 3) {  // SmolLM2-135M
          decode_item_avx512<64, 3>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
          continue;
        }
        if (D == 64 && G == 4) {
          decode_item_avx512<64, 4>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
          continue;
        }
        if (D == 128 && G == 4) {  // Llama-3 8B
          decode_item_avx512<128, 4>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
          continue;
        }
      }
#endif
      if (D == 64 && G == 3) {
        decode_item<64, 3>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      } else if (D == 64 && G == 4) {
        decode_item<64, 4>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      } else if (D == 64) {
        decode_item<64, 0>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      } else if (D == 128 && G == 4) {  // Llama-3 8B
        decode_item<128, 4>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      } else if (D == 128) {
        decode_item<128, 0>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      } else {
        decode_item<0, 0>(qi, kc, vc, bti, clp[b], oi, kvh, G, Hkv, D, bs, ks, vs);
      }
    }
  });
}

// q [B, H, D] fp32 (any row stride); returns [B, H * D] in out_dtype. An FP8
// (e4m3) cache needs k_scale and v_scale [Hkv]; other caches take none.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  at::ScalarType out_dtype,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode_attention: q must be float32 [B, H, D] with contiguous heads");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(block_tables, "block_tables");
  check_cpu(context_lens, "context_lens");
  TORCH_CHECK(kv_cache_type(k_cache) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: caches must be float32, bfloat16 or float8_e4m3fn");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "paged_decode_attention: out_dtype must be float32 or bfloat16");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  TORCH_CHECK(H % Hkv == 0 && G <= kMaxGroup && D <= kMaxHeadDim && bs <= kMaxBlock &&
                  k_cache.size(3) == D,
              "paged_decode_attention: unsupported shape (heads ", H, ", kv heads ", Hkv,
              ", head_dim ", D, ", block_size ", bs, ")");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "paged_decode_attention: k_scale and v_scale are required for, and only for, "
              "a float8_e4m3fn cache");
  const float* ksp = nullptr;
  const float* vsp = nullptr;
  if (fp8) {
    check_cpu(*k_scale, "k_scale");
    check_cpu(*v_scale, "v_scale");
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->numel() == Hkv &&
                    v_scale->scalar_type() == at::kFloat && v_scale->numel() == Hkv,
                "paged_decode_attention: k_scale and v_scale must be float32 [Hkv]");
    ksp = k_scale->data_ptr<float>();
    vsp = v_scale->data_ptr<float>();
  }
  auto out = at::empty({B, H * D}, q.options().dtype(out_dtype));
  const float* qp = q.data_ptr<float>();
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* clp = context_lens.data_ptr<int64_t>();
  const int64_t mb = block_tables.size(1), qs = q.stride(0);
  const float sc = static_cast<float>(scale);
  auto with_out = [&](const auto* kc, const auto* vc) {
    if (out_dtype == at::kFloat) {
      decode_all(qp, qs, kc, vc, btp, mb, clp, out.data_ptr<float>(), B, H, Hkv, D, bs, sc, ksp,
                 vsp);
    } else {
      decode_all(qp, qs, kc, vc, btp, mb, clp, out.data_ptr<BFloat16>(), B, H, Hkv, D, bs, sc,
                 ksp, vsp);
    }
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      with_out(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
      break;
    case at::kBFloat16:
      with_out(k_cache.data_ptr<BFloat16>(), v_cache.data_ptr<BFloat16>());
      break;
    default:
      with_out(k_cache.data_ptr<Float8>(), v_cache.data_ptr<Float8>());
  }
  return out;
}

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

// ---------------------------------------------------------------- greedy pick
// Index of the first maximum of each row of fp32 logits [N, V] (torch.argmax's
// tie rule): a vectorized max, then the first position holding it.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [N, V] with V > 0");
  const int64_t n = logits.size(0), v = logits.size(1);
  auto out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = lp + r * v;
      float part[16];  // 16 running maxima: a reduction gcc vectorizes
      for (int64_t j = 0; j < 16; ++j) part[j] = row[0];
      int64_t i = 0;
      for (; i + 16 <= v; i += 16)
        for (int64_t j = 0; j < 16; ++j) part[j] = row[i + j] > part[j] ? row[i + j] : part[j];
      float m = row[0];
      for (; i < v; ++i) m = row[i] > m ? row[i] : m;
      for (int64_t j = 0; j < 16; ++j) m = part[j] > m ? part[j] : m;
      int64_t idx = 0;
      while (idx < v && row[idx] != m) ++idx;
      op[r] = idx < v ? idx : 0;  // a NaN row: no element equals the max
    }
  });
  return out;
}

// ---------------------------------------------------------------- whole decode step
// The decoder for a step of decodes only (one token per sequence), in one
// call: no Python between the ~300 operations of a step, and the GIL is free
// for the service's other threads the whole time (llama.cpp runs a token as
// one graph for the same reason). Prefill steps take the Python path.
// ---------------------------------------------------------------- AMX GEMM
// y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation on AMX tiles,
// from a weight packed once at load into tile order: for each block of 16
// output channels and each 32 of K, one 1 KB tile whose row kp holds the
// (k = 2kp, 2kp + 1) pairs of the 16 channels (the layout TDPBF16PS reads).
// Each thread owns blocks of 32 channels and walks their packed weights
// front to back, so a decode step streams every weight once, in order; for
// more than 32 rows the 32-channel panel is reused from cache by every
// 32-row chunk of x. Tiles: 0-3 C (rows 0-15 / 16-31 x channel halves), 4-5
// A (x rows), 6-7 B (weights).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLM_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {  // Linux hands out the tile state only on request
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void amx_configure(int rows0, int rows1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1);
  if (rows1 == 0) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

// One 32-channel panel: b0 and b1 are its two 16-channel halves, KB tiles each
// (tile order). ``stream`` prefetches them a few tiles ahead (weights read from
// memory); a panel already in cache needs none. cur0/cur1 track the tile config.
void amx_panel(const BFloat16* x, const BFloat16* b0, const BFloat16* b1, BFloat16* y,
               int64_t M, int64_t N, int64_t K, int64_t p, bool stream, int& cur0, int& cur1) {
  const int64_t KB = K / 32;
  const int64_t tile_elems = 16 * 32;  // one packed tile: 16 rows of 32 bf16
  alignas(64) float buf[32][32];
  for (int64_t mc = 0; mc < M; mc += 32) {
    const int rows0 = static_cast<int>(std::min<int64_t>(16, M - mc));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(M - mc - 16, 0, 16));
    if (rows0 != cur0 || rows1 != cur1) {
      amx_configure(rows0, rows1);
      cur0 = rows0;
      cur1 = rows1;
    }
    const BFloat16* xa = x + mc * K;
    const BFloat16* xb = xa + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (stream && mc == 0 && kb + 4 < KB) {  // the weight streams, a few tiles ahead
        const char* n0 = reinterpret_cast<const char*>(b0 + (kb + 4) * tile_elems);
        const char* n1 = reinterpret_cast<const char*>(b1 + (kb + 4) * tile_elems);
        for (int c = 0; c < 1024; c += 64) {
          _mm_prefetch(n0 + c, _MM_HINT_T0);
          _mm_prefetch(n1 + c, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, xa + kb * 32, K * 2);
      _tile_loadd(6, b0 + kb * tile_elems, 64);
      _tile_loadd(7, b1 + kb * tile_elems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (rows1) {
        _tile_loadd(5, xb + kb * 32, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &buf[0][0], 128);
    _tile_stored(1, &buf[0][16], 128);
    if (rows1) {
      _tile_stored(2, &buf[16][0], 128);
      _tile_stored(3, &buf[16][16], 128);
    }
    for (int r = 0; r < rows0 + rows1; ++r) {  // 32 fp32 -> bf16 (RNE) per row
      BFloat16* yr = y + (mc + r) * N + 32 * p;
#ifdef LLM_HAVE_AVX512BF16
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(&buf[r][16]),
                                                _mm512_load_ps(&buf[r][0]));
      _mm512_storeu_si512(yr, (__m512i)both);
#else
      for (int c = 0; c < 32; ++c) yr[c] = from_f<BFloat16>(buf[r][c]);
#endif
    }
  }
}

void amx_gemm_panels(const BFloat16* x, const BFloat16* packed, BFloat16* y, int64_t M,
                     int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const int64_t KB = K / 32;
  int cur0 = -1, cur1 = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const BFloat16* b0 = packed + (2 * p) * KB * 512;
    amx_panel(x, b0, b0 + KB * 512, y, M, N, K, p, true, cur0, cur1);
  }
  _tile_release();
}
#endif

bool amx_available() {
#ifdef LLM_HAVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

bool amx_shape_ok(int64_t N, int64_t K) { return N % 32 == 0 && K % 32 == 0 && K > 0; }

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

#include "q4_weights.h"
#include "prefill_attention.h"

// up to skinny_max rows: the 4-bit GEMV where the weight has a 4-bit copy
// (``small``), else the streaming bf16/fp32 GEMV; above: the packed copy
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor* packed,
                   const at::Tensor* small, int64_t skinny_max) {
  if (x.size(0) <= skinny_max) return small != nullptr ? q4_linear(x, *small) : skinny_linear(x, w);
  if (packed != nullptr && packed->dim() == 4) return amx_linear(x, *packed);
  if (packed != nullptr) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, *packed, c10::IValue(), std::string("none"),
                            c10::List<std::optional<c10::Scalar>>(), c10::IValue(std::string())};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w);
}

at::Tensor decode_forward(at::Tensor residual, at::TensorList in_norm, at::TensorList post_norm,
                          at::TensorList weights, at::TensorList packed, at::TensorList small,
                          int64_t skinny_max,
                          const at::Tensor& final_norm, double eps, at::TensorList k_caches,
                          at::TensorList v_caches, at::TensorList kv_scales,
                          const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          int64_t num_heads, int64_t num_kv_heads) {
  const int64_t L = static_cast<int64_t>(in_norm.size());
  TORCH_CHECK(L > 0 && post_norm.size() == in_norm.size() &&
                  static_cast<int64_t>(weights.size()) == 4 * L &&
                  (packed.empty() || packed.size() == weights.size()) &&
                  (small.empty() || small.size() == weights.size()) &&
                  static_cast<int64_t>(k_caches.size()) == L && v_caches.size() == k_caches.size() &&
                  (kv_scales.empty() || static_cast<int64_t>(kv_scales.size()) == 2 * L),
              "decode_forward: per-layer lists disagree (", L, " layers)");
  const int64_t D = k_caches[0].size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto dtype = residual.scalar_type();
  residual = residual.contiguous();
  at::Tensor h;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int64_t i) -> const at::Tensor& { return weights[4 * l + i]; };
    auto p = [&](int64_t i) -> const at::Tensor* {
      return packed.empty() ? nullptr : &packed[4 * l + i];
    };
    auto sm = [&](int64_t i) -> const at::Tensor* {
      return small.empty() ? nullptr : &small[4 * l + i];
    };
    const at::Tensor x = l == 0 ? rms_norm(residual, in_norm[0], eps)
                                : add_rms_norm(h, residual, in_norm[l], eps);
    std::optional<at::Tensor> ks, vs;
    if (!kv_scales.empty()) {
      ks = kv_scales[2 * l];
      vs = kv_scales[2 * l + 1];
    }
    const at::Tensor qkv = rotary_qkv(project(x, w(0), p(0), sm(0), skinny_max), cos, sin, positions,
                                      slot_mapping, k_caches[l], v_caches[l], num_heads,
                                      num_kv_heads, ks, vs, std::nullopt);
    const at::Tensor attn =
        paged_decode_attention(qkv.narrow(1, 0, num_heads), k_caches[l], v_caches[l],
                               block_tables, context_lens, scale, dtype, ks, vs);
    h = project(attn, w(1), p(1), sm(1), skinny_max);
    const at::Tensor x2 = add_rms_norm(h, residual, post_norm[l], eps);
    h = project(silu_and_mul(project(x2, w(2), p(2), sm(2), skinny_max)), w(3), p(3), sm(3),
                skinny_max);
  }
  return add_rms_norm(h, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("q4_available() -> bool", &q4_available);
  m.def("q4_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("prefill_attention_available() -> bool", &prefill_attention_available);
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqs, Tensor tables, "
      "float scale) -> Tensor");
  m.def("fp8_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("fp8_dequant_bf16(Tensor w, Tensor(a!) out) -> ()");
  m.def(
      "decode_forward(Tensor(a!) residual, Tensor[] in_norm, Tensor[] post_norm, "
      "Tensor[] weights, Tensor[] packed, Tensor[] small, int skinny_max, Tensor final_norm, float eps, "
      "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] kv_scales, Tensor cos, "
      "Tensor sin, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "rotary_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, "
      "Tensor(a!)? k_cache, Tensor(b!)? v_cache, int num_heads, int num_kv_heads, "
      "Tensor? k_scale=None, Tensor? v_scale=None, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, ScalarType out_dtype, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("q4_linear", &q4_linear);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("fp8_gemv", &fp8_gemv);
  m.impl("fp8_dequant_bf16", &fp8_dequant_bf16);
  m.impl("decode_forward", &decode_forward);
  m.impl("rotary_qkv", &rotary_qkv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}

// decode_forward's packed weights are oneDNN tensors, which would otherwise
// send the whole call to the MkldnnCPU dispatch key
TORCH_LIBRARY_IMPL(llm_cpu, MkldnnCPU, m) {
  m.impl("decode_forward", &decode_forward);
}
