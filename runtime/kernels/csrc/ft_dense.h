/* Small fp32 ops of a decode step, where torch spends more on dispatch than on the work, and the batch-invariant
 * fp32 linear of deterministic mode.
 *
 * - ft_gemm_f32: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for any M, fp32 or bf16 weights in torch's Linear layout,
 *   on the kernels' pool. Every (row, output) pair is one dot product reduced in one fixed order — lanes k mod 16
 *   (two 8-lane accumulators, or one 16-lane one on AVX-512), added half to half, a fixed horizontal tree, then the
 *   K mod 16 tail in order — whatever M, the row's place among them, the thread count or the tiling: row i's bits
 *   never depend on the other rows (batch invariance). The AVX-512 path tiles 4 weight rows x up to 4 activation rows
 *   (from 4 rows: a verify row of up to 8 meets each weight tile in L1, a longer chunk goes 4 rows at a time) and
 *   the AVX2 path 3 x 4 from 9 rows up (GEMV_MAX_M), both with the row-at-a-time kernel's bits; the portable path
 *   has its own fixed order (8 lanes, pairwise).
 *   torch's CPU fp32 GEMV runs on one thread at M = 1 and its GEMM changes algorithm with M.
 * - ft_rms_norm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows on the pool when there are many: at one token
 *   torch's F.rms_norm costs ~11 us of dispatch for a microsecond of work, and a decode step runs ~4 per layer.
 *   Each row is reduced in one fixed order (batch invariant).
 *
 * Both accumulate in fp32 in their own order: results differ from torch's by rounding only (tests: max relative
 * error ~1e-6).
 */
#ifndef FT_DENSE_H
#define FT_DENSE_H

#include <math.h>
#include <stdint.h>

#define GEMV_ROWS_PER_ITEM 16
#define GEMV_MAX_M 8

typedef struct {
    const float *w;       /* fp32 weight [N, K], or NULL when wb holds a bf16 one */
    const uint16_t *wb;   /* bf16 weight [N, K]: widened to fp32 (exactly) in registers, or per item (portable) */
    const float *x, *bias;
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

/* a bf16 value as fp32 (exact: the 16 bits become the top of an fp32) */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
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

/* o = x * inv * w (w NULL: x * inv), in that order: the portable loop's bits */
FT_AVX2 static void rms_scale_avx2(const float *x, float inv, const float *w, int64_t k, float *o) {
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
        _mm256_storeu_ps(o + i, w ? _mm256_mul_ps(v, _mm256_loadu_ps(w + i)) : v);
    }
    for (; i < k; i++) o[i] = w ? x[i] * inv * w[i] : x[i] * inv;
}

/* The end of one (weight row, activation row) dot product on the AVX2 paths: the two 8-lane accumulators (lanes
 * k mod 16 below 8, and from 8) added half to half, the fixed horizontal tree, then the K mod 16 tail from `i` in
 * order. Every AVX2 kernel ends its pairs here, so they agree bit for bit. */
FT_AVX2 static inline float finish_f32_avx2(__m256 a0, __m256 a1, const float *w, const float *x,
                                                                int64_t i, int64_t k) {
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (int64_t t = i; t < k; t++) s += w[t] * x[t];
    return s;
}

/* one weight row against m <= GEMV_MAX_M activation rows (row j at x + j * k): the row is read once */
FT_AVX2 static void gemv_row_avx2(const float *w, const float *x, int64_t k, int64_t m, float *out) {
    __m256 acc[GEMV_MAX_M][2];
    for (int64_t j = 0; j < m; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        _mm_prefetch((const char *)(w + i) + FT_TILE_AHEAD, _MM_HINT_T0); /* a row is 4-8 KiB: see ft_tiles.h */
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int64_t j = 0; j < m; j++) {
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * k + i), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * k + i + 8), acc[j][1]);
        }
    }
    for (int64_t j = 0; j < m; j++) out[j] = finish_f32_avx2(acc[j][0], acc[j][1], w, x + j * k, i, k);
}

/* 8 bf16 weights widened to fp32 (exact: the 16 bits become the top of an fp32) */
FT_AVX2 static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* gemv_row_avx2 over a bf16 weight row, widened in registers (decode: the row streams at 2 bytes a value);
 * the same products and sums, so the same bits as widening the row first */
