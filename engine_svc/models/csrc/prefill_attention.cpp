// Prefill attention on AMX, or on AVX512-BF16 dot products where the CPU has
// no AMX (it reuses TileConfig and amx_permitted of amx.h).
//
// One step's prefill chunks attend to their sequence's whole context, read
// from the paged bf16 cache through the block table (the chunk's own K/V are
// already written there), causal with the chunk's offset. No mask tensor, no
// gathered copy of the context, no padding between sequences.
//
// The scores are computed transposed, S^T = K Q^T: a row is one key and its
// 16 lanes are the 16 query rows of a block, so the online softmax's running
// max, sums and rescaling are plain lane-wise vector ops (no horizontal
// reductions), and keys load straight from the cache (16 keys of one block,
// row stride Hkv * D). Then O^T += V^T P^T.
//
// Two passes over torch's OpenMP pool:
//   1. pack V^T: per (sequence, KV head), tiles of [16 dims][32 keys], zero
//      past the context; shared by every query head of the group and every
//      query block of the chunk.
//   2. attend: per (sequence, query head, block of 16 query rows), flash
//      attention over blocks of 64 keys. Q^T is packed once per item in
//      (dim pair, query row) order; P^T likewise per key block, in (key pair,
//      query row) order. The max is raised lazily (only when a score would
//      exceed it by 2^8), so most key blocks accumulate O^T with no rescale.
//      Key blocks past the item's last row are never visited; items go to
//      threads longest first, round robin, so the causal triangle's uneven
//      rows balance.
// The two ISAs differ only in how a key block's S^T and O^T products run:
//   AMX: TDPBF16PS tiles: 0 B operand (Q^T, P^T), 4 A operand (K, V^T), 2-3
//        and 6-7 S^T, 1 and 5 O^T.
//   AVX512-BF16: VDPBF16PS with one operand broadcast: S^T row of key j +=
//        Q^T pair row x (key j's dim pair), 16 keys in 16 registers; O^T row
//        of dim d += P^T pair row x (V^T's key pair at d), 16 dims at a time.

#include "common.h"
#include "amx.h"
#include "ops.h"
#include "prefill_block.h"

namespace llm_cpu {

namespace {

#if defined(LLM_HAVE_AVX512BF16)
#define LLM_HAVE_BF16_PREFILL 1
#if defined(LLM_HAVE_AMX)
#define LLM_HAVE_AMX_PREFILL 1
#endif

// The arguments every block kernel takes: the block's sequence, query head,
// KV head and rows [r0, r0 + nr) of the chunk.
struct BlockArgs {
  const PrefillSeq& s;
  const BFloat16* q;
  int64_t q_stride;
  const BFloat16* kc;
  int64_t bs, Hkv;
  BFloat16* out;
  int64_t out_stride, h, kvh, r0, nr;
  float scale;
};

// AVX512-BF16: VDPBF16PS with key pairs and V^T pairs broadcast from memory
struct DotUnits {
  // S^T rows of keys [k0, k0 + 16 ntile) into b.st; krow(j) is key k0 + 16 j's
  // cache row (16 keys of one cache block follow it, kstride apart)
  template <int64_t kD, typename KeyRow>
  static void scores(RowBlock<kD>& b, const KeyRow& krow, int64_t ntile, int64_t kstride) {
    for (int64_t j0 = 0; j0 < ntile; ++j0) {
      const BFloat16* k = krow(j0);
      __m512 sc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
      for (int64_t p = 0; p < kD / 2; ++p) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(b.qt[p]);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          sc[j] = _mm512_dpbf16_ps(sc[j], qv, pair_at(k + j * kstride + 2 * p));
        }
      }
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_store_ps(b.st[16 * j0 + j], sc[j]);
    }
  }

