/* Small fp32 ops of a decode step, where torch spends more on dispatch than on the work.
 *
 * - ft_gemv_f32: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows M (decode), fp32 weights in torch's Linear
 *   layout, on the kernels' pool. torch's CPU fp32 GEMV runs on one thread at M = 1, so on two cores a decode step
 *   over fp32 projections (or a MoE router) read its weights at one core's bandwidth.
 * - ft_rms_norm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, on the calling thread: at one token torch's
 *   F.rms_norm costs ~11 us of dispatch for a microsecond of work, and a decode step runs ~4 per layer.
 *
 * Both accumulate in fp32 in their own order (8 lanes, then a pairwise reduction): results differ from torch's by
 * rounding only (tests: max relative error ~1e-6).
 */
#ifndef FT_DENSE_H
#define FT_DENSE_H

#include <math.h>
#include <stdint.h>

#define GEMV_ROWS_PER_ITEM 16
#define GEMV_MAX_M 8

typedef struct {
    const float *w, *x, *bias;
    float *y;
    int64_t n, k, m;
} gemv_ctx;

static float dot_f32_c(const float *a, const float *b, int64_t k) {
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    for (; i < k; i++) s[i & 7] += a[i] * b[i];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

#ifdef FT_X86
FT_AVX2 static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

FT_AVX2 static float rms_sumsq_avx2(const float *x, int64_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (; i < k; i++) s += x[i] * x[i];
    return s;
}

/* one weight row against up to GEMV_MAX_M activation rows: the row is read from memory once */
FT_AVX2 static void gemv_row_avx2(const float *w, const float *x, int64_t k, int64_t m, float *out) {
    __m256 acc[GEMV_MAX_M][2];
    for (int64_t j = 0; j < m; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int64_t j = 0; j < m; j++) {
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * k + i), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * k + i + 8), acc[j][1]);
        }
    }
    for (int64_t j = 0; j < m; j++) {
        float s = hsum256(_mm256_add_ps(acc[j][0], acc[j][1]));
        for (int64_t t = i; t < k; t++) s += w[t] * x[j * k + t];
        out[j] = s;
    }
}
#endif

static void gemv_item(void *p, int64_t item) {
    const gemv_ctx *c = (const gemv_ctx *)p;
    int64_t r0 = item * GEMV_ROWS_PER_ITEM, r1 = r0 + GEMV_ROWS_PER_ITEM;
    if (r1 > c->n) r1 = c->n;
    float out[GEMV_MAX_M];
    for (int64_t r = r0; r < r1; r++) {
        const float *w = c->w + r * c->k;
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2)
            gemv_row_avx2(w, c->x, c->k, c->m, out);
        else
#endif
            for (int64_t j = 0; j < c->m; j++) out[j] = dot_f32_c(w, c->x + j * c->k, c->k);
        for (int64_t j = 0; j < c->m; j++) c->y[j * c->n + r] = out[j] + (c->bias ? c->bias[r] : 0.f);
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias); M <= GEMV_MAX_M (returns -1 otherwise), everything contiguous fp32. */
int ft_gemv_f32(const float *w, int64_t n, int64_t k, const float *x, int64_t m, const float *bias, float *y) {
    if (m < 1 || m > GEMV_MAX_M) return -1;
    if (g_isa < 0) g_isa = detect_isa();
    gemv_ctx c = {w, x, bias, y, n, k, m};
    ft_parallel_for(gemv_item, &c, (n + GEMV_ROWS_PER_ITEM - 1) / GEMV_ROWS_PER_ITEM);
    return 0;
}

/* out[r, :] = x[r, :] * 1/sqrt(mean(x[r, :]^2) + eps) * w (w may be NULL: no scale), rows of `dim` values. */
void ft_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    if (g_isa < 0) g_isa = detect_isa();
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float ss;
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2) {
            ss = rms_sumsq_avx2(xr, dim);
        } else
#endif
            ss = dot_f32_c(xr, xr, dim);
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        if (w)
            for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
        else
            for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv;
    }
}

/* Rotary embedding of x [T, H, Dh] (contiguous) by cos/sin [T, R/2] into out: the first R channels of each head
 * rotate, the rest are copied. ``half``: pairs (i, i + R/2) (Llama/Qwen); else adjacent pairs (2i, 2i + 1). */
void ft_rope(const float *x, int64_t t, int64_t h, int64_t dh, int64_t r, const float *cos, const float *sin,
             int half, float *out) {
    const int64_t r2 = r / 2;
    for (int64_t i = 0; i < t; i++) {
        const float *c = cos + i * r2, *s = sin + i * r2;
        for (int64_t j = 0; j < h; j++) {
            const float *xi = x + (i * h + j) * dh;
            float *o = out + (i * h + j) * dh;
            if (half)
                for (int64_t u = 0; u < r2; u++) {
                    const float a = xi[u], b = xi[u + r2];
                    o[u] = a * c[u] - b * s[u];
                    o[u + r2] = b * c[u] + a * s[u];
                }
            else
                for (int64_t u = 0; u < r2; u++) {
                    const float a = xi[2 * u], b = xi[2 * u + 1];
                    o[2 * u] = a * c[u] - b * s[u];
                    o[2 * u + 1] = b * c[u] + a * s[u];
                }
            for (int64_t u = r; u < dh; u++) o[u] = xi[u];
        }
    }
}

#endif
