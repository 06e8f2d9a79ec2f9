// The elementwise steps of a Gemma 3 decoder layer on the CPU, float32 (engine/kernels/cpu_ops.py):
// Gemma's RMSNorm, the residual add fused with the next norm, and the Q/K head norms with RoPE.
// At decode batch sizes each of these is a few kilobytes of work; as torch ops each is a chain of
// 6-8 small operators, and their dispatch, not their arithmetic, is what a step pays. Rows are
// independent (a row's result never depends on the batch); long inputs split rows over threads.
//
// Each follows the torch reference's operations (kernels/fused_ops.py `_norm`, `add_rmsnorm_ref`,
// `qk_norm_rope_ref`) in the same order; the sum of squares is taken in an order of its own, so
// results equal the reference to float rounding, not bitwise.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PARALLEL_ROWS 16  // fewer rows than this run on the calling thread

// 1 / sqrt(mean(x^2) + eps): squares summed in 16 float lanes, the lanes then in double
static float inv_rms(const float *x, int64_t n, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(x0, x0));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(x1, x1));
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, a0);
    _mm256_storeu_ps(lanes + 8, a1);
    double s = 0.0;
    for (int k = 0; k < 16; k++) s += lanes[k];
    for (; i < n; i++) s += (double)x[i] * (double)x[i];
    float mean = (float)(s / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

// y = x * rsqrt(mean(x^2) + eps) * (offset + w), per row of n
static void norm_row(const float *x, const float *w, float *y, int64_t n, float eps, float offset) {
    float r = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * (offset + w[i]);
}

void rmsnorm_rows(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, float offset) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < rows; t++) norm_row(x + t * n, w, y + t * n, n, eps, offset);
}

// hout = h + norm(d; wp); xout = norm(hout; wn). hout may be h.
void add_rmsnorm_rows(const float *h, const float *d, const float *wp, const float *wn, float *hout, float *xout,
                      int64_t rows, int64_t n, float eps, float offset) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *dt = d + t * n, *ht = h + t * n;
        float *ho = hout + t * n;
        float r = inv_rms(dt, n, eps);
        for (int64_t i = 0; i < n; i++) ho[i] = ht[i] + (dt[i] * r) * (offset + wp[i]);
        norm_row(ho, wn, xout + t * n, n, eps, offset);
    }
}

// One head of D values, in place: norm by w, then RoPE with the token's cos/sin [D]
// (x' = x * cos + rot(x) * sin, rot(x) = (-x[half:], x[:half])).
static void norm_rope_head(float *x, const float *w, const float *c, const float *s, int64_t D, float eps,
                           float offset) {
    float tmp[1024];
    float r = inv_rms(x, D, eps);
    int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) tmp[i] = (x[i] * r) * (offset + w[i]);
    for (int64_t i = 0; i < half; i++) {
        x[i] = tmp[i] * c[i] + (-tmp[i + half]) * s[i];
        x[i + half] = tmp[i + half] * c[i + half] + tmp[i] * s[i + half];
    }
}

// qkv [T, stride] rows holding heads Q heads, then kv_heads K heads (then V, untouched), each D
// values: Q and K heads normalised and rotated in place. cos, sin [T, D].
int qk_norm_rope_rows(float *qkv, int64_t stride, const float *wq, const float *wk, const float *cos,
                      const float *sin, int64_t T, int64_t heads, int64_t kv_heads, int64_t D, float eps,
                      float offset) {
    if (D > 1024 || D % 2) return -2;
#pragma omp parallel for if (T >= PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) norm_rope_head(row + h * D, wq, c, s, D, eps, offset);
        for (int64_t h = 0; h < kv_heads; h++) norm_rope_head(row + (heads + h) * D, wk, c, s, D, eps, offset);
    }
    return 0;
}
