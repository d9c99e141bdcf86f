// Prefill attention in fp32 for CPUs whose fastest dtype is fp32 (AVX2 without
// AVX512-BF16): the fused kernel's walk (prefill_attention.cpp) with fp32
// products in 256-bit registers, q in fp32 and the paged cache in bf16 or fp32.
//
// Two passes over torch's OpenMP pool, as the bf16 kernel:
//   1. pack: per (sequence, KV head), K^T in tiles of 16 keys ([dim][16 keys],
//      so a tile's 16 scores of a row are two vector accumulators) and V as
//      fp32 rows, both widened from the cache once and zero past the context;
//      shared by every query head of the group and every row block.
//   2. attend: per (sequence, query head, block of 6 query rows), flash
//      attention over blocks of 64 keys. S (6 rows x 16 keys) and O (6 rows x
//      16 dims at a time) += P V are one 12-register GEMM tile (tile_6x16):
//      per step two loads (K^T or V) and 6 broadcasts (q or P) feed 12 FMAs.
//      The running max is raised lazily
//      (only when a score would exceed it by e^6), so most key blocks add to
//      O without a rescale. Key blocks past the block's last row are never
//      visited; items go to threads longest first, round robin.
// torch's SDPA in fp32 reaches 44-65 GFLOP/s here (AVX2, 2 threads, 128-512
// tokens); this kernel's products run at the rate of an fp32 GEMM tile.

#include "common.h"
#include "decode_head_state_avx2.h"
#include "ops.h"
#include "prefill_block.h"

namespace llm_cpu {

namespace {

#ifdef LLM_HAVE_AVX2
constexpr int64_t kRowsF32 = 6;     // query rows per item
constexpr int64_t kTileKeys = 16;   // keys per K^T tile
constexpr float kLazyMaxE = 6.f;    // headroom (natural log) before the max is raised

// K^T tiles and V rows of keys [t0, t1) of one (sequence, KV head)
template <int64_t kD, typename C>
void pack_f32(const PrefillSeq& s, const C* kc, const C* vc, int64_t kvh, int64_t Hkv, int64_t bs,
              int64_t t0, int64_t t1) {
  const int64_t ctx = s.computed + s.len;
  const int64_t stride = Hkv * kD;
  float* kt = s.kt + kvh * s.kpad * kD;
  float* vf = s.vf + kvh * s.kpad * kD;
  for (int64_t key = t0; key < t1; ++key) {
    float* vrow = vf + key * kD;
    float* kcol = kt + (key / kTileKeys) * kD * kTileKeys + key % kTileKeys;
    if (key < ctx) {
      const int64_t at = (s.table[key / bs] * bs + key % bs) * stride + kvh * kD;
      for (int64_t d = 0; d < kD; d += 8) _mm256_storeu_ps(vrow + d, load8(vc + at + d));
      alignas(32) float krow[kD];
      for (int64_t d = 0; d < kD; d += 8) _mm256_store_ps(krow + d, load8(kc + at + d));
      for (int64_t d = 0; d < kD; ++d) kcol[d * kTileKeys] = krow[d];
    } else {
      std::memset(vrow, 0, kD * sizeof(float));
      for (int64_t d = 0; d < kD; ++d) kcol[d * kTileKeys] = 0.f;
    }
  }
}

// c[6][16] (+)= a[6][n] b[n][16]: row i of a at a + i * lda, row k of b at b + k * ldb,
// row i of c at c + i * ldc (aligned); ``load_c`` adds to c, else overwrites it. Per k,
// two loads of b and 6 broadcasts of a feed 12 FMAs into 12 accumulator registers
// (every loop over the rows unrolled: a loop gcc leaves rolled keeps the accumulators
// in memory and halves the rate). Both products of a row block run on it: S = q K^T
// and O += P V.
inline void tile_6x16(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n,
                      float* c, int64_t ldc, bool load_c) {
  __m256 acc[kRowsF32][2];
#pragma GCC unroll 8
  for (int64_t i = 0; i < kRowsF32; ++i) {
    acc[i][0] = load_c ? _mm256_load_ps(c + i * ldc) : _mm256_setzero_ps();
    acc[i][1] = load_c ? _mm256_load_ps(c + i * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < n; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
#pragma GCC unroll 8
    for (int64_t i = 0; i < kRowsF32; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
      acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < kRowsF32; ++i) {
    _mm256_store_ps(c + i * ldc, acc[i][0]);
    _mm256_store_ps(c + i * ldc + 8, acc[i][1]);
  }
}

// One block of up to 6 query rows of head h over its keys
template <int64_t kD>
void attend_f32(const PrefillSeq& s, const float* q, int64_t q_stride, float* out,
                int64_t out_stride, int64_t h, int64_t kvh, int64_t r0, int64_t nr, float scale) {
  alignas(32) float qs[kRowsF32][kD];    // q * scale, zero rows past nr
  alignas(32) float acc[kRowsF32][kD];   // O, unnormalized
  alignas(32) float st[kRowsF32][kKeyBlock];
  float m[kRowsF32], l[kRowsF32];
  for (int64_t i = 0; i < kRowsF32; ++i) {
    const float* qr = q + (s.row + r0 + i) * q_stride + h * kD;
    for (int64_t d = 0; d < kD; ++d) {
      qs[i][d] = i < nr ? qr[d] * scale : 0.f;
      acc[i][d] = 0.f;
    }
    m[i] = -1e30f;
    l[i] = 0.f;
  }
  const float* kt = s.kt + kvh * s.kpad * kD;
  const float* vf = s.vf + kvh * s.kpad * kD;
  const int64_t first = s.computed + r0, last = first + nr - 1;
  for (int64_t k0 = 0; k0 <= last; k0 += kKeyBlock) {
    const int64_t ntile = std::min<int64_t>(kKeyBlock / kTileKeys, (last - k0) / kTileKeys + 1);
    const int64_t nkeys = ntile * kTileKeys;
    for (int64_t t = 0; t < ntile; ++t) {  // S = q K^T, 6 rows x 16 keys
      const float* tile = kt + (k0 / kTileKeys + t) * kD * kTileKeys;
      tile_6x16(qs[0], kD, tile, kTileKeys, kD, &st[0][t * kTileKeys], kKeyBlock, false);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < nr; ++i) {  // online softmax of row i (position first + i)
      // keys k0 + j + lane past the row's position get -1e30
      const __m256i seen = _mm256_set1_epi32(static_cast<int32_t>(first + i - k0 + 1));
      __m256 mx = _mm256_set1_ps(-1e30f);
      for (int64_t j = 0; j < nkeys; j += 8) {
        const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(j)));
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, key));
        const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-1e30f), _mm256_load_ps(&st[i][j]), keep);
        _mm256_store_ps(&st[i][j], v);
        mx = _mm256_max_ps(mx, v);
      }
      const float bm = hmax8(mx);
      if (bm > m[i] + kLazyMaxE) {
        const float alpha = fast_exp(m[i] - bm);
        m[i] = bm;
        l[i] *= alpha;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < kD; d += 8) {
          _mm256_store_ps(&acc[i][d], _mm256_mul_ps(_mm256_load_ps(&acc[i][d]), av));
        }
      }
      const __m256 mv = _mm256_set1_ps(m[i]);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < nkeys; j += 8) {
        const __m256 sv = _mm256_load_ps(&st[i][j]);
        const __m256 valid = _mm256_cmp_ps(sv, _mm256_set1_ps(-1e29f), _CMP_GT_OQ);
        const __m256 p = _mm256_and_ps(valid, fast_exp8(_mm256_sub_ps(sv, mv)));
        _mm256_store_ps(&st[i][j], p);
        sum = _mm256_add_ps(sum, p);
      }
      l[i] += hsum8(sum);
    }
    for (int64_t i = nr; i < kRowsF32; ++i) {  // rows past nr add nothing
      for (int64_t j = 0; j < nkeys; ++j) st[i][j] = 0.f;
    }
    for (int64_t d0 = 0; d0 < kD; d0 += 16) {  // O += P V, 6 rows x 16 dims
      tile_6x16(st[0], kKeyBlock, vf + k0 * kD + d0, kD, nkeys, &acc[0][d0], kD, true);
    }
  }
  for (int64_t i = 0; i < nr; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    float* o = out + (s.row + r0 + i) * out_stride + h * kD;
    for (int64_t d = 0; d < kD; ++d) o[d] = acc[i][d] * inv;
  }
}