FT_AVX2 static inline float finish_bf16_avx2(__m256 a0, __m256 a1, const uint16_t *w,
                                                                 const float *x, int64_t i, int64_t k) {
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (int64_t t = i; t < k; t++) s += bf16_to_f32(w[t]) * x[t];
    return s;
}

FT_AVX2 static void gemv_row_bf16_avx2(const uint16_t *w, const float *x, int64_t k, int64_t m, float *out) {
    __m256 acc[GEMV_MAX_M][2];
    for (int64_t j = 0; j < m; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        _mm_prefetch((const char *)(w + i) + FT_TILE_AHEAD, _MM_HINT_T0);
        const __m256 w0 = load_bf16x8(w + i), w1 = load_bf16x8(w + i + 8);
        for (int64_t j = 0; j < m; j++) {
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * k + i), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * k + i + 8), acc[j][1]);
        }
    }
    for (int64_t j = 0; j < m; j++) out[j] = finish_bf16_avx2(acc[j][0], acc[j][1], w, x + j * k, i, k);
}

/* 3 weight rows (row r at w + r * k) x 4 activation rows on AVX2, over K values [k0, k1) (multiples of 16): the
 * tile's accumulators st[half][j][r] carry on from the previous K chunk. Each pair's two 8-lane accumulators (lanes
 * k mod 16 below 8, and from 8) are independent chains over K, so they run in two passes: 12 accumulators, 3 weight
 * vectors and 1 activation vector fill the 16 ymm registers, each weight load meets 4 rows and each activation
 * load 3 (12 FMAs per 7 loads, where the row-at-a-time kernel does 8 per 10). Chained over the chunks in order, a
 * pair gets exactly gemv_row_avx2's sums. One body for fp32 weights and for bf16 ones widened in registers. */
#define FT_TILE3X4_AVX2(NAME, WT, LOAD8)                                                                       \
    FT_AVX2 static void NAME(const WT *w, const float *x, int64_t k, int64_t k0, int64_t k1, __m256 st[2][4][3]) { \
        for (int half = 0; half < 2; half++) {                                                                 \
            __m256 acc[4][3];                                                                                  \
            memcpy(acc, st[half], sizeof(acc));                                                                \
            for (int64_t i = k0 + 8 * half; i < k1; i += 16) {                                                 \
                const __m256 w0 = LOAD8(w + i), w1 = LOAD8(w + k + i), w2 = LOAD8(w + 2 * k + i);              \
                for (int j = 0; j < 4; j++) {                                                                  \
                    const __m256 xv = _mm256_loadu_ps(x + j * k + i);                                          \
                    acc[j][0] = _mm256_fmadd_ps(w0, xv, acc[j][0]);                                            \
                    acc[j][1] = _mm256_fmadd_ps(w1, xv, acc[j][1]);                                            \
                    acc[j][2] = _mm256_fmadd_ps(w2, xv, acc[j][2]);                                            \
                }                                                                                              \
            }                                                                                                  \
            memcpy(st[half], acc, sizeof(acc));                                                                \
        }                                                                                                      \
    }

FT_TILE3X4_AVX2(tile3x4_avx2, float, _mm256_loadu_ps)
FT_TILE3X4_AVX2(tile3x4_bf16_avx2, uint16_t, load_bf16x8)

#define GEMM_KC 512 /* K values per chunk: a tile's 3 weight rows and 4 activation rows of a chunk (14 KiB) stay in L1 */

/* Prefill on AVX2: weight rows [0, 3 * (nr / 3)) (fp32 w, or bf16 wb with w NULL) in tiles of 3 against 4 activation
 * rows x, K in L1-sized chunks (every tile of a chunk reuses the activation rows' chunk); y[j * ldy + row]. Returns
 * the rows done (the rest go row at a time). Everything that holds a __m256 lives in AVX2 code. */
