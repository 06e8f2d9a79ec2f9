/* Decode attention on the CPU straight from the paged K/V pool: one query token per row, the
   row's keys read where they lie (no gather into a contiguous copy first).

   q: float32 [B, H, D]; kpool, vpool: float32 [S, Hkv, D] (the pool's slots); slots: int64
   [B, L] (a row's key slots in position order, as the pool's block table gives them); lo, hi:
   int32 [B], the positions [lo, hi) a row's query sees; out: float32 [B, H, D].

   A task is one (row, K/V head) pair and its H / Hkv query heads: the scores of every visible
   key (q . k * scale, one pass over the keys), their maximum, the exponentials and their sum, then
   the weighted sum of the values (one pass over the values) divided by the sum. Each sum runs in
   a fixed order over fixed 8-lane partial sums, so a row's output does not depend on the other
   rows of the batch or on how tasks are spread over threads. Tasks are split across OpenMP
   threads (the process's one OpenMP runtime, shared with torch). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int cpu_attention_abi_version(void) { return 1; }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* D a multiple of 8 */
static inline float dot(const float *a, const float *b, int D) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    if (d < D) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* Returns 0, or -1 without scratch memory. G = H / Hkv query heads share a K/V head; GMAX 16. */
int cpu_decode_attention(const float *q, const float *kpool, const float *vpool, const int64_t *slots,
                         const int32_t *lo, const int32_t *hi, float *out, int B, int H, int Hkv, int D, int L,
                         float scale) {
    const int G = H / Hkv;
    if (G > 16 || D % 8) return -2;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int task = 0; task < B * Hkv; task++) {
        const int b = task / Hkv, h = task % Hkv;
        const int n = hi[b] - lo[b];
        float *outb = out + ((int64_t)b * H + (int64_t)h * G) * D;
        if (n <= 0) {
            for (int i = 0; i < G * D; i++) outb[i] = 0.0f;
            continue;
        }
        float *scores = malloc((size_t)G * n * sizeof(float));
        if (!scores) {
            failed = 1;
            continue;
        }
        const float *qb = q + ((int64_t)b * H + (int64_t)h * G) * D;
        const int64_t *row_slots = slots + (int64_t)b * L + lo[b];
        float mx[16], sum[16];
        for (int g = 0; g < G; g++) mx[g] = -INFINITY;
        for (int j = 0; j < n; j++) {
            const float *k = kpool + (row_slots[j] * Hkv + h) * D;
            for (int g = 0; g < G; g++) {
                const float s = dot(qb + (int64_t)g * D, k, D) * scale;
                scores[(int64_t)g * n + j] = s;
                mx[g] = fmaxf(mx[g], s);
            }
        }
        for (int g = 0; g < G; g++) {
            float total = 0.0f;
            float *sg = scores + (int64_t)g * n;
            for (int j = 0; j < n; j++) {
                sg[j] = expf(sg[j] - mx[g]);
                total += sg[j];
            }
            sum[g] = total;
        }
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) outb[(int64_t)g * D + d] = 0.0f;
        for (int j = 0; j < n; j++) {
            const float *v = vpool + (row_slots[j] * Hkv + h) * D;
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(scores[(int64_t)g * n + j]);
                float *o = outb + (int64_t)g * D;
                for (int d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 inv = _mm256_set1_ps(1.0f / sum[g]);
            float *o = outb + (int64_t)g * D;
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