  // O^T += V^T P^T over keys [k0, k0 + nkeys), 16 dims at a time; vt: V^T tiles
  template <int64_t kD>
  static void values(RowBlock<kD>& b, const BFloat16* vt, int64_t k0, int64_t nkeys) {
    for (int64_t d0 = 0; d0 < kD; d0 += 16) {
      __m512 o[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) o[i] = _mm512_load_ps(b.acc[d0 + i]);
      for (int64_t jp = 0; jp < nkeys / 2; ++jp) {
        const int64_t key = k0 + 2 * jp;
        const BFloat16* tile = vt + ((key / 32) * (kD / 16) + d0 / 16) * 512 + key % 32;
        const __m512bh pp = (__m512bh)_mm512_load_si512(b.pt[jp]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) o[i] = _mm512_dpbf16_ps(o[i], pp, pair_at(tile + i * 32));
      }
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_store_ps(b.acc[d0 + i], o[i]);
    }
  }
};

#ifdef LLM_HAVE_AMX_PREFILL
void amx_configure_square() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// AMX: TDPBF16PS tiles (the thread's tiles configured square)
struct AmxUnits {
  template <int64_t kD, typename KeyRow>
  static void scores(RowBlock<kD>& b, const KeyRow& krow, int64_t ntile, int64_t kstride) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t dc = 0; dc < kD / 32; ++dc) {  // 32-dim chunks (Q^T tiles)
      _tile_loadd(0, b.qt[16 * dc], 64);
      for (int64_t j = 0; j < ntile; ++j) {
        _tile_loadd(4, krow(j) + dc * 32, kstride * 2);
        switch (j) {
          case 0: _tile_dpbf16ps(2, 4, 0); break;
          case 1: _tile_dpbf16ps(3, 4, 0); break;
          case 2: _tile_dpbf16ps(6, 4, 0); break;
          default: _tile_dpbf16ps(7, 4, 0); break;
        }
      }
    }
    _tile_stored(2, b.st[0], 64);
    _tile_stored(3, b.st[16], 64);
    _tile_stored(6, b.st[32], 64);
    _tile_stored(7, b.st[48], 64);
  }

  // 32 dims (two C tiles, 1 and 5) at a time, through acc
  template <int64_t kD>
  static void values(RowBlock<kD>& b, const BFloat16* vt, int64_t k0, int64_t nkeys) {
    const BFloat16* v0 = vt + (k0 / 32) * (kD / 16) * 512;  // keys k0 .. k0 + 31
    const BFloat16* v1 = v0 + (kD / 16) * 512;              // keys k0 + 32 .. k0 + 63
    for (int64_t dh = 0; dh < kD / 32; ++dh) {
      _tile_loadd(1, b.acc[32 * dh], 64);
      _tile_loadd(5, b.acc[32 * dh + 16], 64);
      _tile_loadd(0, b.pt[0], 64);
      _tile_loadd(4, v0 + (2 * dh) * 512, 64);
      _tile_dpbf16ps(1, 4, 0);
      _tile_loadd(4, v0 + (2 * dh + 1) * 512, 64);
      _tile_dpbf16ps(5, 4, 0);
      if (nkeys > 32) {
        _tile_loadd(0, b.pt[16], 64);
        _tile_loadd(4, v1 + (2 * dh) * 512, 64);
        _tile_dpbf16ps(1, 4, 0);
        _tile_loadd(4, v1 + (2 * dh + 1) * 512, 64);
        _tile_dpbf16ps(5, 4, 0);
      }
      _tile_stored(1, b.acc[32 * dh], 64);
      _tile_stored(5, b.acc[32 * dh + 16], 64);
    }
  }
};
#endif

