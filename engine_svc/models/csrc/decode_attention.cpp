// Paged decode attention: one query token per sequence over its paged KV cache.

#include "common.h"
#include "ops.h"

namespace llm_cpu {

namespace {

// ---------------------------------------------------------------- decode attention
// One work item per (sequence, KV head): the item's G = H / Hkv query heads
// share every K/V row it reads. Blocks are read through the block table with
// an online softmax (running max and sum per head), so nothing is gathered or
// allocated per token. Each K/V row is widened to fp32 once (from fp32, bf16
// or e4m3) and then serves all G heads; on AVX512-BF16 a bf16 row is not
// widened but multiplied as bf16 pairs (HeadState's kDot). An FP8 cache's per-head scales are
// folded in: k's into the softmax scale, v's into the final normalization.
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlock = 256;

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

// The online-softmax state of one KV head's kG query heads. kDot (a bf16
// cache on a CPU with AVX512-BF16) runs both products as VDPBF16PS: q rounded
// to bf16 once, q.k over the row's dim pairs as loaded; P rounded to bf16 and
// V^T P over key pairs (two rows interleaved by unpacklo/hi, which leaves each
// accumulator's dims in a fixed order that finish() undoes). That is about
// half the instructions of widening every row to fp32; scores, softmax and
// sums stay fp32.
template <int64_t kD, int64_t kG, bool kDot = false>
struct HeadState {
  static constexpr int64_t kV = kD / 16;
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

template <int64_t kD, int64_t kG, typename C, typename O>
void decode_item_avx512(const float* q, const C* kc, const C* vc, const int64_t* bt,
                        int64_t ctx, O* out, int64_t kvh, int64_t Hkv, int64_t bs, float scale,
                        float v_scale) {
  static_assert(kD % 16 == 0 && kG > 0, "decode_item_avx512: D a multiple of 16, G fixed");
  HeadState<kD, kG, kDotFor<C>> st;
  st.init(q, scale);
  const int64_t stride = Hkv * kD;
  for_each_kv_block(kc, vc, bt, ctx, bs, stride, kvh * kD, kD,
                    [&](const C* kb, const C* vb, int64_t n_blk) { st.block(kb, vb, n_blk, stride); });
  st.finish(out, v_scale);
}

// All KV heads of one sequence in one pass over its blocks: a block's rows
// (every head side by side, bs * Hkv * kD values) are read front to back once
// and the block two ahead is prefetched into L2, a few lines per row computed
// (SpreadPrefetch), where one item per (sequence, head) reads a third of every
// row's cache lines per pass. The heads' states live on the stack. Zen 4, 2
// threads, 30 layers of 32 sequences of ~350 bf16 tokens from DRAM: 20.2 ms
// widening to fp32 with the block prefetched at once, 17.6 ms with kDot, 10.5
// ms with kDot and the spread prefetch (~24 GB/s; a streamed sum reads ~32).
constexpr int64_t kMaxSeqKvHeads = 8;
constexpr int64_t kSeqPrefetchBlocks = 2;
constexpr int64_t kSeqCostTokens = 32;  // a sequence's fixed cost, in tokens of context

template <int64_t kD, int64_t kG, typename C, typename O>
void decode_seq_avx512(const float* q, const C* kc, const C* vc, const int64_t* bt, int64_t ctx,
                       O* out, int64_t Hkv, int64_t bs, float sc, const float* k_scale,
                       const float* v_scale) {
  HeadState<kD, kG, kDotFor<C>> st[kMaxSeqKvHeads];
  for (int64_t h = 0; h < Hkv; ++h) st[h].init(q + h * kG * kD, k_scale ? sc * k_scale[h] : sc);
  const int64_t stride = Hkv * kD;
  const int64_t nblk = (ctx + bs - 1) / bs;
  const int64_t block_bytes = bs * stride * static_cast<int64_t>(sizeof(C));
  const int64_t block_lines = (block_bytes + 63) / 64;
  const int64_t per_row = (block_lines + bs * Hkv - 1) / (bs * Hkv);  // rows one block visits
  for (int64_t blk = 0; blk < nblk; ++blk) {
    SpreadPrefetch pf;
    if (blk + kSeqPrefetchBlocks < nblk) {  // the whole block, every head, into L2
      const int64_t next = bt[blk + kSeqPrefetchBlocks] * bs * stride;
      pf = {reinterpret_cast<const char*>(kc + next), reinterpret_cast<const char*>(vc + next), 0,
            block_lines};
    }
    const int64_t at = bt[blk] * bs * stride;
    const int64_t n = std::min(bs, ctx - blk * bs);
    for (int64_t h = 0; h < Hkv; ++h) {
      st[h].block(kc + at + h * kD, vc + at + h * kD, n, stride, &pf, per_row);
    }
    pf.step(block_lines);  // what a short last block left
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
  // enough sequences to keep every thread busy: one item per sequence, each
  // thread a contiguous run of about equal total context (an even split by count
  // leaves one thread waiting when the contexts differ, as they do in serving)
  const int64_t T = at::get_num_threads();
  if (D == 64 && G == 3 && Hkv <= kMaxSeqKvHeads && B >= 2 * T) {
    std::vector<int64_t> cum(B + 1, 0);
    for (int64_t b = 0; b < B; ++b) cum[b + 1] = cum[b] + clp[b] + kSeqCostTokens;
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t tid = t0; tid < t1; ++tid) {
        const int64_t b0 = std::lower_bound(cum.begin(), cum.end(), cum[B] * tid / T) - cum.begin();
        const int64_t e0 =
            std::lower_bound(cum.begin(), cum.end(), cum[B] * (tid + 1) / T) - cum.begin();
        for (int64_t b = b0; b < e0; ++b) {
          decode_seq_avx512<64, 3>(qp + b * q_stride, kc, vc, btp + b * max_blocks, clp[b],
                                   op + b * H * D, Hkv, bs, sc, k_scale, v_scale);
        }
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

}  // namespace

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

}  // namespace llm_cpu