FT_AVX2 static int64_t gemm_tiles_avx2(const float *w, const uint16_t *wb, const float *x, int64_t k, int64_t nr,
                                       float *y, int64_t ldy) {
    const int64_t tiles = nr / 3 < GEMV_ROWS_PER_ITEM / 3 ? nr / 3 : GEMV_ROWS_PER_ITEM / 3, kfull = k & ~(int64_t)15;
    __m256 st[GEMV_ROWS_PER_ITEM / 3][2][4][3];
    for (int64_t t = 0; t < tiles; t++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int u = 0; u < 3; u++) st[t][h][j][u] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < kfull; k0 += GEMM_KC) {
        const int64_t k1 = k0 + GEMM_KC < kfull ? k0 + GEMM_KC : kfull;
        for (int64_t t = 0; t < tiles; t++) {
            if (w)
                tile3x4_avx2(w + 3 * t * k, x, k, k0, k1, st[t]);
            else
                tile3x4_bf16_avx2(wb + 3 * t * k, x, k, k0, k1, st[t]);
        }
    }
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t j = 0; j < 4; j++)
            for (int u = 0; u < 3; u++) {
                const int64_t row = 3 * t + u;
                y[j * ldy + row] = w ? finish_f32_avx2(st[t][0][j][u], st[t][1][j][u], w + row * k, x + j * k, kfull, k)
                                     : finish_bf16_avx2(st[t][0][j][u], st[t][1][j][u], wb + row * k, x + j * k, kfull, k);
            }
    return 3 * tiles;
}

/* Lane e of the result = hsum256(lo half + hi half of z[e]) for 16 accumulators at once, bitwise (float addition
 * commutes, so only the tree matters): halves added, then lanes i and i + 4, then i and i + 2, then the pair, each
 * step one add over several accumulators lined up by shuffles (15 adds and ~30 shuffles where one at a time takes
 * 16 x 8 narrow operations and 16 scalar stores). */
FT_VNNI static inline __m512 hsum256x16(const __m512 *z) {
    __m512 v[8], u[4], w[2];
    for (int p = 0; p < 8; p++) /* [v(z[2p]), v(z[2p + 1])], v = lo + hi: 128-bit chunks c0 c1 | c2 c3 */
        v[p] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* chunk c: z[4p + c]'s v0..3 + v4..7 */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* chunk c: [u0 + u2, u1 + u3] of z[8p + c], then of z[8p + 4 + c] */
        w[p] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[2 * p]), _mm512_castps_pd(u[2 * p + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[2 * p]), _mm512_castps_pd(u[2 * p + 1]))));
    /* lane 4c + l: the sum of z[c + 4l] */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

/* 4 weight rows (row r at w + r * k) x JN <= 4 activation rows, out[j * 4 + r]: each pair reduced exactly as
 * gemv_row_avx2 reduces it (a 16-lane accumulator's halves are its two 8-lane ones), each weight load meeting JN
 * rows; one body for fp32 weights and for bf16 ones widened in registers, inlined per JN (a constant) */
#define FT_GEMM4XJ(NAME, WT, LOAD16, SCALAR)                                                                   \
    FT_VNNI static inline __attribute__((always_inline)) void NAME##_j(const WT *w, const float *x, int64_t k,   \
                                                                        float *out, const int jn) {            \
        __m512 acc[4][4];                                                                                      \
        for (int j = 0; j < 4; j++)                                                                            \
            for (int r = 0; r < 4; r++) acc[j][r] = _mm512_setzero_ps();                                       \
        /* weights ahead of each row's read: the next tile's row (short rows: the 4 rows share pages, so the L2   \
         * streamer does not follow them), else FT_TILE_AHEAD bytes on in the row */                          \
        const int64_t ahead = k <= 512 ? 4 * k : FT_TILE_AHEAD / (int64_t)sizeof(WT);                          \
        int64_t i = 0;                                                                                         \
        for (; i + 16 <= k; i += 16) {                                                                         \
            __m512 wv[4];                                                                                      \
            for (int r = 0; r < 4; r++) {                                                                      \
                _mm_prefetch((const char *)(w + r * k + i + ahead), _MM_HINT_T0);                              \
                wv[r] = LOAD16(w + r * k + i);                                                                 \
            }                                                                                                  \
            for (int j = 0; j < jn; j++) {                                                                     \
                const __m512 xv = _mm512_loadu_ps(x + j * k + i);                                              \
                for (int r = 0; r < 4; r++) acc[j][r] = _mm512_fmadd_ps(wv[r], xv, acc[j][r]);                 \
            }                                                                                                  \
        }                                                                                                      \
        _mm512_storeu_ps(out, hsum256x16(&acc[0][0]));                                                         \
        if (i < k)                                                                                             \
            for (int j = 0; j < jn; j++)                                                                       \
                for (int r = 0; r < 4; r++) {                                                                  \
                    float s = out[j * 4 + r];                                                                  \
                    for (int64_t t = i; t < k; t++) s += SCALAR(w[r * k + t]) * x[j * k + t];                  \
                    out[j * 4 + r] = s;                                                                        \
                }                                                                                              \
    }                                                                                                          \
    FT_VNNI static void NAME(const WT *w, const float *x, int64_t k, int jn, float *out) {                     \
        switch (jn) {                                                                                          \
        case 1: NAME##_j(w, x, k, out, 1); break;                                                              \
        case 2: NAME##_j(w, x, k, out, 2); break;                                                              \
        case 3: NAME##_j(w, x, k, out, 3); break;                                                              \
        default: NAME##_j(w, x, k, out, 4); break;                                                             \
        }                                                                                                      \
    }