// One block of query rows over its keys, blocks of 64 at a time
template <int64_t kD, typename Units>
void attend_block(const BlockArgs& a) {
  const PrefillSeq& s = a.s;
  RowBlock<kD> b(s, a.q, a.q_stride, a.h, a.r0, a.nr, a.scale);
  const int64_t kstride = a.Hkv * kD;  // cache row stride, elements
  const BFloat16* vt = s.vt + a.kvh * s.kpad * kD;
  const int64_t nkb = b.last / kKeyBlock + 1;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kKeyBlock;
    const int64_t ntile = std::min<int64_t>(4, (b.last - k0) / 16 + 1);  // key tiles of 16 in use
    const auto krow = [&](int64_t j) {
      const int64_t key = k0 + 16 * j;
      return a.kc + (s.table[key / a.bs] * a.bs + key % a.bs) * kstride + a.kvh * kD;
    };
    Units::template scores<kD>(b, krow, ntile, kstride);
    b.softmax(k0, 16 * ntile);
    Units::template values<kD>(b, vt, k0, 16 * ntile);
  }
  b.store(s, a.out, a.out_stride, a.h, a.r0, a.nr);
}

// The two passes over torch's pool, on AMX tiles (kAmx) or AVX512-BF16.
template <int64_t kD, bool kAmx>
void run_prefill(std::vector<PrefillSeq>& seqs, const BFloat16* q, int64_t q_stride,
                 const BFloat16* kc, const BFloat16* vc, BFloat16* out, int64_t H,
                 int64_t Hkv, int64_t bs, float scale) {
  const auto enter = [] {
#ifdef LLM_HAVE_AMX_PREFILL
    if constexpr (kAmx) amx_configure_square();
#endif
  };
  const auto leave = [] {
#ifdef LLM_HAVE_AMX_PREFILL
    if constexpr (kAmx) _tile_release();
#endif
  };
  std::vector<PrefillItem> packs = pack_items(seqs, Hkv);
  spread_items(packs, enter, leave, [&](const PrefillItem& it) {
    pack_values<kD>(seqs[it.seq], vc, it.a, Hkv, bs, it.b, it.b + it.cost);
  });
  std::vector<PrefillItem> blocks = block_items(seqs, H, 16);
  const int64_t G = H / Hkv;
  spread_items(blocks, enter, leave, [&](const PrefillItem& it) {
    const PrefillSeq& s = seqs[it.seq];
    const int64_t nr = std::min<int64_t>(16, s.len - it.b);
    const BlockArgs args{s, q, q_stride, kc, bs, Hkv, out, H * kD, it.a, it.a / G, it.b, nr, scale};
#ifdef LLM_HAVE_AMX_PREFILL
    if constexpr (kAmx) {
      attend_block<kD, AmxUnits>(args);
      return;
    }
#endif
    attend_block<kD, DotUnits>(args);
  });
}
#endif

}  // namespace

bool prefill_attention_available() {
#ifdef LLM_HAVE_BF16_PREFILL
  return true;  // AVX512-BF16 at least; AMX tiles too where Linux grants them
#else
  return false;
#endif
}

