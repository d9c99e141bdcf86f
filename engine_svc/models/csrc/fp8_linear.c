/* FP8 (e4m3) weight kernels for CPU: a fused dequantize-GEMV for small batches and
 * a dequantize-to-bf16 for large ones. Weights are [N, K] bytes, row-major; one
 * scale per output row is applied by the caller.
 *
 * e4m3 -> fp32 without a table: for a normal value (exponent field e > 0) the
 * 7 magnitude bits shifted into the fp32 exponent/mantissa, plus a bias of
 * (127 - 7) in the exponent, are the exact fp32 value; a subnormal is m * 2^-9.
 * The loops are branch-free so the compiler vectorizes them. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static inline float e4m3_to_f32(uint8_t b) {
    uint32_t mag = b & 0x7Fu;
    uint32_t bits = (mag << 20) + (120u << 23);
    float normal;
    memcpy(&normal, &bits, 4);
    float sub = (float)(mag & 7u) * (1.0f / 512.0f);
    float v = (mag >> 3) ? normal : sub;
    return (b & 0x80u) ? -v : v;
}

typedef struct {
    const float *x; const uint8_t *w; float *y; uint16_t *out_bf16;
    int64_t m, n, k, n0, n1;
} job_t;

static void *gemv_worker(void *arg) {
    job_t *j = (job_t *)arg;
    float row[j->k];
    for (int64_t n = j->n0; n < j->n1; n++) {
        const uint8_t *wr = j->w + n * j->k;
        for (int64_t i = 0; i < j->k; i++) row[i] = e4m3_to_f32(wr[i]);
        for (int64_t r = 0; r < j->m; r++) {
            const float *xr = j->x + r * j->k;
            float acc = 0.0f;
            for (int64_t i = 0; i < j->k; i++) acc += xr[i] * row[i];
            j->y[r * j->n + n] = acc;
        }
    }
    return NULL;
}

static void *dequant_worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const uint8_t *wr = j->w + n * j->k;
        uint16_t *o = j->out_bf16 + n * j->k;
        for (int64_t i = 0; i < j->k; i++) {
            float f = e4m3_to_f32(wr[i]);
            uint32_t bits;
            memcpy(&bits, &f, 4);
            o[i] = (uint16_t)(bits >> 16); /* exact: e4m3 has 3 mantissa bits */
        }
    }
    return NULL;
}

static void run(void *(*fn)(void *), job_t base, int threads) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    pthread_t tid[64];
    job_t jobs[64];
    int64_t per = (base.n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].n0 = t * per;
        jobs[t].n1 = (t + 1) * per < base.n ? (t + 1) * per : base.n;
        if (t > 0) pthread_create(&tid[t], NULL, fn, &jobs[t]);
    }
    fn(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(tid[t], NULL);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (unscaled), fp32. */
void fp8_gemv(const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    job_t j = {x, w, y, NULL, m, n, k, 0, n};
    run(gemv_worker, j, threads);
}

/* out[n, k] = bf16(w[n, k]) (unscaled). */
void fp8_dequant_bf16(const uint8_t *w, uint16_t *out, int64_t n, int64_t k, int threads) {
    job_t j = {NULL, w, NULL, out, 0, n, k, 0, n};
    run(dequant_worker, j, threads);
}