FT_VNNI static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define FT_SAME(v) (v)
FT_GEMM4XJ(gemm4xj_avx512, float, _mm512_loadu_ps, FT_SAME)
FT_GEMM4XJ(gemm4xj_bf16_avx512, uint16_t, load_bf16x16, bf16_to_f32)
#endif

/* y[j, r0 + r] for weight rows r0 + [0, nr) (row r at w + r * k, fp32, or at wb + r * k, bf16, w NULL) and
 * activation rows j in [j0, j1) */
static void gemv_block(const gemv_ctx *c, const float *w, const uint16_t *wb, int64_t r0, int64_t nr, int64_t j0,
                       int64_t j1) {
    const int64_t k = c->k, n = c->n;
    float out[GEMV_MAX_M * 4];
    int64_t r = 0;
#ifdef FT_X86
    /* from 4 activation rows: tiles of 4 weight rows, each against every row (the last 1-3 too) while it is in L1;
     * fewer rows go a row at a time, which streams weights from memory faster than 4 rows in one page at once */
    if (g_isa >= FT_ISA_AVX512VNNI && j1 - j0 >= 4)
        for (; r + 4 <= nr; r += 4)
            for (int64_t b = j0; b < j1; b += 4) {
                const int jn = (int)(j1 - b < 4 ? j1 - b : 4);
                if (w)
                    gemm4xj_avx512(w + r * k, c->x + b * k, k, jn, out);
                else
                    gemm4xj_bf16_avx512(wb + r * k, c->x + b * k, k, jn, out);
                for (int64_t j = 0; j < jn; j++)
                    for (int u = 0; u < 4; u++) c->y[(b + j) * n + r0 + r + u] = out[j * 4 + u];
            }
    if (g_isa == FT_ISA_AVX2 && j1 - j0 == 4) r = gemm_tiles_avx2(w, wb, c->x + j0 * k, k, nr, c->y + j0 * n + r0, n);
#endif
    for (; r < nr; r++) {
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2) {
            if (w)
                gemv_row_avx2(w + r * k, c->x + j0 * k, k, j1 - j0, out);
            else
                gemv_row_bf16_avx2(wb + r * k, c->x + j0 * k, k, j1 - j0, out);
        } else
#endif
        {
            const float *row = w + r * k; /* the portable path gets fp32 rows (gemv_item widens bf16 ones) */
            for (int64_t j = j0; j < j1; j++) out[j - j0] = dot_f32_c(row, c->x + j * k, k);
        }
        for (int64_t j = j0; j < j1; j++) c->y[j * n + r0 + r] = out[j - j0];
    }
}

/* item = GEMV_ROWS_PER_ITEM weight rows (kept in cache) against every activation row, in blocks of activation rows
 * (all of them up to GEMV_MAX_M, else 4) */
