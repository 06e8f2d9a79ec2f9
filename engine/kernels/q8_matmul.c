/* Weight-only int8 matmul for the CPU decode path.

   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]

   x: float32 [M, K] row-major, w: int8 [N, K] row-major (one symmetric scale per output row),
   y: float32 [M, N]. K must be a multiple of 8.

   Every (m, n) dot product accumulates the same 8 lanes over k in the same order and is reduced
   the same way, whatever M is and however rows are tiled or split across threads: a row's result
   does not depend on which other rows share the batch.

   Output rows are split across OpenMP threads (the process's one OpenMP runtime, shared with
   torch). Tiles of 4 activation rows x 2 weight rows keep 8 accumulators in registers; each
   weight row pair is widened to float once per activation tile while it sits in L1. */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 widen8(const int8_t *p) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* MT activation rows (1..4) against weight rows n and n+1 (n+1 may be absent: two == 0). */
static inline __attribute__((always_inline)) void tile(const float *x, const int8_t *w, const float *scale, float *y,
                        int m0, int MT, int n, int two, int N, int K) {
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
           a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
           a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    const int8_t *w0 = w + (int64_t)n * K, *w1 = two ? w0 + K : w0;
    const float *x0 = x + (int64_t)m0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    for (int k = 0; k < K; k += 8) {
        __m256 v0 = widen8(w0 + k), v1 = widen8(w1 + k), xv;
        xv = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(xv, v0, a00); a01 = _mm256_fmadd_ps(xv, v1, a01);
        if (MT > 1) { xv = _mm256_loadu_ps(x1 + k); a10 = _mm256_fmadd_ps(xv, v0, a10); a11 = _mm256_fmadd_ps(xv, v1, a11); }
        if (MT > 2) { xv = _mm256_loadu_ps(x2 + k); a20 = _mm256_fmadd_ps(xv, v0, a20); a21 = _mm256_fmadd_ps(xv, v1, a21); }
        if (MT > 3) { xv = _mm256_loadu_ps(x3 + k); a30 = _mm256_fmadd_ps(xv, v0, a30); a31 = _mm256_fmadd_ps(xv, v1, a31); }
    }
    float s0 = scale[n], s1 = two ? scale[n + 1] : 0.0f;
    float *y0 = y + (int64_t)m0 * N + n;
    y0[0] = s0 * hsum256(a00); if (two) y0[1] = s1 * hsum256(a01);
    if (MT > 1) { y0 += N; y0[0] = s0 * hsum256(a10); if (two) y0[1] = s1 * hsum256(a11); }
    if (MT > 2) { y0 += N; y0[0] = s0 * hsum256(a20); if (two) y0[1] = s1 * hsum256(a21); }
    if (MT > 3) { y0 += N; y0[0] = s0 * hsum256(a30); if (two) y0[1] = s1 * hsum256(a31); }
}

int q8_abi_version(void) { return 1; }

void q8_matmul(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K) {
    int pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < pairs; p++) {
        int n = 2 * p, two = n + 1 < N;
        int m = 0;
        for (; m + 4 <= M; m += 4) tile(x, w, scale, y, m, 4, n, two, N, K);
        switch (M - m) {
            case 3: tile(x, w, scale, y, m, 3, n, two, N, K); break;
            case 2: tile(x, w, scale, y, m, 2, n, two, N, K); break;
            case 1: tile(x, w, scale, y, m, 1, n, two, N, K); break;
        }
    }
}
