// What every CPU operator source shares: includes, ISA macros, conversions and
// argument checks. The operators are registered as torch ops (torch.ops.llm_cpu.*)
// in cpu_ops.cpp and declared in ops.h; each op family has its own .cpp.
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
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLM_HAVE_AVX2 1
#endif
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

namespace llm_cpu {

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

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

inline bool kv_cache_type(const at::Tensor& t) {
  return float_or_bf16(t) || t.scalar_type() == at::kFloat8_e4m3fn;
}

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

// Every cache line of [p, p + bytes) into L2 (prefetcht1), for data a few
// microseconds ahead: a block's worth at once into L1 would evict the rows being
// computed on, and on AMD Zen 4 measured ~20% slower for the decode kernels.
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* a = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(a + off, 0, 2);
}

#ifdef LLM_HAVE_AVX512BF16
// two bf16 at p, as the 32-bit operand VDPBF16PS broadcasts to every lane
inline __m512bh pair_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}
#endif

}  // namespace llm_cpu
