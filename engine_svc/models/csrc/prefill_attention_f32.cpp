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
//      attention over blocks of 64 keys. S (6 rows x 16 keys) is a 12-register
//      GEMM tile over the head dim: per dim, two K^T loads and 6 broadcasts of
//      q feed 12 FMAs. O (6 rows x 16 dims at a time) += P V likewise, per key
//      two V loads and 6 broadcasts of P. The running max is raised lazily
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
      __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
      __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
      for (int64_t d = 0; d < kD; ++d) {
        const __m256 w0 = _mm256_load_ps(tile + d * kTileKeys);
        const __m256 w1 = _mm256_load_ps(tile + d * kTileKeys + 8);
        __m256 x = _mm256_broadcast_ss(&qs[0][d]);
        a00 = _mm256_fmadd_ps(x, w0, a00);
        a01 = _mm256_fmadd_ps(x, w1, a01);
        x = _mm256_broadcast_ss(&qs[1][d]);
        a10 = _mm256_fmadd_ps(x, w0, a10);
        a11 = _mm256_fmadd_ps(x, w1, a11);
        x = _mm256_broadcast_ss(&qs[2][d]);
        a20 = _mm256_fmadd_ps(x, w0, a20);
        a21 = _mm256_fmadd_ps(x, w1, a21);
        x = _mm256_broadcast_ss(&qs[3][d]);
        a30 = _mm256_fmadd_ps(x, w0, a30);
        a31 = _mm256_fmadd_ps(x, w1, a31);
        x = _mm256_broadcast_ss(&qs[4][d]);
        a40 = _mm256_fmadd_ps(x, w0, a40);
        a41 = _mm256_fmadd_ps(x, w1, a41);
        x = _mm256_broadcast_ss(&qs[5][d]);
        a50 = _mm256_fmadd_ps(x, w0, a50);
        a51 = _mm256_fmadd_ps(x, w1, a51);
      }
      const __m256 rows[kRowsF32][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                        {a30, a31}, {a40, a41}, {a50, a51}};
      for (int64_t i = 0; i < kRowsF32; ++i) {
        _mm256_store_ps(&st[i][t * kTileKeys], rows[i][0]);
        _mm256_store_ps(&st[i][t * kTileKeys + 8], rows[i][1]);
      }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < nr; ++i) {  // online softmax of row i (position first + i)
      const __m256i limit = _mm256_set1_epi32(static_cast<int32_t>(first + i - k0));
      __m256 mx = _mm256_set1_ps(-1e30f);
      for (int64_t j = 0; j < nkeys; j += 8) {  // keys past the row's position -> -1e30
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_add_epi32(limit, _mm256_set1_epi32(1)),
                               _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(j)))));
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
      __m256 o[kRowsF32][2];
      for (int64_t i = 0; i < kRowsF32; ++i) {
        o[i][0] = _mm256_load_ps(&acc[i][d0]);
        o[i][1] = _mm256_load_ps(&acc[i][d0 + 8]);
      }
      __m256 o00 = o[0][0], o01 = o[0][1], o10 = o[1][0], o11 = o[1][1], o20 = o[2][0];
      __m256 o21 = o[2][1], o30 = o[3][0], o31 = o[3][1], o40 = o[4][0], o41 = o[4][1];
      __m256 o50 = o[5][0], o51 = o[5][1];
      for (int64_t j = 0; j < nkeys; ++j) {
        const float* vr = vf + (k0 + j) * kD + d0;
        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
        __m256 p = _mm256_broadcast_ss(&st[0][j]);
        o00 = _mm256_fmadd_ps(p, v0, o00);
        o01 = _mm256_fmadd_ps(p, v1, o01);
        p = _mm256_broadcast_ss(&st[1][j]);
        o10 = _mm256_fmadd_ps(p, v0, o10);
        o11 = _mm256_fmadd_ps(p, v1, o11);
        p = _mm256_broadcast_ss(&st[2][j]);
        o20 = _mm256_fmadd_ps(p, v0, o20);
        o21 = _mm256_fmadd_ps(p, v1, o21);
        p = _mm256_broadcast_ss(&st[3][j]);
        o30 = _mm256_fmadd_ps(p, v0, o30);
        o31 = _mm256_fmadd_ps(p, v1, o31);
        p = _mm256_broadcast_ss(&st[4][j]);
        o40 = _mm256_fmadd_ps(p, v0, o40);
        o41 = _mm256_fmadd_ps(p, v1, o41);
        p = _mm256_broadcast_ss(&st[5][j]);
        o50 = _mm256_fmadd_ps(p, v0, o50);
        o51 = _mm256_fmadd_ps(p, v1, o51);
      }
      const __m256 res[kRowsF32][2] = {{o00, o01}, {o10, o11}, {o20, o21},
                                       {o30, o31}, {o40, o41}, {o50, o51}};
      for (int64_t i = 0; i < kRowsF32; ++i) {
        _mm256_store_ps(&acc[i][d0], res[i][0]);
        _mm256_store_ps(&acc[i][d0 + 8], res[i][1]);
      }
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
