// 4-bit weights, on the AMX GEMM panels of amx.h (it reuses amx_panel); and 8-bit
// ones (Q8_0) on fp32 rows.
//
// A weight whose every block of 32 inputs is exactly d * q + m (q in 0..15, d
// and m fp16) -- what a checkpoint converted from a Q4_1 GGUF holds -- is kept
// at 0.625 bytes per weight instead of 2, in B-tile order so that one packed
// row dequantizes straight into the 32 bf16 of one AMX tile row:
//
//   packed [N / 16, K / 32, 320] uint8, one entry per (16 channels nb, 32 inputs kb):
//     bytes   0..255  16 rows kp of 16 bytes; byte i = lane i (low nibble)
//                     | lane 16 + i (high nibble); lane L of row kp is channel
//                     16 nb + L / 2, input 32 kb + 2 kp + L % 2
//     bytes 256..287  d of the 16 channels, fp16
//     bytes 288..319  m of the 16 channels, fp16
//
// A dequantized row is d * q + m in fp32 rounded to bf16: bit for bit the bf16
// weight the dense path would hold. Decode steps are bound by reading weights,
// so streaming 3.2x fewer bytes is what makes them faster.
//
// fp32 rows (AVX2 with F16C, so every tier): each 16-channel block is dequantized
// once per call into an fp32 panel, d * q + m by one fused multiply-add: bit for
// bit the fp32 weight (q4_pack keeps only weights that round so), 6.4x fewer
// bytes than it. The panel keeps the packed pair order; x is broadcast a pair of
// inputs at a time and the two partial sums of a channel are added at the end.

#include "common.h"
#include "amx.h"
#include "ops.h"

namespace llm_cpu {

namespace {

constexpr int64_t kQ4TileBytes = 320;  // q4.TILE_BYTES
constexpr int64_t kQ8Bytes = 544;      // q4.Q8_TILE_BYTES

// N and K of a packed weight [N / 16, K / 32, tile_bytes] and x [M, K], checked for op
// ``name`` (whose Python packer is ``packer``).
std::pair<int64_t, int64_t> lowbit_shape(const at::Tensor& x, const at::Tensor& packed,
                                         int64_t tile_bytes, const char* name,
                                         const char* packer) {
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == tile_bytes &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              name, ": packed must be uint8 [N / 16, K / 32, ", tile_bytes, "] from ", packer);
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous(),
              name, ": x must be contiguous [M, ", K, "]");
  return {N, K};
}

#ifdef LLM_HAVE_AVX512BF16
#define LLM_HAVE_Q4 1
constexpr int64_t kQ4GemvRows = 8;  // up to this many rows: vdpbf16ps, above: AMX

struct Q4Scales {
  __m512 dlo, dhi, mlo, mhi;  // lane L of a row half: d (or m) of channel L / 2
};

inline Q4Scales q4_scales(const uint8_t* tile) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  return {_mm512_permutexvar_ps(lo, d), _mm512_permutexvar_ps(hi, d),
          _mm512_permutexvar_ps(lo, m), _mm512_permutexvar_ps(hi, m)};
}

// 16 packed bytes -> the 32 bf16 of one tile row
inline __m512bh q4_row(const uint8_t* row, const Q4Scales& s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  const __m512 flo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), s.dlo, s.mlo);
  const __m512 fhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), s.dhi, s.mhi);
  return _mm512_cvtne2ps_pbh(fhi, flo);
}

// Rows 0..M-1 of y for the 16-channel blocks [nb0, nb1): every packed row is
// dequantized once and serves all M rows of x (vdpbf16ps against the row's
// input pair, broadcast); lane n of acc[m] is channel 16 nb + n.
template <int M>
void q4_gemv_blocks(const BFloat16* x, const uint8_t* packed, BFloat16* y, int64_t N, int64_t K,
                    int64_t nb0, int64_t nb1) {
  const int64_t KB = K / 32;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[M];  // up to 16 zmm: every loop over m unrolled, or they spill
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* t = packed + nb * KB * kQ4TileBytes;
    for (int64_t kb = 0; kb < KB; ++kb, t += kQ4TileBytes) {
      prefetch_bytes(t + 4 * kQ4TileBytes, kQ4TileBytes);
      const Q4Scales s = q4_scales(t);
      const BFloat16* xk = x + kb * 32;
      for (int kp = 0; kp < 16; ++kp) {
        const __m512bh w = q4_row(t + kp * 16, s);
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          int32_t pair;
          std::memcpy(&pair, xk + m * K + 2 * kp, sizeof(pair));
          acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + nb * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
    }
  }
}