static void gemv_item(void *p, int64_t item) {
    const gemv_ctx *c = (const gemv_ctx *)p;
    const int64_t k = c->k, r0 = item * GEMV_ROWS_PER_ITEM;
    const int64_t nr = c->n - r0 < GEMV_ROWS_PER_ITEM ? c->n - r0 : GEMV_ROWS_PER_ITEM;
    const float *w = c->w ? c->w + r0 * k : NULL;
    const uint16_t *wb = c->w ? NULL : c->wb + r0 * k;
    float *wide = NULL;
#ifdef FT_X86
    if (g_isa < FT_ISA_AVX2)
#endif
        if (!w) { /* portable: widen the item's rows once for all activation rows */
            wide = (float *)malloc(sizeof(float) * (size_t)(nr * k));
            if (!wide) return; /* ft_gemm_f32 pre-checks that this size can be allocated */
            for (int64_t i = 0; i < nr * k; i++) wide[i] = bf16_to_f32(wb[i]);
            w = wide;
        }
    /* up to GEMV_MAX_M rows in one block (each weight tile meets all of them while in L1: a verify row), else blocks
     * of 4 (a prefill chunk: the item's weight rows stay in L2 across blocks) */
    const int64_t step = c->m <= GEMV_MAX_M ? c->m : 4;
    for (int64_t j0 = 0; j0 < c->m; j0 += step) {
        const int64_t j1 = j0 + step < c->m ? j0 + step : c->m;
        gemv_block(c, w, wb, r0, nr, j0, j1);
    }
    if (c->bias)
        for (int64_t j = 0; j < c->m; j++)
            for (int64_t r = 0; r < nr; r++) c->y[j * c->n + r0 + r] += c->bias[r0 + r];
    free(wide);
}

/* y[M, N] = x[M, K] @ W^T (+ bias) for any M; W is fp32 (w) or bf16 (wb, w NULL); everything contiguous.
 * Row i of y is bitwise the same for every M (see the top of the file). Returns 0, or -1 on allocation failure. */
int ft_gemm_f32(const float *w, const uint16_t *wb, int64_t n, int64_t k, const float *x, int64_t m,
                const float *bias, float *y) {
    if (m < 1 || n < 1 || (!w && !wb)) return m == 0 ? 0 : -1;
    if (g_isa < 0) g_isa = detect_isa();
    if (!w) { /* fail here, not silently in an item */
        void *probe = malloc(sizeof(float) * (size_t)(GEMV_ROWS_PER_ITEM * k));
        if (!probe) return -1;
        free(probe);
    }
    gemv_ctx c = {w, wb, x, bias, y, n, k, m};
    ft_parallel_for(gemv_item, &c, (n + GEMV_ROWS_PER_ITEM - 1) / GEMV_ROWS_PER_ITEM);
    return 0;
}

#define GEMM_MAX_PARTS 4

/* Products of different weights (and inputs) in one parallel-for: part p is ft_gemm_f32's y[p] = x[p] @ w[p]^T
 * (same items, same order: bitwise the same as separate calls); an item's part is found by bisection. */
typedef struct {
    const gemv_ctx *part;
    const int64_t *first; /* part p owns items [first[p], first[p + 1]) */
    int64_t parts;
} gemv_many_ctx;

