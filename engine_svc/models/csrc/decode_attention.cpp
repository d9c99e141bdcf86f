// Paged decode attention: one query token per sequence over its paged KV cache.

#include "common.h"
#include "decode_head_state.h"
#include "decode_head_state_avx2.h"
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

#if defined(LLM_HAVE_AVX512) || defined(LLM_HAVE_AVX2)
// The vector kernels' per-head state: HeadState (AVX-512, 16 tokens at a time;
// bf16 pairs on AVX512-BF16) where the CPU has AVX-512, else HeadStateAvx2.
template <int64_t kD, int64_t kG, typename C>
#ifdef LLM_HAVE_AVX512
using VecState = HeadState<kD, kG, kDotFor<C>>;
#else
using VecState = HeadStateAvx2<kD, kG>;
#endif

template <typename State, typename C, typename O>
void decode_item_vec(const float* q, const C* kc, const C* vc, const int64_t* bt, int64_t ctx,
                     O* out, int64_t kvh, int64_t Hkv, int64_t bs, float scale, float v_scale) {
  constexpr int64_t kD = State::kDim;
  State st;
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

template <typename State, typename C, typename O>
void decode_seq(const float* q, const C* kc, const C* vc, const int64_t* bt, int64_t ctx, O* out,
                int64_t Hkv, int64_t bs, float sc, const float* k_scale, const float* v_scale) {
  constexpr int64_t kD = State::kDim, kG = State::kGroup;
  State st[kMaxSeqKvHeads];
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
#if defined(LLM_HAVE_AVX512) || defined(LLM_HAVE_AVX2)
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
          decode_seq<VecState<64, 3, C>>(qp + b * q_stride, kc, vc, btp + b * max_blocks,
                                         clp[b], op + b * H * D, Hkv, bs, sc, k_scale, v_scale);
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
#if defined(LLM_HAVE_AVX512) || defined(LLM_HAVE_AVX2)
      {  // fp32, bf16 and e4m3 caches alike (the loads widen each)
        if (D == 64 && G == 3) {  // SmolLM2-135M
          decode_item_vec<VecState<64, 3, C>>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
          continue;
        }
        if (D == 64 && G == 4) {
          decode_item_vec<VecState<64, 4, C>>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
          continue;
        }
        if (D == 128 && G == 4) {  // Llama-3 8B
          decode_item_vec<VecState<128, 4, C>>(qi, kc, vc, bti, clp[b], oi, kvh, Hkv, bs, ks, vs);
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
