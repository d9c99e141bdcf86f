// Prefill attention's shared pieces (prefill_attention.cpp): the chunk
// description, the V^T packing, and one block of 16 query rows with its
// online softmax, which the AMX and the AVX512-BF16 products both use; the
// fp32 kernel's entry (prefill_attention_f32.cpp).
#pragma once

#include "common.h"

namespace llm_cpu {

// The op's argument checks use these on every CPU; the kernels only with AVX512-BF16.
constexpr int64_t kKeyBlock = 64;   // keys per step of the online softmax

struct PrefillSeq {
  int64_t row, len, computed;
  const int64_t* table;
  int64_t kpad;             // context padded to a multiple of kKeyBlock
  BFloat16* vt;             // Hkv x V^T tiles, each kpad * D (bf16 kernels)
  float* kt = nullptr;      // Hkv x K^T tiles of 16 keys, each kpad * D (fp32 kernel)
  float* vf = nullptr;      // Hkv x V rows, each kpad * D (fp32 kernel)
};

// One unit of a pass: (sequence, KV head, first key, keys) when packing,
// (sequence, query head, first row, cost) when attending.
struct PrefillItem {
  int64_t seq, a, b, cost;
};

// The items to torch's threads, longest first, round robin (the causal
// triangle's rows differ in cost); enter() and leave() run on each thread
// around its items (AMX configures its tiles there).
template <typename Enter, typename Leave, typename Body>
void spread_items(std::vector<PrefillItem>& items, Enter&& enter, Leave&& leave, Body&& body) {
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& x, const PrefillItem& y) { return x.cost > y.cost; });
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    enter();
    for (int64_t t = t0; t < t1; ++t) {
      for (size_t j = static_cast<size_t>(t); j < items.size(); j += static_cast<size_t>(nt)) {
        body(items[j]);
      }
    }
    leave();
  });
}

// The packing pass's items: per (sequence, KV head), runs of up to 256 keys
inline std::vector<PrefillItem> pack_items(const std::vector<PrefillSeq>& seqs, int64_t Hkv) {
  constexpr int64_t kPackRows = 256;
  std::vector<PrefillItem> packs;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t t0 = 0; t0 < seqs[i].kpad; t0 += kPackRows) {
        packs.push_back({i, kvh, t0, std::min(kPackRows, seqs[i].kpad - t0)});
      }
    }
  }
  return packs;
}

// The attend pass's items: per (sequence, query head, block of ``rows`` query
// rows), costed by the key blocks the block visits
inline std::vector<PrefillItem> block_items(const std::vector<PrefillSeq>& seqs, int64_t H,
                                            int64_t rows) {
  std::vector<PrefillItem> blocks;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    for (int64_t r0 = 0; r0 < seqs[i].len; r0 += rows) {
      const int64_t cost = (seqs[i].computed + r0 + rows) / kKeyBlock + 1;
      for (int64_t h = 0; h < H; ++h) blocks.push_back({i, h, r0, cost});
    }
  }
  return blocks;
}

// A kernel's per-sequence scratch (packed K/V of every KV head) grows with the
// context: a step of many chunks over long contexts would hold hundreds of MB at
// once. fn(group, bytes) runs on consecutive groups of ``seqs`` whose scratch
// (``bytes_per_key`` per padded key) stays under kPrefillScratchBytes; a group
// holds at least one sequence (one context's own scratch is the floor).
constexpr int64_t kPrefillScratchBytes = int64_t{64} << 20;

template <typename Fn>
void in_scratch_groups(const std::vector<PrefillSeq>& seqs, int64_t bytes_per_key, Fn&& fn) {
  size_t first = 0;
  while (first < seqs.size()) {
    size_t last = first;
    int64_t bytes = 0;
    while (last < seqs.size()) {
      const int64_t need = seqs[last].kpad * bytes_per_key;
      if (last > first && bytes + need > kPrefillScratchBytes) break;
      bytes += need;
      ++last;
    }
    std::vector<PrefillSeq> group(seqs.begin() + static_cast<std::ptrdiff_t>(first),
                                  seqs.begin() + static_cast<std::ptrdiff_t>(last));
    fn(group, bytes);
    first = last;
  }
}