static void gemv_many_item(void *p, int64_t item) {
    const gemv_many_ctx *c = (const gemv_many_ctx *)p;
    int64_t lo = 0, hi = c->parts - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (c->first[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    gemv_item((void *)&c->part[lo], item - c->first[lo]);
}

/* Several fp32 products of the same x[M, K] in one parallel-for (a decode step's q, k and v projections: one hand-out
 * to the pool instead of three): y[p][M, n[p]] = x @ w[p]^T (+ bias[p], NULL: none) for p < parts. Each output is
 * the dot product ft_gemm_f32 computes for it (same items, same order): bitwise the same as separate calls.
 * Returns 0, or -1 on bad arguments. */
int ft_gemm_f32_parts(int parts, const float *const *w, const int64_t *n, int64_t k, const float *x, int64_t m,
                      const float *const *bias, float *const *y) {
    if (parts < 1 || parts > GEMM_MAX_PARTS || m < 1) return m == 0 && parts >= 1 && parts <= GEMM_MAX_PARTS ? 0 : -1;
    if (g_isa < 0) g_isa = detect_isa();
    gemv_ctx part[GEMM_MAX_PARTS];
    int64_t first[GEMM_MAX_PARTS + 1];
    first[0] = 0;
    for (int i = 0; i < parts; i++) {
        if (!w[i] || n[i] < 1) return -1;
        gemv_ctx g = {w[i], NULL, x, bias ? bias[i] : NULL, y[i], n[i], k, m};
        part[i] = g;
        first[i + 1] = first[i] + (n[i] + GEMV_ROWS_PER_ITEM - 1) / GEMV_ROWS_PER_ITEM;
    }
    gemv_many_ctx c = {part, first, parts};
    ft_parallel_for(gemv_many_item, &c, first[parts]);
    return 0;
}

/* The routed experts of one MoE layer in fp32, as they are stored (the reference experts: no quantization):
 * out[t] = sum over j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j] (negative: skipped),
 * added in ascending expert order (each expert's tokens in token order). w13 [E, 2I, D] (the I gate rows, then the
 * I up rows), w2 [E, D, I], contiguous. Every product is ft_gemm_f32's row, so a token's bits do not depend on the
 * other tokens (batch invariant): all hit experts' gate/up rows go to the pool in one hand-out, their down rows in a
 * second, where torch ran two matmuls and a dozen small ops per hit expert. SiLU is g / (1 + exp(-g)). With bf16 set
 * the weights are bf16 (a bf16 checkpoint's experts as stored): widened in registers, the same bits, half the bytes.
 * Returns 0, -1 out of memory, -2 bad arguments (an id >= E). */
#define MOE_F32_SLOTS 1024 /* (token, expert) pairs per pass: bounds the gathered rows (~26 MB at D 2048, I 768) */

int ft_moe_f32(const void *w13v, const void *w2v, int bf16, int64_t e, int64_t d, int64_t inter, const float *x,
               int64_t t, const int64_t *ids, const float *weights, int64_t k, float *out) {
    if (e < 1 || d < 1 || inter < 1 || t < 0 || k < 1 || !w13v || !w2v) return -2;
    if (g_isa < 0) g_isa = detect_isa();
    const float *w13 = bf16 ? NULL : (const float *)w13v, *w2 = bf16 ? NULL : (const float *)w2v;
    const uint16_t *w13b = bf16 ? (const uint16_t *)w13v : NULL, *w2b = bf16 ? (const uint16_t *)w2v : NULL;
    if (bf16) { /* the portable path widens an item's bf16 rows into a buffer: fail here, not silently in an item */
        void *probe = malloc(sizeof(float) * (size_t)(GEMV_ROWS_PER_ITEM * (d > inter ? d : inter)));
        if (!probe) return -1;
        free(probe);
    }
    memset(out, 0, sizeof(float) * (size_t)(t * d));
    int64_t *count = (int64_t *)calloc((size_t)(2 * e + 1), sizeof(int64_t));
    if (!count) return -1;
    int64_t *start = count + e, total = 0;
    for (int64_t i = 0; i < t * k; i++) {
        if (ids[i] >= e) {
            free(count);
            return -2;
        }
        if (ids[i] >= 0) count[ids[i]]++, total++;
    }
    if (total == 0) {
        free(count);
        return 0;
    }
    for (int64_t j = 0, at = 0; j < e; j++) {
        start[j] = at;
        at += count[j];
    }
    start[e] = total;
    const int64_t i2 = 2 * inter, cap = total < MOE_F32_SLOTS ? total : MOE_F32_SLOTS;
    /* slots sorted by expert (each expert's tokens in token order): token, weight; a pass's gathered inputs,
     * gate|up, activations and expert outputs */
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)total);
    float *wt = (float *)malloc(sizeof(float) * (size_t)total);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(cap * (d + i2 + inter + d)));
    gemv_ctx *parts = (gemv_ctx *)malloc(sizeof(gemv_ctx) * (size_t)e);
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(e + 1));
    if (!tok || !wt || !xs || !parts || !first) {
        free(count), free(tok), free(wt), free(xs), free(parts), free(first);
        return -1;
    }
    float *gu = xs + cap * d, *a = gu + cap * i2, *y = a + cap * inter;
    int64_t *fill = count; /* reused: the next free slot of each expert */
    for (int64_t j = 0; j < e; j++) fill[j] = start[j];
    for (int64_t r = 0; r < t; r++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t id = ids[r * k + j];
            if (id < 0) continue;
            const int64_t s = fill[id]++;
            tok[s] = r;
            wt[s] = weights[r * k + j];
        }
    for (int64_t s0 = 0; s0 < total; s0 += cap) { /* passes over slots in order: every token's experts ascend */
        const int64_t s1 = s0 + cap < total ? s0 + cap : total;
        for (int64_t s = s0; s < s1; s++) memcpy(xs + (s - s0) * d, x + tok[s] * d, sizeof(float) * (size_t)d);
        int64_t hit = 0;
        for (int pass = 0; pass < 2; pass++) { /* gate|up of the pass's experts, then their down rows */
            hit = 0;
            first[0] = 0;
            for (int64_t j = 0; j < e; j++) {
                const int64_t lo = start[j] > s0 ? start[j] : s0, hi = start[j + 1] < s1 ? start[j + 1] : s1;
                if (lo >= hi) continue;
                const int64_t n = hi - lo, at = lo - s0;
                const gemv_ctx g = pass == 0 ? (gemv_ctx){w13 ? w13 + j * i2 * d : NULL, w13b ? w13b + j * i2 * d : NULL,
                                                          xs + at * d, NULL, gu + at * i2, i2, d, n}
                                             : (gemv_ctx){w2 ? w2 + j * d * inter : NULL, w2b ? w2b + j * d * inter : NULL,
                                                          a + at * inter, NULL, y + at * d, d, inter, n};
                parts[hit] = g;
                first[hit + 1] = first[hit] + (g.n + GEMV_ROWS_PER_ITEM - 1) / GEMV_ROWS_PER_ITEM;
                hit++;
            }
            gemv_many_ctx many = {parts, first, hit};
            ft_parallel_for(gemv_many_item, &many, first[hit]);
            if (pass == 0)
                for (int64_t s = 0; s < s1 - s0; s++) {
                    const float *g = gu + s * i2, *u = g + inter;
                    float *o = a + s * inter;
                    for (int64_t c = 0; c < inter; c++) o[c] = g[c] / (1.f + expf(-g[c])) * u[c];
                }
        }
        for (int64_t s = s0; s < s1; s++) {
            float *o = out + tok[s] * d;
            const float *ys = y + (s - s0) * d, w = wt[s];
            for (int64_t c = 0; c < d; c++) o[c] += ys[c] * w;
        }
    }
    free(count), free(tok), free(wt), free(xs), free(parts), free(first);
    return 0;
}

