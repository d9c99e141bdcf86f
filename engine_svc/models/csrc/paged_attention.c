/* Paged decode attention for CPU, fp32, reading K/V straight from the block
 * table (no gather copy). One work item per sequence: each token's K/V row
 * (all kv heads, contiguous) is read once and serves every query head.
 *
 * Threads are plain pthreads pulling items from an atomic counter: an OpenMP
 * region here would start a second OpenMP runtime next to torch's, and the
 * two pools' spin-waiting threads fight over the cores.
 *
 * Layouts: q/out [B, H, D]; k/v cache [num_blocks, block_size, Hkv, D];
 * block_tables [B, max_blocks] int64; context_lens [B] int64.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64

typedef struct {
  const float *q, *k_cache, *v_cache;
  const int64_t *block_tables, *context_lens;
  float *out;
  int64_t B, H, Hkv, D, block_size, max_blocks, max_ctx;
  float scale;
  atomic_long next;
} Job;

static void run_item(const Job *j, int64_t b, float *scores, float *mx, float *inv) {
  const int64_t H = j->H, G = j->H / j->Hkv, D = j->D, bs = j->block_size, row = j->Hkv * D;
  const int64_t ctx = j->context_lens[b], stride = j->max_ctx;
  const int64_t *bt = j->block_tables + b * j->max_blocks;
  const float *qb = j->q + b * H * D;
  float *ob = j->out + b * H * D;
  for (int64_t h = 0; h < H; ++h) mx[h] = -FLT_MAX;
  for (int64_t t = 0; t < ctx; ++t) {
    const float *kr = j->k_cache + (bt[t / bs] * bs + t % bs) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float *qh = qb + h * D, *kp = kr + (h / G) * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qh[d] * kp[d];
      s *= j->scale;
      scores[h * stride + t] = s;
      if (s > mx[h]) mx[h] = s;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float sum = 0.f;
    float *sh = scores + h * stride;
    for (int64_t t = 0; t < ctx; ++t) {
      sh[t] = expf(sh[t] - mx[h]);
      sum += sh[t];
    }
    inv[h] = 1.f / sum;
  }
  memset(ob, 0, sizeof(float) * H * D);
  for (int64_t t = 0; t < ctx; ++t) {
    const float *vr = j->v_cache + (bt[t / bs] * bs + t % bs) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * stride + t] * inv[h];
      const float *vp = vr + (h / G) * D;
      float *oh = ob + h * D;
      for (int64_t d = 0; d < D; ++d) oh[d] += p * vp[d];
    }
  }
}

static void *worker(void *arg) {
  Job *j = (Job *)arg;
  const int64_t H = j->H, total = j->B;
  float *scores = (float *)malloc(sizeof(float) * H * (j->max_ctx > 0 ? j->max_ctx : 1));
  float *mx = (float *)malloc(sizeof(float) * H);
  float *inv = (float *)malloc(sizeof(float) * H);
  for (;;) {
    const int64_t w = atomic_fetch_add(&j->next, 1);
    if (w >= total) break;
    run_item(j, w, scores, mx, inv);
  }
  free(scores);
  free(mx);
  free(inv);
  return NULL;
}

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens,
                            float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, int64_t max_ctx,
                            float scale, int num_threads) {
  Job job = {q, k_cache, v_cache, block_tables, context_lens, out, B, H, Hkv, D,
             block_size, max_blocks, max_ctx, scale, 0};
  int64_t items = B;
  int n = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
  if (n > items) n = (int)items;
  pthread_t threads[MAX_THREADS];
  int started = 0;
  for (int i = 1; i < n; ++i)
    if (pthread_create(&threads[started], NULL, worker, &job) == 0) ++started;
  worker(&job);
  for (int i = 0; i < started; ++i) pthread_join(threads[i], NULL);
}