// The fp32 kernel (prefill_attention_f32.cpp, AVX2): q fp32, a bf16 or fp32 cache, out
// fp32; prefill_attention checks the arguments and lists the sequences.
bool prefill_attention_f32_available();
void prefill_attention_f32(std::vector<PrefillSeq>& seqs, const at::Tensor& q,
                           const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                           float scale);

#if defined(LLM_HAVE_AVX512BF16)
constexpr float kLazyMax = 8.f;     // log2 headroom before the running max is raised

// 2^t on 16 lanes for t <= kLazyMax: a cubic for 2^f (relative error ~1e-4,
// far below the bf16 rounding of P), the integer part put in the exponent
inline __m512 exp2_16(__m512 t) {
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(0.0790199f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2249262f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6960656f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, fi);
}

// V^T tiles of keys [t0, t1) (multiples of 32) of one (sequence, KV head):
// tile (key block kb of 32, dims 16 dc .. 16 dc + 15) = [16 dims][32 keys]
template <int64_t kD>
void pack_values(const PrefillSeq& s, const BFloat16* vc, int64_t kvh, int64_t Hkv, int64_t bs,
                 int64_t t0, int64_t t1) {
  const int64_t ctx = s.computed + s.len;
  const int64_t stride = Hkv * kD;
  uint16_t* vt = reinterpret_cast<uint16_t*>(s.vt + kvh * s.kpad * kD);
  alignas(64) uint16_t rows[32][kD];
  for (int64_t base = t0; base < t1; base += 32) {
    for (int64_t t = 0; t < 32; ++t) {
      const int64_t pos = base + t;
      if (pos < ctx) {
        std::memcpy(rows[t], vc + (s.table[pos / bs] * bs + pos % bs) * stride + kvh * kD, kD * 2);
      } else {
        std::memset(rows[t], 0, kD * 2);
      }
    }
    for (int64_t dc = 0; dc < kD / 16; ++dc) {
      uint16_t* tile = vt + ((base / 32) * (kD / 16) + dc) * 512;
      for (int64_t d = 0; d < 16; ++d) {
        for (int64_t t = 0; t < 32; ++t) tile[d * 32 + t] = rows[t][dc * 16 + d];
      }
    }
  }
}

