// The AVX2 decode attention's online-softmax state of one KV head
// (decode_attention.cpp), for CPUs without AVX-512: the same walk as the
// AVX-512 HeadState (decode_head_state.h), 8 tokens at a time in 256-bit
// registers, fp32 math throughout.
//
// Sixteen ymm registers cannot hold a KV head's kG query heads (3 x 64 dims
// are 24 registers) nor its accumulators, so both live in L1 and the loops are
// ordered around that: a K row is loaded (widened) once into registers and
// multiplied by every head's q from memory; the block's 8 rows of V are widened
// once into an L1 buffer (a fp32 cache is read in place) and each head then
// streams them through its accumulator, which stays in registers for the 8
// rows. The 8 q.k products of a head are reduced together by a transpose-and-
// add tree (three hadd levels for 8 scores instead of 8 horizontal sums).
#pragma once

#include "common.h"
#include "decode_head_state.h"

namespace llm_cpu {

#ifdef LLM_HAVE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// e4m3 -> fp32, 8 at a time (e4m3_to_f32's arithmetic: no fp32 subnormal is formed)
inline __m256 load8(const Float8* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256 v = _mm256_blendv_ps(normal, sub, is_sub);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

// lane i of the result = the sum of the 8 lanes of v[i]
inline __m256 sum8x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a holds rows 0-3 (low 128 bits: dims 0-3 summed, high: dims 4-7), b rows 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fast_exp on 8 lanes (same polynomial); the integer part goes into the exponent
// bits (x >= -87 keeps it a normal number)
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <int64_t kD, int64_t kG>
struct HeadStateAvx2 {
  static_assert(kD % 8 == 0 && kD <= 256 && kG > 0, "HeadStateAvx2: D a multiple of 8");
  static constexpr int64_t kDim = kD, kGroup = kG, kV = kD / 8;
  alignas(32) float qs[kG][kD];   // q times the softmax scale
  alignas(32) float acc[kG][kD];  // unnormalized output
  float m[kG], l[kG];

  void init(const float* q, float scale) {
    for (int64_t g = 0; g < kG; ++g) {
      m[g] = -1e30f;  // finite: fast_exp clamps, no inf - inf
      l[g] = 0.f;
      for (int64_t d = 0; d < kD; ++d) {
        qs[g][d] = q[g * kD + d] * scale;
        acc[g][d] = 0.f;
      }
    }
  }

  // the n_blk rows of one block (row stride ``stride``) starting at kb / vb
  // (and ``pf``, when given, a few lines further per row)
  template <typename C>
  inline __attribute__((always_inline)) void block(const C* kb, const C* vb, int64_t n_blk,
                                                   int64_t stride, SpreadPrefetch* pf = nullptr,
                                                   int64_t pf_per_row = 0) {
    alignas(32) float p[kG][8];
    alignas(32) float vbuf[std::is_same_v<C, float> ? 1 : 8][kD];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t0 = 0; t0 < n_blk; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, n_blk - t0);
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
      __m256 prod[kG][8];
      for (int64_t t = 0; t < 8; ++t) {
        if (t < n) {
          if (pf != nullptr) pf->step(pf_per_row);
          const C* kr = kb + (t0 + t) * stride;
          __m256 kv[kV];
          for (int64_t d = 0; d < kV; ++d) kv[d] = load8(kr + 8 * d);
          for (int64_t g = 0; g < kG; ++g) {
            __m256 a = _mm256_mul_ps(_mm256_load_ps(qs[g]), kv[0]);
            for (int64_t d = 1; d < kV; ++d) {
              a = _mm256_fmadd_ps(_mm256_load_ps(qs[g] + 8 * d), kv[d], a);
            }
            prod[g][t] = a;
          }
        } else {
          for (int64_t g = 0; g < kG; ++g) prod[g][t] = _mm256_setzero_ps();
        }
      }
      float corr[kG];
      for (int64_t g = 0; g < kG; ++g) {
        const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-1e30f), sum8x8(prod[g]), valid);
        const float bm = std::max(m[g], hmax8(s));
        corr[g] = fast_exp(m[g] - bm);
        m[g] = bm;
        const __m256 pg =
            _mm256_and_ps(valid, fast_exp8(_mm256_sub_ps(s, _mm256_set1_ps(bm))));
        l[g] = l[g] * corr[g] + hsum8(pg);
        _mm256_store_ps(p[g], pg);
      }
      const float* vrows;  // the n rows of V as fp32, row stride vstride
      int64_t vstride;
      if constexpr (std::is_same_v<C, float>) {
        vrows = vb + t0 * stride;
        vstride = stride;
      } else {
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t d = 0; d < kV; ++d) {
            _mm256_store_ps(vbuf[t] + 8 * d, load8(vb + (t0 + t) * stride + 8 * d));
          }
        }
        vrows = vbuf[0];
        vstride = kD;
      }
      for (int64_t g = 0; g < kG; ++g) {
        const __m256 cv = _mm256_set1_ps(corr[g]);
        __m256 a[kV];
        for (int64_t d = 0; d < kV; ++d) a[d] = _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * d), cv);
        for (int64_t t = 0; t < n; ++t) {
          const __m256 pb = _mm256_set1_ps(p[g][t]);
          const float* vr = vrows + t * vstride;
          for (int64_t d = 0; d < kV; ++d) a[d] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vr + 8 * d), a[d]);
        }
        for (int64_t d = 0; d < kV; ++d) _mm256_store_ps(acc[g] + 8 * d, a[d]);
      }
    }
  }

  template <typename O>
  void finish(O* out, float v_scale) const {
    for (int64_t g = 0; g < kG; ++g) {
      const float inv = l[g] > 0.f ? v_scale / l[g] : 0.f;
      O* o = out + g * kD;
      for (int64_t d = 0; d < kD; ++d) o[d] = from_f<O>(acc[g][d] * inv);
    }
  }
};
#endif

}  // namespace llm_cpu
