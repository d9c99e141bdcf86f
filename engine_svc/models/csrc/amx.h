// The AMX tile state and the bf16 GEMM panels on it, shared by the AMX linear
// (linear.cpp), the 4-bit weights (q4_linear.cpp) and prefill attention.
#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llm_cpu {

// ---------------------------------------------------------------- AMX GEMM
// y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation on AMX tiles,
// from a weight packed once at load into tile order: for each block of 16
// output channels and each 32 of K, one 1 KB tile whose row kp holds the
// (k = 2kp, 2kp + 1) pairs of the 16 channels (the layout TDPBF16PS reads).
// Each thread owns blocks of 32 channels and walks their packed weights
// front to back, so a decode step streams every weight once, in order; for
// more than 32 rows the 32-channel panel is reused from cache by every
// 32-row chunk of x. Tiles: 0-3 C (rows 0-15 / 16-31 x channel halves), 4-5
// A (x rows), 6-7 B (weights).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLM_HAVE_AMX 1

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline bool amx_permitted() {  // Linux hands out the tile state only on request
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline void amx_configure(int rows0, int rows1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1);
  if (rows1 == 0) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

// One 32-channel panel: b0 and b1 are its two 16-channel halves, KB tiles each
// (tile order). ``stream`` prefetches them a few tiles ahead (weights read from
// memory); a panel already in cache needs none. cur0/cur1 track the tile config.
inline void amx_panel(const BFloat16* x, const BFloat16* b0, const BFloat16* b1, BFloat16* y,
               int64_t M, int64_t N, int64_t K, int64_t p, bool stream, int& cur0, int& cur1) {
  const int64_t KB = K / 32;
  const int64_t tile_elems = 16 * 32;  // one packed tile: 16 rows of 32 bf16
  alignas(64) float buf[32][32];
  for (int64_t mc = 0; mc < M; mc += 32) {
    const int rows0 = static_cast<int>(std::min<int64_t>(16, M - mc));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(M - mc - 16, 0, 16));
    if (rows0 != cur0 || rows1 != cur1) {
      amx_configure(rows0, rows1);
      cur0 = rows0;
      cur1 = rows1;
    }
    const BFloat16* xa = x + mc * K;
    const BFloat16* xb = xa + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (stream && mc == 0 && kb + 4 < KB) {  // the weight streams, a few tiles ahead
        const char* n0 = reinterpret_cast<const char*>(b0 + (kb + 4) * tile_elems);
        const char* n1 = reinterpret_cast<const char*>(b1 + (kb + 4) * tile_elems);
        for (int c = 0; c < 1024; c += 64) {
          _mm_prefetch(n0 + c, _MM_HINT_T0);
          _mm_prefetch(n1 + c, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, xa + kb * 32, K * 2);
      _tile_loadd(6, b0 + kb * tile_elems, 64);
      _tile_loadd(7, b1 + kb * tile_elems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (rows1) {
        _tile_loadd(5, xb + kb * 32, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &buf[0][0], 128);
    _tile_stored(1, &buf[0][16], 128);
    if (rows1) {
      _tile_stored(2, &buf[16][0], 128);
      _tile_stored(3, &buf[16][16], 128);
    }
    for (int r = 0; r < rows0 + rows1; ++r) {  // 32 fp32 -> bf16 (RNE) per row
      BFloat16* yr = y + (mc + r) * N + 32 * p;
#ifdef LLM_HAVE_AVX512BF16
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(&buf[r][16]),
                                                _mm512_load_ps(&buf[r][0]));
      _mm512_storeu_si512(yr, (__m512i)both);
#else
      for (int c = 0; c < 32; ++c) yr[c] = from_f<BFloat16>(buf[r][c]);
#endif
    }
  }
}

inline void amx_gemm_panels(const BFloat16* x, const BFloat16* packed, BFloat16* y, int64_t M,
                     int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const int64_t KB = K / 32;
  int cur0 = -1, cur1 = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const BFloat16* b0 = packed + (2 * p) * KB * 512;
    amx_panel(x, b0, b0 + KB * 512, y, M, N, K, p, true, cur0, cur1);
  }
  _tile_release();
}
#endif

}  // namespace llm_cpu
