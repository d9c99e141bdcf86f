/* Paged decode attention for CPU, fp32, reading K/V straight from the block
 * table (no gather copy). One work item per (sequence, kv head); the G query
 * heads sharing that kv head reuse each K/V row while it is in cache.
 *
 * Layouts: q/out [B, H, D]; k/v cache [num_blocks, block_size, Hkv, D];
 * block_tables [B, max_blocks] int64; context_lens [B] int64.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens,
                            float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, int64_t max_ctx,
                            float scale, int num_threads) {
  const int64_t G = H / Hkv;
#pragma omp parallel num_threads(num_threads)
  {
    float *scores = (float *)malloc(sizeof(float) * G * (max_ctx > 0 ? max_ctx : 1));
    float *mx = (float *)malloc(sizeof(float) * G);
    float *inv = (float *)malloc(sizeof(float) * G);
#pragma omp for schedule(dynamic)
    for (int64_t w = 0; w < B * Hkv; ++w) {
      const int64_t b = w / Hkv, kvh = w % Hkv, ctx = context_lens[b];
      const int64_t *bt = block_tables + b * max_blocks;
      const float *qb = q + (b * H + kvh * G) * D;
      float *ob = out + (b * H + kvh * G) * D;
      for (int64_t g = 0; g < G; ++g) mx[g] = -FLT_MAX;
      for (int64_t t = 0; t < ctx; ++t) {
        const float *kp = k_cache + ((bt[t / block_size] * block_size + t % block_size) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float *qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kp[d];
          s *= scale;
          scores[g * max_ctx + t] = s;
          if (s > mx[g]) mx[g] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        float *sg = scores + g * max_ctx;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = expf(sg[t] - mx[g]);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      memset(ob, 0, sizeof(float) * G * D);
      for (int64_t t = 0; t < ctx; ++t) {
        const float *vp = v_cache + ((bt[t / block_size] * block_size + t % block_size) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * max_ctx + t] * inv[g];
          float *og = ob + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += p * vp[d];
        }
      }
    }
    free(scores);
    free(mx);
    free(inv);
  }
}