// Each 16-channel block serves every group of rows before the next block is
// read: its packed bytes come from memory once, from L1 for the later groups.
void q4_gemv(const BFloat16* x, const uint8_t* packed, BFloat16* y, int64_t M, int64_t N,
             int64_t K, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    int64_t m0 = 0;
    for (; M - m0 >= 16; m0 += 16) {  // 16 accumulators: each dequantized row feeds 16 rows
      q4_gemv_blocks<16>(x + m0 * K, packed, y + m0 * N, N, K, nb, nb + 1);
    }
    for (; m0 < M; m0 += kQ4GemvRows) {
      const BFloat16* xm = x + m0 * K;
      BFloat16* ym = y + m0 * N;
      switch (std::min<int64_t>(kQ4GemvRows, M - m0)) {
        case 1: q4_gemv_blocks<1>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 2: q4_gemv_blocks<2>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 3: q4_gemv_blocks<3>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 4: q4_gemv_blocks<4>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 5: q4_gemv_blocks<5>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 6: q4_gemv_blocks<6>(xm, packed, ym, N, K, nb, nb + 1); break;
        case 7: q4_gemv_blocks<7>(xm, packed, ym, N, K, nb, nb + 1); break;
        default: q4_gemv_blocks<8>(xm, packed, ym, N, K, nb, nb + 1); break;
      }
    }
  }
}

#ifdef LLM_HAVE_AMX
// Panels [p0, p1): each 32-channel panel is dequantized once into a tile-order
// buffer (at most 2 * K * 32 bytes, cache resident), then every 32-row chunk
// of x runs on it as amx_gemm_panels does on a bf16 packing.
void amx_q4_panels(const BFloat16* x, const uint8_t* packed, BFloat16* y, int64_t M, int64_t N,
                   int64_t K, int64_t p0, int64_t p1) {
  const int64_t KB = K / 32;
  std::vector<BFloat16> panel(static_cast<size_t>(2 * KB * 512));
  int cur0 = -1, cur1 = -1;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t h = 0; h < 2; ++h) {
      const uint8_t* t = packed + (2 * p + h) * KB * kQ4TileBytes;
      BFloat16* dst = panel.data() + h * KB * 512;
      for (int64_t kb = 0; kb < KB; ++kb, t += kQ4TileBytes, dst += 512) {
        prefetch_bytes(t + 4 * kQ4TileBytes, kQ4TileBytes);
        const Q4Scales s = q4_scales(t);
        for (int kp = 0; kp < 16; ++kp) {
          _mm512_storeu_si512(dst + kp * 32, (__m512i)q4_row(t + kp * 16, s));
        }
      }
    }
    amx_panel(x, panel.data(), panel.data() + KB * 512, y, M, N, K, p, false, cur0, cur1);
  }
  _tile_release();
}
#endif
#endif


#if defined(LLM_HAVE_AVX2) && defined(__F16C__)
#define LLM_HAVE_Q4_F32 1
constexpr int kQ4F32Rows = 6;  // rows of a register tile: 6 x 2 accumulators

// The block's K inputs as fp32: panel[32 (16 kb + kp) + 8 g + i], g = lane group
// (channels 4g..4g+3 of the block), i = 2 c + j: channel 4 g + c, input 32 kb + 2 kp + j.
// 16 fp16 values of a block's channels (d or m) as the panel's 4 lane groups: lane
// 2 c + j of group g holds channel 4 g + c's value.
struct PairScales {
  __m256 g[4];
  explicit PairScales(const uint8_t* p) {
    const __m256i lo4 = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const __m256i hi4 = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
    const __m128i* s = reinterpret_cast<const __m128i*>(p);
    const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128(s)), v1 = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
    g[0] = _mm256_permutevar8x32_ps(v0, lo4);
    g[1] = _mm256_permutevar8x32_ps(v0, hi4);
    g[2] = _mm256_permutevar8x32_ps(v1, lo4);
    g[3] = _mm256_permutevar8x32_ps(v1, hi4);
  }
};

void q4_panel_f32(const uint8_t* t, int64_t KB, float* panel) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < KB; ++kb, t += kQ4TileBytes) {
    prefetch_bytes(t + 4 * kQ4TileBytes, kQ4TileBytes);
    const PairScales d(t + 256), m(t + 288);
    for (int kp = 0; kp < 16; ++kp, panel += 32) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kp * 16));
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int g = 0; g < 4; ++g) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[g]));
        _mm256_storeu_ps(panel + 8 * g, _mm256_fmadd_ps(f, d.g[g], m.g[g]));
      }
    }
  }
}

// Rows 0..R-1 of y, channels 8 h .. 8 h + 7 of a block, from its panel.
template <int R>
void q4_tile_f32(const float* x, int64_t K, const float* panel, float* y, int64_t N, int h) {
  __m256 acc[R][2];  // 12 of the 16 ymm registers at R = 6: every loop over r unrolled
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* p = panel + 16 * h;
  for (int64_t k = 0; k < K; k += 2, p += 32) {
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_castpd_ps(
          _mm256_broadcast_sd(reinterpret_cast<const double*>(x + r * K + k)));
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {  // [c0 c1 c4 c5 | c2 c3 c6 c7] -> c0..c7
    const __m256 s = _mm256_hadd_ps(acc[r][0], acc[r][1]);
    _mm256_storeu_ps(y + r * N + 8 * h,
                     _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8)));
  }
}

