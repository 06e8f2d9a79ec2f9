/* Weight-only int8 matmul for the CPU decode path.

   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]

   x: float32 [M, K] row-major, y: float32 [M, N], scale: float32 [N] (one symmetric scale per
   output row), w: int8 weights packed as [N/8][K/8][8 rows][8 k] (N padded to a multiple of 8
   with zero rows; K a multiple of 8), so that a block of 8 output rows is one sequential stream
   of 64-byte lines: the decode matmul reads memory at streaming speed.

   Every (m, n) dot product accumulates the same 8 lanes over k in the same order and is reduced
   the same way, whatever M is and however rows are tiled or split across threads: a row's result
   does not depend on which other rows share the batch.

   Output rows are split across OpenMP threads (the process's one OpenMP runtime, shared with
   torch) in blocks of 8. Each block is tiled so that 8 accumulators stay in registers (4
   activation rows x 2 weight rows, 2 x 4, or 1 x 8); a weight row is widened to float once per
   activation tile while it sits in L1. */
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

/* MT activation rows (1..4) against NT weight rows (NT * MT <= 8 accumulators in registers).
   Rows past N (nvalid < NT) are padding: computed, not stored. Independent accumulators hide
   the FMA latency: with one activation row, 8 weight rows are in flight. */
static inline __attribute__((always_inline)) void tile(const float *x, const int8_t *w, const float *scale,
                                                       float *y, int m0, const int MT, int n0, const int NT,
                                                       int nvalid, int N, int K) {
    __m256 acc[4][8];
    const int8_t *wb = w + (int64_t)(n0 & ~7) * K + (n0 & 7) * 8;  /* this tile's rows in the block */
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    const float *xr = x + (int64_t)m0 * K;
    for (int k = 0; k < K; k += 8) {
        __m256 wv[8];
        const int8_t *wk = wb + (int64_t)k * 8;
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++) wv[j] = widen8(wk + 8 * j);
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            __m256 xv = _mm256_loadu_ps(xr + (int64_t)i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++)
            if (j < nvalid) y[(int64_t)(m0 + i) * N + n0 + j] = scale[n0 + j] * hsum256(acc[i][j]);
}

int q8_abi_version(void) { return 3; }

void q8_matmul(const float *x, const int8_t *w, const float *scale, float *y, int M, int N, int K) {
    int blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = 8 * b, nvalid = N - n0 < 8 ? N - n0 : 8;
        int m = 0;
        for (; m + 4 <= M; m += 4)
            for (int j = 0; j < 8; j += 2) tile(x, w, scale, y, m, 4, n0 + j, 2, nvalid - j, N, K);
        switch (M - m) {
            case 3: for (int j = 0; j < 8; j += 2) tile(x, w, scale, y, m, 3, n0 + j, 2, nvalid - j, N, K); break;
            case 2: for (int j = 0; j < 8; j += 4) tile(x, w, scale, y, m, 2, n0 + j, 4, nvalid - j, N, K); break;
            case 1: tile(x, w, scale, y, m, 1, n0, 8, nvalid, N, K); break;
        }
    }
}