// q [T, H, D] bf16 or fp32 (rows may be strided), caches [NB, BS, Hkv, D] bf16
// (or fp32 beside fp32 q) with BS a multiple of 16, seqs [S, 3] int64 (first row,
// length, tokens before the chunk), tables [S, W] int64 -> [T, H * D] in q's
// dtype; rows outside every sequence are zero.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& seqs,
                             const at::Tensor& tables, double scale) {
  // fp32 q takes the fp32 kernel (AVX2), bf16 q the AMX / AVX512-BF16 one
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(q.dim() == 3 && (f32 || q.scalar_type() == at::kBFloat16) && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "prefill_attention: q must be bfloat16 or float32 [T, H, D] with contiguous heads");
  TORCH_CHECK(f32 ? prefill_attention_f32_available() : prefill_attention_available(),
              "prefill_attention: this CPU (or kernel build) has no ",
              f32 ? "AVX2 (for float32 q)" : "AVX512-BF16 (for bfloat16 q)");
  TORCH_CHECK(q.device().is_cpu(), "prefill_attention: q must be a CPU tensor");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(seqs, "seqs");
  check_cpu(tables, "tables");
  const bool cache_ok = k_cache.scalar_type() == at::kBFloat16 ||
                        (f32 && k_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(k_cache.dim() == 4 && cache_ok && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "prefill_attention: caches must be bfloat16 (or float32 beside float32 q) "
              "[blocks, block_size, Hkv, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128) && Hkv > 0 && H % Hkv == 0 &&
                  bs % 16 == 0,
              "prefill_attention: head dim must be 64 or 128, H a multiple of Hkv and the "
              "block size a multiple of 16");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && seqs.scalar_type() == at::kLong &&
                  tables.dim() == 2 && tables.size(0) == seqs.size(0) &&
                  tables.scalar_type() == at::kLong,
              "prefill_attention: seqs must be int64 [S, 3] and tables int64 [S, W]");
  auto out = at::empty({T, H * D}, q.options());
  const int64_t S = seqs.size(0), W = tables.size(1), NB = k_cache.size(0);
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<PrefillSeq> list;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t row = sp[3 * i], len = sp[3 * i + 1], computed = sp[3 * i + 2];
    TORCH_CHECK(row >= 0 && len >= 0 && computed >= 0 && row + len <= T,
                "prefill_attention: sequence ", i, " rows [", row, ", ", row + len,
                ") fall outside q's ", T, " rows");
    const int64_t nblk = (computed + len + bs - 1) / bs;
    TORCH_CHECK(nblk <= W, "prefill_attention: sequence ", i, " needs ", nblk,
                " blocks, its table holds ", W);
    for (int64_t b = 0; b < nblk; ++b) {
      TORCH_CHECK(tp[i * W + b] >= 0 && tp[i * W + b] < NB, "prefill_attention: sequence ", i,
                  " block ", b, " is ", tp[i * W + b], ", the cache has ", NB);
    }
    if (len == 0) continue;
    const int64_t kpad = (computed + len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    list.push_back({row, len, computed, tp + i * W, kpad, nullptr});
  }
  {  // rows no sequence covers are zero; the covered ones are all written below
    std::vector<bool> covered(static_cast<size_t>(T), false);
    for (const auto& s : list) std::fill_n(covered.begin() + s.row, s.len, true);
    for (int64_t r = 0; r < T; ++r) {
      if (!covered[static_cast<size_t>(r)]) out[r].zero_();
    }
  }
  if (list.empty()) return out;
  if (f32) {
    prefill_attention_f32(list, q, k_cache, v_cache, out, static_cast<float>(scale));
    return out;
  }
#ifdef LLM_HAVE_BF16_PREFILL
  const BFloat16* qp = q.data_ptr<BFloat16>();
  const BFloat16* kc = k_cache.data_ptr<BFloat16>();
  const BFloat16* vc = v_cache.data_ptr<BFloat16>();
  BFloat16* op = out.data_ptr<BFloat16>();
  const float sc = static_cast<float>(scale);
#ifdef LLM_HAVE_AMX_PREFILL
  const bool amx = amx_permitted();
#endif
  // V^T tiles: 2 bytes per (key, KV head, dim)
  in_scratch_groups(list, Hkv * D * 2, [&](std::vector<PrefillSeq>& group, int64_t bytes) {
    auto scratch = at::empty({bytes / 2}, q.options());
    BFloat16* base = scratch.data_ptr<BFloat16>();
    for (auto& s : group) {
      s.vt = base;
      base += Hkv * s.kpad * D;
    }
#ifdef LLM_HAVE_AMX_PREFILL
    if (amx) {
      if (D == 64) {
        run_prefill<64, true>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, sc);
      } else {
        run_prefill<128, true>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, sc);
      }
      return;
    }
#endif
    if (D == 64) {
      run_prefill<64, false>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, sc);
    } else {
      run_prefill<128, false>(group, qp, q.stride(0), kc, vc, op, H, Hkv, bs, sc);
    }
  });
#endif
  return out;
}

}  // namespace llm_cpu
