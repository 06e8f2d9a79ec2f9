/* Decode attention on the CPU straight from the paged K/V pool: one query token per row, the
   row's keys read where they lie (no gather into a contiguous copy first).

   q: float32 [B, H, D]; kpool, vpool: float32 [S, Hkv, D] (the pool's slots); slots: int64
   [B, L] (a row's key slots: in position order as the pool's block table gives them, or a ring
   layer's slots that the query sees); lo, hi: int32 [B], the entries [lo, hi) of its slots a
   row's query sees; kx, vx: float32 [B, Hkv, D] or NULL, one more key and value per row that the
   pool does not hold yet (a ring layer's new token, stored after the attention), seen after the
   others (then hi counts it: the slots' entries are [lo, hi - 1)); out: float32 [B, H, D].

   A task is one split of a (row, K/V head) pair's visible keys, for its H / Hkv query heads: the
   scores of the split's keys (q . k * scale, one pass over the keys), their maximum, the
   exponentials and their sum, and the weighted sum of the values (one pass over the values); the
   splits are then merged, rescaled to the row's maximum, and divided by the total. Each sum runs
   in a fixed order over fixed 8-lane partial sums, so a row's output does not depend on the other
   rows of the batch or on how tasks are spread over threads. Tasks are handed to OpenMP
   threads (the process's one OpenMP runtime, shared with torch) one at a time as each becomes
   free, so while the OS has one thread off its core the others take the remaining tasks (they
   still wait at the end for the task it holds). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int cpu_attention_abi_version(void) { return 3; }

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

/* One split: the keys [j0, j1) of row b's K/V head h for its G query heads; entry `extra` (if
   in the split) is the row's key kx / value vx instead of a slot's. Leaves the split's maxima
   m[G], exponential sums l[G] and unnormalized outputs o[G][D]. */
static void split(const float *qb, const float *kpool, const float *vpool, const int64_t *row_slots, int j0, int j1,
                  int extra, const float *kx, const float *vx, int Hkv, int h, int G, int D, float scale,
                  float *scores, float *m, float *l, float *o) {
    const int n = j1 - j0;
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int j = 0; j < n; j++) {
        const float *k = j0 + j == extra ? kx : kpool + (row_slots[j0 + j] * Hkv + h) * D;
        for (int g = 0; g < G; g++) {
            const float s = dot(qb + (int64_t)g * D, k, D) * scale;
            scores[(int64_t)g * n + j] = s;
            m[g] = fmaxf(m[g], s);
        }
    }
    for (int g = 0; g < G; g++) {
        float total = 0.0f;
        float *sg = scores + (int64_t)g * n;
        for (int j = 0; j < n; j++) {
            sg[j] = expf(sg[j] - m[g]);
            total += sg[j];
        }
        l[g] = total;
    }
    for (int i = 0; i < G * D; i++) o[i] = 0.0f;
    for (int j = 0; j < n; j++) {
        const float *v = j0 + j == extra ? vx : vpool + (row_slots[j0 + j] * Hkv + h) * D;
        for (int g = 0; g < G; g++) {
            const __m256 p = _mm256_set1_ps(scores[(int64_t)g * n + j]);
            float *og = o + (int64_t)g * D;
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(og + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(og + d)));
        }
    }
}

/* A row's visible keys are cut into splits of SPLIT keys (a fixed size, so how a row is cut
   depends on the row alone), computed as separate tasks and merged in split order: short
   batches of long rows keep every thread busy. Returns 0, -1 without scratch memory, -2 for
   shapes it does not take (G > 16 or D not a multiple of 8). */
#define SPLIT 256
int cpu_decode_attention(const float *q, const float *kpool, const float *vpool, const int64_t *slots,
                         const int32_t *lo, const int32_t *hi, const float *kx, const float *vx, float *out, int B,
                         int H, int Hkv, int D, int L, float scale) {
    const int G = H / Hkv;
    if (G > 16 || D % 8) return -2;
    const int Lx = L + (kx != NULL);  /* entries of the longest row, the extra key included */
    const int S = Lx > 0 ? (Lx + SPLIT - 1) / SPLIT : 1;  /* splits of the longest row */
    const int64_t tasks = (int64_t)B * Hkv * S;
    float *ml = malloc((size_t)tasks * G * 2 * sizeof(float));
    float *o = malloc((size_t)tasks * G * D * sizeof(float));
    if (!ml || !o) {
        free(ml), free(o);
        return -1;
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc((size_t)G * SPLIT * sizeof(float));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int b = (int)(t / ((int64_t)Hkv * S)), h = (int)(t / S % Hkv), sp = (int)(t % S);
            const int j0 = lo[b] + sp * SPLIT, j1 = hi[b] < j0 + SPLIT ? hi[b] : j0 + SPLIT;
            if (!scores || j0 >= j1) continue;  /* past the row's keys: merged as empty */
            const float *qb = q + ((int64_t)b * H + (int64_t)h * G) * D;
            const int64_t x = ((int64_t)b * Hkv + h) * D;
            split(qb, kpool, vpool, slots + (int64_t)b * L, j0, j1, kx ? hi[b] - 1 : -1, kx ? kx + x : NULL,
                  vx ? vx + x : NULL, Hkv, h, G, D, scale, scores, ml + t * G * 2, ml + t * G * 2 + G, o + t * G * D);
        }
        free(scores);
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * Hkv; bh++) {
            const int b = bh / Hkv, h = bh % Hkv;
            const int n = hi[b] - lo[b], splits = n > 0 ? (n + SPLIT - 1) / SPLIT : 0;
            float *outb = out + ((int64_t)b * H + (int64_t)h * G) * D;
            for (int g = 0; g < G; g++) {
                float mx = -INFINITY, total = 0.0f;
                for (int sp = 0; sp < splits; sp++) mx = fmaxf(mx, ml[((int64_t)bh * S + sp) * G * 2 + g]);
                float *og = outb + (int64_t)g * D;
                for (int d = 0; d < D; d++) og[d] = 0.0f;
                for (int sp = 0; sp < splits; sp++) {
                    const int64_t t = (int64_t)bh * S + sp;
                    const float w = expf(ml[t * G * 2 + g] - mx);
                    total += w * ml[t * G * 2 + G + g];
                    const __m256 wv = _mm256_set1_ps(w);
                    const float *os = o + (t * G + g) * D;
                    for (int d = 0; d < D; d += 8)
                        _mm256_storeu_ps(og + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(os + d), _mm256_loadu_ps(og + d)));
                }
                const __m256 inv = _mm256_set1_ps(splits ? 1.0f / total : 0.0f);
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(og + d, _mm256_mul_ps(_mm256_loadu_ps(og + d), inv));
            }
        }
    }
    free(ml), free(o);
    return failed ? -1 : 0;
}
