// The AVX-512 decode attention's building blocks (decode_attention.cpp): row
// loads that widen fp32 / bf16 / e4m3 to fp32, the 16x16 transpose-and-add, the
// vector exp, the spread prefetch and the online-softmax state of one KV head.
#pragma once

#include "common.h"

namespace llm_cpu {

// Prefetches a block's K and V into L2 a few lines at a time, between the
// current block's rows: asked for all at once, its ~200 lines fill the miss
// queue and the compute stalls behind them (measured on Zen 4).
struct SpreadPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, lines = 0;

  inline void step(int64_t n) {
    for (const int64_t end = std::min(lines, next + n); next < end; ++next) {
      __builtin_prefetch(k + 64 * next, 0, 2);
      __builtin_prefetch(v + 64 * next, 0, 2);
    }
  }
};

#ifdef LLM_HAVE_AVX512
// Decode attention with AVX-512 intrinsics for fp32, bf16 and e4m3 caches, 16
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

// The online-softmax state of one KV head's kG query heads. kDot (a bf16
// cache on a CPU with AVX512-BF16) runs both products as VDPBF16PS: q rounded
// to bf16 once, q.k over the row's dim pairs as loaded; P rounded to bf16 and
// V^T P over key pairs (two rows interleaved by unpacklo/hi, which leaves each
// accumulator's dims in a fixed order that finish() undoes). That is about
// half the instructions of widening every row to fp32; scores, softmax and
// sums stay fp32.
template <int64_t kD, int64_t kG, bool kDot = false>
struct HeadState {
  static constexpr int64_t kDim = kD, kGroup = kG, kV = kD / 16;
  __m512 qv[kG][kV], acc[kG][kV];
#ifdef LLM_HAVE_AVX512BF16
  __m512bh qp[kG][kD / 32];
#else
  static_assert(!kDot, "HeadState: kDot needs AVX512-BF16");
#endif
  float m[kG], l[kG];

  void init(const float* q, float scale) {
    for (int64_t g = 0; g < kG; ++g) {
      m[g] = -1e30f;
      l[g] = 0.f;
      for (int64_t d = 0; d < kV; ++d) {
        qv[g][d] = _mm512_mul_ps(_mm512_loadu_ps(q + g * kD + 16 * d), _mm512_set1_ps(scale));
        acc[g][d] = _mm512_setzero_ps();
      }
#ifdef LLM_HAVE_AVX512BF16
      if constexpr (kDot) {
        for (int64_t c = 0; c < kD / 32; ++c) {
          qp[g][c] = _mm512_cvtne2ps_pbh(qv[g][2 * c + 1], qv[g][2 * c]);
        }
      }
#endif
    }
  }

  // the n_blk rows of one block (row stride ``stride``) starting at kb / vb
  template <typename C>
  // (and ``pf``, when given, a few lines further per row)
  inline __attribute__((always_inline)) void block(const C* kb, const C* vb, int64_t n_blk,
                                                   int64_t stride, SpreadPrefetch* pf = nullptr,
                                                   int64_t pf_per_row = 0) {
    alignas(64) float p[kG][16];
    for (int64_t t0 = 0; t0 < n_blk; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, n_blk - t0);
      const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      __m512 prod[kG][16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t < n) {
          if (pf != nullptr) pf->step(pf_per_row);
          const C* kr = kb + (t0 + t) * stride;
          if constexpr (kDot) {
#ifdef LLM_HAVE_AVX512BF16
            __m512bh kp[kD / 32];
            for (int64_t c = 0; c < kD / 32; ++c) kp[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
            for (int64_t g = 0; g < kG; ++g) {
              __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[g][0], kp[0]);
              for (int64_t c = 1; c < kD / 32; ++c) a = _mm512_dpbf16_ps(a, qp[g][c], kp[c]);
              prod[g][t] = a;
            }
#endif
          } else {
            __m512 kv[kV];
            for (int64_t d = 0; d < kV; ++d) kv[d] = load16(kr + 16 * d);
            for (int64_t g = 0; g < kG; ++g) {
              __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
              for (int64_t d = 1; d < kV; ++d) a = _mm512_fmadd_ps(qv[g][d], kv[d], a);
              prod[g][t] = a;
            }
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
      if constexpr (kDot) {
#ifdef LLM_HAVE_AVX512BF16
        alignas(64) uint16_t pb[kG][16];  // P in bf16; lanes past n are 0
        for (int64_t g = 0; g < kG; ++g) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(pb[g]),
                             (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[g])));
        }
        for (int64_t t = 0; t < n; t += 2) {  // keys t and t + 1 (a zero row past n)
          const C* vr = vb + (t0 + t) * stride;
          __m512bh pp[kG];
          for (int64_t g = 0; g < kG; ++g) pp[g] = pair_at(&pb[g][t]);
          for (int64_t c = 0; c < kD / 32; ++c) {
            const __m512i a = _mm512_loadu_si512(vr + 32 * c);
            const __m512i b =
                t + 1 < n ? _mm512_loadu_si512(vr + stride + 32 * c) : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int64_t g = 0; g < kG; ++g) {
              acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, pp[g]);
              acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, pp[g]);
            }
          }
        }
#endif
      } else {
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
  }

  template <typename O>
  void finish(O* out, float v_scale) const {
    for (int64_t g = 0; g < kG; ++g) {
      const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? v_scale / l[g] : 0.f);
      alignas(64) float row[kD];
      if constexpr (kDot) {
        // accumulator 2c lane 4L + j holds dim 32c + 8L + j; 2c + 1 holds 32c + 8L + 4 + j
        alignas(64) float t[kV][16];
        for (int64_t d = 0; d < kV; ++d) _mm512_store_ps(t[d], _mm512_mul_ps(acc[g][d], inv));
        for (int64_t c = 0; c < kD / 32; ++c) {
          for (int64_t L = 0; L < 4; ++L) {
            for (int64_t j = 0; j < 4; ++j) {
              row[32 * c + 8 * L + j] = t[2 * c][4 * L + j];
              row[32 * c + 8 * L + 4 + j] = t[2 * c + 1][4 * L + j];
            }
          }
        }
      } else {
        for (int64_t d = 0; d < kV; ++d) {
          _mm512_store_ps(row + 16 * d, _mm512_mul_ps(acc[g][d], inv));
        }
      }
      O* o = out + g * kD;
      for (int64_t d = 0; d < kD; ++d) o[d] = from_f<O>(row[d]);
    }
  }
};

// VDPBF16PS for a bf16 cache where the CPU has it, fp32 widening otherwise
template <typename C>
constexpr bool kDotFor =
#ifdef LLM_HAVE_AVX512BF16
    std::is_same_v<C, BFloat16>;
#else
    false;
#endif
#endif

}  // namespace llm_cpu