// [16 rows][32] fp32 pairs -> one row of pairs: lane n = (even[n], odd[n]) in bf16
inline void pair_rows(const __m512& even, const __m512& odd, uint32_t* dst) {
  static const __m512i interleave = _mm512_set_epi16(  // highest lane first
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even in 0-15, odd in 16-31
  _mm512_store_si512(dst, _mm512_permutexvar_epi16(interleave, both));
}

// One block of up to 16 query rows of one head (rows [r0, r0 + nr) of the
// chunk), its operands and online-softmax state; the lanes are the rows.
template <int64_t kD>
struct RowBlock {
  alignas(64) uint32_t qt[kD / 2][16];         // Q^T: row p = dims (2p, 2p + 1)
  alignas(64) float st[kKeyBlock][16];         // S^T of the key block
  alignas(64) uint32_t pt[kKeyBlock / 2][16];  // P^T: row j = keys (2j, 2j + 1)
  alignas(64) float acc[kD][16];               // O^T
  __m512 c, pos, m, l;
  __mmask16 rows_valid;
  int64_t first, last;  // positions of the first and last row

  RowBlock(const PrefillSeq& s, const BFloat16* q, int64_t q_stride, int64_t h, int64_t r0,
           int64_t nr, float scale)
      : c(_mm512_set1_ps(scale * 1.44269504088896341f)),  // to base 2
        m(_mm512_set1_ps(-1e30f)),
        l(_mm512_setzero_ps()),
        rows_valid(static_cast<__mmask16>(nr == 16 ? 0xFFFF : (1u << nr) - 1)),
        first(s.computed + r0),
        last(s.computed + r0 + nr - 1) {
    pos = _mm512_add_ps(_mm512_set1_ps(static_cast<float>(first)),
                        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    alignas(64) uint32_t qrows[16][kD / 2];
    for (int64_t i = 0; i < 16; ++i) {
      if (i < nr) {
        std::memcpy(qrows[i], q + (s.row + r0 + i) * q_stride + h * kD, kD * 2);
      } else {
        std::memset(qrows[i], 0, kD * 2);
      }
    }
    const __m512i by_row = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(kD / 2));
    for (int64_t p = 0; p < kD / 2; ++p) {
      _mm512_store_si512(qt[p], _mm512_i32gather_epi32(by_row, &qrows[0][p], 4));
    }
    std::memset(acc, 0, sizeof(acc));
  }

  // Keys [k0, k0 + nkeys) are scored in st: keys past a row's position are
  // masked (diagonal blocks only), the max raised where it would overflow the
  // headroom (O^T and the sums rescaled), and P^T = 2^(s * c - m) paired into
  // pt, a masked score giving exactly 0.
  void softmax(int64_t k0, int64_t nkeys) {
    const __m512 neg = _mm512_set1_ps(-1e30f);
    __m512 mx = neg;
    if (k0 + kKeyBlock - 1 > first) {
      for (int64_t r = 0; r < nkeys; ++r) {
        const __mmask16 ok = _mm512_mask_cmp_ps_mask(
            rows_valid, pos, _mm512_set1_ps(static_cast<float>(k0 + r)), _CMP_GE_OQ);
        const __m512 v = _mm512_mask_mov_ps(neg, ok, _mm512_load_ps(st[r]));
        _mm512_store_ps(st[r], v);
        mx = _mm512_max_ps(mx, v);
      }
    } else {
      for (int64_t r = 0; r < nkeys; ++r) mx = _mm512_max_ps(mx, _mm512_load_ps(st[r]));
    }
    mx = _mm512_mul_ps(mx, c);
    const __mmask16 raise = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m, _mm512_set1_ps(kLazyMax)),
                                               _CMP_GT_OQ);
    if (raise) {
      const __m512 m_new = _mm512_mask_mov_ps(m, raise, mx);
      const __m512 alpha = exp2_16(_mm512_sub_ps(m, m_new));
      m = m_new;
      l = _mm512_mul_ps(l, alpha);
      for (int64_t d = 0; d < kD; ++d) {
        _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), alpha));
      }
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t r = 0; r < kKeyBlock; r += 2) {
      __m512 pe = _mm512_setzero_ps(), po = _mm512_setzero_ps();
      if (r < nkeys) {
        pe = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st[r]), c, m));
        po = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st[r + 1]), c, m));
        sum = _mm512_add_ps(sum, _mm512_add_ps(pe, po));
      }
      pair_rows(pe, po, pt[r / 2]);
    }
    l = _mm512_add_ps(l, sum);
  }

  // O = (O^T)^T / l into rows [r0, r0 + nr) of head h
  void store(const PrefillSeq& s, BFloat16* out, int64_t out_stride, int64_t h, int64_t r0,
             int64_t nr) {
    const __m512 inv = _mm512_maskz_div_ps(
        _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), l);
    for (int64_t d = 0; d < kD; ++d) {
      _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), inv));
    }
    const __m512i by_dim = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    for (int64_t i = 0; i < nr; ++i) {  // row i of O is column i of O^T
      BFloat16* o = out + (s.row + r0 + i) * out_stride + h * kD;
      for (int64_t d = 0; d < kD; d += 32) {
        const __m512 lo = _mm512_i32gather_ps(by_dim, &acc[d][i], 4);
        const __m512 hi = _mm512_i32gather_ps(by_dim, &acc[d + 16][i], 4);
        _mm512_storeu_si512(o + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
};
#endif

}  // namespace llm_cpu
