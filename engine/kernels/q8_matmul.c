/* Int8 matmul for the CPU decode path: int8 weights, int8 activations, exact integer dots.

   y[m, n] = scale[n] * sum_b sx[m, b] * sum_{k in block b} xq[m, k] * w[n, k]

   w: int8 weights, one symmetric float32 scale per output row (scale), packed as
   [N/8][K/8][8 rows][8 k] (N padded to a multiple of 8 with zero rows): a block of 8 output rows is
   one sequential stream of 64-byte lines, so a decode matmul reads memory at streaming speed.

   x: float32 [M, K]. Each row is quantized in blocks of KB values (KB divides K: 128, 64 or 32),
   each block with its own symmetric scale: sx = amax / 127, xq = x * (127 / amax) rounded half to
   even. The products of a block are summed exactly in int32; each block sum is converted to
   float32, multiplied by its scale and added to the row's sum, in block order (a product and a
   sum, two roundings: engine/model/quant.py's reference_matmul computes the same in torch).

   Two forms compute those same integers and the same float operations in the same order, so the
   results are bitwise the same on every CPU, and a row's result does not depend on which other
   rows share the batch or how rows are tiled or split across threads:
   - AVX-512 VNNI (vpdpbusd: 64 byte products per instruction). It multiplies unsigned bytes by
     signed ones, so activations enter as xq + 128 (xq ^ 0x80) and 128 * (the block's weight sum,
     made once per weight: wsum128) comes off each block sum.
   - AVX2: activations widened to int16 once, weights 16 at a time; madd sums pairs into int32.

   Output rows are split across OpenMP threads (the process's one OpenMP runtime, shared with
   torch) in groups of 8-row blocks, handed out in chunks as threads become free (`share`). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int q8_abi_version(void) { return 4; }

/* x [M, K] -> xq [M, K] int8 and sx [M, K / kb]. A block of zeros gets scale 0; a block holding
   inf or NaN gets a NaN scale (its row's outputs are NaN, as a float product's would be). */
void q8_quantize_rows(const float *x, int8_t *xq, float *sx, int M, int K, int kb) {
    const int nb = K / kb;
    for (int64_t mb = 0; mb < (int64_t)M * nb; mb++) {
        const float *xr = x + mb * kb;
        int8_t *q = xq + mb * kb;
        float amax = 0.0f;
        int finite = 1;
        for (int k = 0; k < kb; k++) {
            amax = fmaxf(amax, fabsf(xr[k]));
            finite &= isfinite(xr[k]) != 0;
        }
        if (!finite || amax == 0.0f) {
            for (int k = 0; k < kb; k++) q[k] = 0;
            sx[mb] = finite ? 0.0f : NAN;
            continue;
        }
        const float inv = 127.0f / amax;
        for (int k = 0; k < kb; k++) q[k] = (int8_t)lrintf(xr[k] * inv);
        sx[mb] = amax / 127.0f;
    }
}

static inline void store_rows(__m256 acc, const float *scale, float *y, int m, int n0, int N) {
    float v[8];
    _mm256_storeu_ps(v, acc);
    const int nvalid = N - n0 < 8 ? N - n0 : 8;  /* rows past N are padding */
    for (int r = 0; r < nvalid; r++) y[(int64_t)m * N + n0 + r] = scale[n0 + r] * v[r];
}

/* A block's 8 row sums into the rows' float32 sums: converted, times the block's activation
   scale, added (a product and a sum, as reference_matmul computes them). */
static inline __m256 add_block(__m256 acc, __m256i dot, float sx) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sx)));
}

#define VNNI_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))

/* MT activation rows (xu = xq + 128) against G blocks of 8 weight rows. In acc, lane l sums row
   l / 2's products over k = 4 (l % 2) .. +3 of every 8; each block's pair sums are folded into
   8 row sums (an int32 per row), corrected, and accumulated in float32. */