// 8-bit tiles (q8_pack: the q bytes already in panel order, then 16 fp16 d): d * q,
// exact in fp32, so again the weight bit for bit.

void q8_panel_f32(const uint8_t* t, int64_t KB, float* panel) {
  for (int64_t kb = 0; kb < KB; ++kb, t += kQ8Bytes) {
    prefetch_bytes(t + 4 * kQ8Bytes, kQ8Bytes);
    const PairScales d(t + 512);
    for (int kp = 0; kp < 16; ++kp, panel += 32) {
      for (int g = 0; g < 4; ++g) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 * kp + 8 * g));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        _mm256_storeu_ps(panel + 8 * g, _mm256_mul_ps(f, d.g[g]));
      }
    }
  }
}

// Channel blocks [nb0, nb1) of y: each block's panel dequantized once (Panel: the
// 4- or 8-bit tile reader), then every 6 rows of x run on it, one half at a time.
template <void (*Panel)(const uint8_t*, int64_t, float*), int64_t TileBytes>
void lowbit_f32_blocks(const float* x, const uint8_t* packed, float* y, int64_t M, int64_t N,
                       int64_t K, int64_t nb0, int64_t nb1) {
  const int64_t KB = K / 32;
  std::vector<float> panel(static_cast<size_t>(16 * K));
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    Panel(packed + nb * KB * TileBytes, KB, panel.data());
    for (int h = 0; h < 2; ++h) {
      for (int64_t m0 = 0; m0 < M; m0 += kQ4F32Rows) {
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N + nb * 16;
        switch (std::min<int64_t>(kQ4F32Rows, M - m0)) {
          case 1: q4_tile_f32<1>(xm, K, panel.data(), ym, N, h); break;
          case 2: q4_tile_f32<2>(xm, K, panel.data(), ym, N, h); break;
          case 3: q4_tile_f32<3>(xm, K, panel.data(), ym, N, h); break;
          case 4: q4_tile_f32<4>(xm, K, panel.data(), ym, N, h); break;
          case 5: q4_tile_f32<5>(xm, K, panel.data(), ym, N, h); break;
          default: q4_tile_f32<6>(xm, K, panel.data(), ym, N, h); break;
        }
      }
    }
  }
}

// y = x @ W^T for fp32 rows, 16-channel blocks spread over the threads.
template <void (*Panel)(const uint8_t*, int64_t, float*), int64_t TileBytes>
void lowbit_f32(const at::Tensor& x, const uint8_t* packed, at::Tensor& y, int64_t N, int64_t K) {
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t M = x.size(0);
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
    lowbit_f32_blocks<Panel, TileBytes>(xp, packed, yp, M, N, K, b0, b1);
  });
}
#endif

}  // namespace

bool q4_available(at::ScalarType dtype) {
#ifdef LLM_HAVE_Q4
  if (dtype == at::kBFloat16) return true;
#endif
#ifdef LLM_HAVE_Q4_F32
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// y [M, N] = x [M, K] @ W^T for a 4-bit packed W (layout above), in x's dtype:
// bf16 (AVX512-BF16 builds) or fp32 (AVX2 builds and up).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed) {
  const auto [N, K] = lowbit_shape(x, packed, kQ4TileBytes, "q4_linear", "q4_pack");
  TORCH_CHECK(q4_available(x.scalar_type()), "q4_linear: no 4-bit kernel for ",
              x.scalar_type(), " rows in this kernel build (bf16 needs AVX512-BF16, ",
              "float32 AVX2 with F16C)");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
#ifdef LLM_HAVE_Q4_F32
  if (x.scalar_type() == at::kFloat) {
    lowbit_f32<q4_panel_f32, kQ4TileBytes>(x, pp, y, N, K);
    return y;
  }
#endif
#ifdef LLM_HAVE_Q4
  const BFloat16* xp = x.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
#ifdef LLM_HAVE_AMX
  if (M > kQ4GemvRows && N % 32 == 0 && amx_available()) {
    at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
      amx_q4_panels(xp, pp, yp, M, N, K, p0, p1);
    });
    return y;
  }
#endif
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
    q4_gemv(xp, pp, yp, M, N, K, b0, b1);
  });
#endif
  return y;
}

// y [M, N] fp32 = x [M, K] fp32 @ W^T for an 8-bit packed W (q4.q8_pack).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed) {
  const auto [N, K] = lowbit_shape(x, packed, kQ8Bytes, "q8_linear", "q8_pack");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "q8_linear: x must be float32");
  TORCH_CHECK(q4_available(at::kFloat),
              "q8_linear: this kernel build has no AVX2 with F16C");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef LLM_HAVE_Q4_F32
  lowbit_f32<q8_panel_f32, kQ8Bytes>(x, packed.data_ptr<uint8_t>(), y, N, K);
#endif
  return y;
}

}  // namespace llm_cpu