typedef struct {
    const float *x, *w;
    int64_t rows, dim;
    float eps;
    float *out;
} norm_ctx;

#define NORM_ROWS_PER_ITEM 16

static void rms_norm_item(void *p, int64_t item) {
    const norm_ctx *c = (const norm_ctx *)p;
    const int64_t dim = c->dim;
    for (int64_t r = item * NORM_ROWS_PER_ITEM; r < c->rows && r < (item + 1) * NORM_ROWS_PER_ITEM; r++) {
        const float *xr = c->x + r * dim;
        float *o = c->out + r * dim;
        float ss;
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2) {
            ss = rms_sumsq_avx2(xr, dim);
        } else
#endif
            ss = dot_f32_c(xr, xr, dim);
        const float inv = 1.f / sqrtf(ss / (float)dim + c->eps);
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2) {
            rms_scale_avx2(xr, inv, c->w, dim, o);
            continue;
        }
#endif
        if (c->w)
            for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * c->w[i];
        else
            for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv;
    }
}

#define NORM_POOL_VALUES (1 << 16) /* below, the calling thread alone (a decode step's norms: ~1 us each) */

/* out[r, :] = x[r, :] * 1/sqrt(mean(x[r, :]^2) + eps) * w (w may be NULL: no scale), rows of `dim` values. */
void ft_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    if (g_isa < 0) g_isa = detect_isa();
    norm_ctx c = {x, w, rows, dim, eps, out};
    const int64_t items = (rows + NORM_ROWS_PER_ITEM - 1) / NORM_ROWS_PER_ITEM;
    if (rows * dim < NORM_POOL_VALUES)
        for (int64_t i = 0; i < items; i++) rms_norm_item(&c, i);
    else
        ft_parallel_for(rms_norm_item, &c, items);
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