static inline VNNI_TARGET __attribute__((always_inline)) void vnni_tile(
        const uint8_t *xu, const float *sx, const int8_t *w, const int32_t *wsum128, const float *scale,
        float *y, int m0, const int MT, int b0, const int G, int N, int K, int kb) {
    const int nb = K / kb;
    __m256 yacc[4][8];
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) yacc[i][g] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i acc[4][8];
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++)
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) acc[i][g] = _mm512_setzero_si512();
        for (int k = b * kb; k < (b + 1) * kb; k += 8) {
            __m512i wv[8];
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
                wv[g] = _mm512_loadu_si512((const void *)(w + ((int64_t)(b0 + g) * K + k) * 8));
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++) {
                int64_t xs;
                memcpy(&xs, xu + (int64_t)(m0 + i) * K + k, 8);
                const __m512i xv = _mm512_set1_epi64(xs);
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) acc[i][g] = _mm512_dpbusd_epi32(acc[i][g], xv, wv[g]);
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            const __m256i corr = _mm256_loadu_si256((const __m256i *)(wsum128 + ((int64_t)(b0 + g) * nb + b) * 8));
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++) {
                const __m512i pairs = _mm512_add_epi32(acc[i][g], _mm512_srli_epi64(acc[i][g], 32));
                const __m256i dot = _mm256_sub_epi32(_mm512_cvtepi64_epi32(pairs), corr);
                yacc[i][g] = add_block(yacc[i][g], dot, sx[(int64_t)(m0 + i) * nb + b]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) store_rows(yacc[i][g], scale, y, m0 + i, (b0 + g) * 8, N);
}

/* The AVX2 form: a register holds 2 weight rows x 8 k widened to int16 (h: rows 2h, 2h + 1);
   madd leaves lanes 0-3 summing the first row, 4-7 the second. Three hadds and a permute fold
   the four registers into the 8 row sums. */
static inline __attribute__((always_inline)) void avx2_tile(
        const int16_t *x16, const float *sx, const int8_t *w, const float *scale, float *y,
        int m0, const int MT, int b0, const int G, int N, int K, int kb) {
    const int nb = K / kb;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 yacc[2][2];
#pragma GCC unroll 2
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) yacc[i][g] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i acc[2][2][4];
#pragma GCC unroll 2
        for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) acc[i][g][h] = _mm256_setzero_si256();
        for (int k = b * kb; k < (b + 1) * kb; k += 8) {
            __m256i xv[2];
#pragma GCC unroll 2
            for (int i = 0; i < MT; i++)
                xv[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x16 + (int64_t)(m0 + i) * K + k)));
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) {
                    const __m256i wv = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(w + ((int64_t)(b0 + g) * K + k) * 8 + 16 * h)));
#pragma GCC unroll 2
                    for (int i = 0; i < MT; i++)
                        acc[i][g][h] = _mm256_add_epi32(acc[i][g][h], _mm256_madd_epi16(xv[i], wv));
                }
        }
#pragma GCC unroll 2
        for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) {
                const __m256i lo = _mm256_hadd_epi32(acc[i][g][0], acc[i][g][1]);
                const __m256i hi = _mm256_hadd_epi32(acc[i][g][2], acc[i][g][3]);
                const __m256i dot = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo, hi), order);
                yacc[i][g] = add_block(yacc[i][g], dot, sx[(int64_t)(m0 + i) * nb + b]);
            }
    }
#pragma GCC unroll 2
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) store_rows(yacc[i][g], scale, y, m0 + i, (b0 + g) * 8, N);
}

/* Groups per chunk handed to a thread: about CHUNKS_PER_THREAD chunks each. Threads take chunks as
   they finish the last, so when the OS takes a core from one thread for a while (another process
   on a machine of few cores), the others take the remaining chunks and wait at the end only for
   the chunk it holds, not for its whole share. */
#define CHUNKS_PER_THREAD 16
static int share(int groups) {
    const int c = groups / (CHUNKS_PER_THREAD * omp_get_max_threads());
    return c > 0 ? c : 1;
}