template <int64_t kD, typename C>
void run_f32(std::vector<PrefillSeq>& seqs, const float* q, int64_t q_stride, const C* kc,
             const C* vc, float* out, int64_t H, int64_t Hkv, int64_t bs, float scale) {
  const auto none = [] {};
  std::vector<PrefillItem> packs = pack_items(seqs, Hkv);
  spread_items(packs, none, none, [&](const PrefillItem& it) {
    pack_f32<kD>(seqs[it.seq], kc, vc, it.a, Hkv, bs, it.b, it.b + it.cost);
  });
  std::vector<PrefillItem> blocks = block_items(seqs, H, kRowsF32);
  const int64_t G = H / Hkv;
  spread_items(blocks, none, none, [&](const PrefillItem& it) {
    const PrefillSeq& s = seqs[it.seq];
    const int64_t nr = std::min<int64_t>(kRowsF32, s.len - it.b);
    attend_f32<kD>(s, q, q_stride, out, H * kD, it.a, it.a / G, it.b, nr, scale);
  });
}
#endif

}  // namespace

bool prefill_attention_f32_available() {
#ifdef LLM_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

void prefill_attention_f32(std::vector<PrefillSeq>& seqs, const at::Tensor& q,
                           const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                           float scale) {
#ifdef LLM_HAVE_AVX2
  const int64_t H = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](std::vector<PrefillSeq>& group, const auto* kc, const auto* vc) {
    if (D == 64) {
      run_f32<64>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, scale);
    } else {
      run_f32<128>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, scale);
    }
  };
  // the widened K^T and V: 8 bytes per (key, KV head, dim)
  in_scratch_groups(seqs, 2 * Hkv * D * 4, [&](std::vector<PrefillSeq>& group, int64_t bytes) {
    auto scratch = at::empty({bytes / 4}, q.options().dtype(at::kFloat));
    float* base = scratch.data_ptr<float>();
    for (auto& s : group) {
      s.kt = base;
      s.vf = base + Hkv * s.kpad * D;
      base += 2 * Hkv * s.kpad * D;
    }
    if (k_cache.scalar_type() == at::kFloat) {
      run(group, k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    } else {
      run(group, k_cache.data_ptr<BFloat16>(), v_cache.data_ptr<BFloat16>());
    }
  });
#else
  TORCH_CHECK(false, "prefill_attention: this kernel build has no AVX2 (fp32 q needs it)");
#endif
}

}  // namespace llm_cpu