static VNNI_TARGET void vnni_blocks(const uint8_t *xu, const float *sx, const int8_t *w, const int32_t *wsum128,
                                    const float *scale, float *y, int M, int N, int K, int kb) {
    const int blocks = (N + 7) / 8, G = M == 1 ? 8 : 2, groups = (blocks + G - 1) / G;
    const int chunk = share(groups);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int gi = 0; gi < groups; gi++) {
        const int b0 = gi * G;
        if (b0 + G > blocks) {  /* the last, partial group: one block at a time */
            for (int b = b0; b < blocks; b++)
                for (int m = 0; m < M; m++) vnni_tile(xu, sx, w, wsum128, scale, y, m, 1, b, 1, N, K, kb);
        } else if (G == 8) {
            vnni_tile(xu, sx, w, wsum128, scale, y, 0, 1, b0, 8, N, K, kb);
        } else {
            int m = 0;
            for (; m + 4 <= M; m += 4) vnni_tile(xu, sx, w, wsum128, scale, y, m, 4, b0, 2, N, K, kb);
            switch (M - m) {
                case 3: vnni_tile(xu, sx, w, wsum128, scale, y, m, 3, b0, 2, N, K, kb); break;
                case 2: vnni_tile(xu, sx, w, wsum128, scale, y, m, 2, b0, 2, N, K, kb); break;
                case 1: vnni_tile(xu, sx, w, wsum128, scale, y, m, 1, b0, 2, N, K, kb); break;
            }
        }
    }
}

static void avx2_blocks(const int16_t *x16, const float *sx, const int8_t *w, const float *scale, float *y,
                        int M, int N, int K, int kb) {
    const int blocks = (N + 7) / 8, G = M == 1 ? 2 : 1, groups = (blocks + G - 1) / G;
    const int chunk = share(groups);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int gi = 0; gi < groups; gi++) {
        const int b0 = gi * G;
        if (b0 + G > blocks) {
            for (int m = 0; m < M; m++) avx2_tile(x16, sx, w, scale, y, m, 1, b0, 1, N, K, kb);
        } else if (G == 2) {
            avx2_tile(x16, sx, w, scale, y, 0, 1, b0, 2, N, K, kb);
        } else {
            int m = 0;
            for (; m + 2 <= M; m += 2) avx2_tile(x16, sx, w, scale, y, m, 2, b0, 1, N, K, kb);
            if (m < M) avx2_tile(x16, sx, w, scale, y, m, 1, b0, 1, N, K, kb);
        }
    }
}

/* y [M, N] = the product above. isa: 1 AVX-512 VNNI, 0 AVX2. wsum128 [N8/8][K/kb][8]: 128 times
   each block's weight sum per row (VNNI only). Returns 0, or -1 without scratch memory. */
int q8_matmul(const float *x, const int8_t *w, const float *scale, const int32_t *wsum128, float *y,
              int M, int N, int K, int kb, int isa) {
    const int64_t mk = (int64_t)M * K;
    int8_t *xq = malloc((size_t)mk);
    float *sx = malloc((size_t)M * (K / kb) * sizeof(float));
    void *xs = malloc((size_t)mk * (isa ? 1 : 2));
    if (!xq || !sx || !xs) {
        free(xq), free(sx), free(xs);
        return -1;
    }
    q8_quantize_rows(x, xq, sx, M, K, kb);
    if (isa) {
        uint8_t *xu = xs;
        for (int64_t i = 0; i < mk; i++) xu[i] = (uint8_t)xq[i] ^ 0x80;
        vnni_blocks(xu, sx, w, wsum128, scale, y, M, N, K, kb);
    } else {
        int16_t *x16 = xs;
        for (int64_t i = 0; i < mk; i++) x16[i] = xq[i];
        avx2_blocks(x16, sx, w, scale, y, M, N, K, kb);
    }
    free(xq), free(sx), free(xs);
    return 0;
}
