/* FreeToken CPU expert kernels: int8-activation GEMV/GEMM over repacked Q8_0 / Q4_0 weights, and one fused call
 * per MoE layer step (gate+up, SiLU(gate)*up, down, weighted sum over the routed experts).
 *
 * Plain C, no Python C-API: loaded with ctypes. ISA paths are chosen at run time (AVX2+FMA+F16C, else portable C).
 *
 * Legend: N weight rows, K reduction dim, nb = K/32 blocks, M activation rows (tokens), T tokens, K_top experts
 * per token, E experts, D hidden size, I expert intermediate size.
 *
 * Repacked weight layout ("tiles"): rows are grouped 4 at a time (N padded to a multiple of 4 with zero rows).
 * A tile is nb tile-blocks; a tile-block is fp16 scales[4] (8 bytes) then the 4 rows' block codes, each exactly as
 * in a GGUF block (q8: 32 int8; q4: 16 bytes, low nibble = value j, high nibble = value j + 16). So a tile-block is
 * 8 + 4*32 = 136 bytes (q8) or 8 + 4*16 = 72 bytes (q4), and one 4-row tile streams from one contiguous range.
 *
 * Activations are quantized per 32-block to int8 (scale = absmax / 127), with the block's d * sum(q) kept for the
 * q4 zero-point correction: q4 codes are used unsigned (0..15) and the "-8" is applied once per block:
 *   sum_j d_w (c_j - 8) d_a a_j = d_w d_a sum_j c_j a_j - 8 d_w (d_a sum_j a_j).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ft_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_X86 1
#endif

enum { FT_Q8 = 0, FT_Q4 = 1 };
enum { FT_ISA_PORTABLE = 0, FT_ISA_AVX2 = 1 };

#define QK 32
#define TR 4

static int g_isa = -1;

static inline int qbytes(int fmt) { return fmt == FT_Q4 ? 16 : 32; }
static inline int64_t tile_block_bytes(int fmt) { return 8 + TR * qbytes(fmt); }

int64_t ft_packed_bytes(int fmt, int64_t n, int64_t k) {
    int64_t tiles = (n + TR - 1) / TR, nb = (k + QK - 1) / QK;
    return tiles * nb * tile_block_bytes(fmt);
}

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---------------------------------------------------------------- activation quantization */

typedef struct {
    int8_t *q;   /* [M, nb*32] */
    float *d;    /* [M, nb] */
    float *s;    /* [M, nb]: d * sum(q) of the block */
    int64_t nb;
} qact;

static void quantize_row(const float *x, int64_t k, int64_t nb, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.f;
        int64_t j0 = b * QK, j1 = j0 + QK < k ? j0 + QK : k;
        for (int64_t j = j0; j < j1; j++) amax = fmaxf(amax, fabsf(x[j]));
        float db = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int64_t j = j0; j < j0 + QK; j++) {
            int v = j < j1 ? (int)lrintf(x[j] * inv) : 0;
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[j] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

static int qact_alloc(qact *a, int64_t m, int64_t k) {
    a->nb = (k + QK - 1) / QK;
    a->q = (int8_t *)aligned_alloc(64, (size_t)((m * a->nb * QK + 63) / 64 * 64));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * a->nb + 1));
    a->s = (float *)malloc(sizeof(float) * (size_t)(m * a->nb + 1));
    return a->q && a->d && a->s;
}

static void qact_free(qact *a) { free(a->q); free(a->d); free(a->s); }

/* ---------------------------------------------------------------- 4-row tile dot products */

/* out[r] = dot(row r of the tile, activation row), r = 0..3 */
typedef void (*tile_dot_fn)(const uint8_t *tile, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                            float *out);

static void tile_dot_q8_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                          float *out) {
    (void)as;
    float acc[TR] = {0};
    for (int64_t b = 0; b < nb; b++, t += 8 + TR * 32) {
        const int8_t *a = aq + b * QK;
        for (int r = 0; r < TR; r++) {
            const int8_t *w = (const int8_t *)(t + 8 + r * 32);
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += (int32_t)w[j] * a[j];
            uint16_t h;
            memcpy(&h, t + 2 * r, 2);
            acc[r] += fp16_to_fp32(h) * ad[b] * (float)s;
        }
    }
    for (int r = 0; r < TR; r++) out[r] = acc[r];
}

static void tile_dot_q4_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                          float *out) {
    float acc[TR] = {0};
    for (int64_t b = 0; b < nb; b++, t += 8 + TR * 16) {
        const int8_t *a = aq + b * QK;
        for (int r = 0; r < TR; r++) {
            const uint8_t *w = t + 8 + r * 16;
            int32_t s = 0;
            for (int j = 0; j < 16; j++) s += (int32_t)(w[j] & 0x0f) * a[j] + (int32_t)(w[j] >> 4) * a[j + 16];
            uint16_t h;
            memcpy(&h, t + 2 * r, 2);
            float dw = fp16_to_fp32(h);
            acc[r] += dw * (ad[b] * (float)s - 8.f * as[b]);
        }
    }
    for (int r = 0; r < TR; r++) out[r] = acc[r];
}

#ifdef FT_X86
__attribute__((target("avx2,fma,f16c"))) static void tile_dot_q8_avx2(const uint8_t *t, int64_t nb,
                                                                      const int8_t *aq, const float *ad,
                                                                      const float *as, float *out) {
    (void)as;
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 8 + TR * 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(aq + b * QK));
        __m256i p[TR];
        for (int r = 0; r < TR; r++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 8 + r * 32));
            p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), ones);
        }
        /* [r0 r1 r2 r3 | r0 r1 r2 r3] partial sums of the two 128-bit halves */
        const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)t));
        const __m256 scale = _mm256_mul_ps(_mm256_set_m128(dw, dw), _mm256_set1_ps(ad[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    _mm_storeu_ps(out, r);
}

__attribute__((target("avx2,fma,f16c"))) static void tile_dot_q4_avx2(const uint8_t *t, int64_t nb,
                                                                      const int8_t *aq, const float *ad,
                                                                      const float *as, float *out) {
    __m256 acc = _mm256_setzero_ps();
    __m128 corr = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 8 + TR * 16) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(aq + b * QK));
        __m256i p[TR];
        for (int r = 0; r < TR; r++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(t + 8 + r * 16));
            const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
            p[r] = _mm256_maddubs_epi16(w, a); /* |.| <= 2*15*127: two int16 hadds cannot overflow */
        }
        const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
        const __m256i s = _mm256_madd_epi16(h, ones);
        const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)t));
        const __m256 scale = _mm256_mul_ps(_mm256_set_m128(dw, dw), _mm256_set1_ps(ad[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
        corr = _mm_fmadd_ps(dw, _mm_set1_ps(as[b]), corr);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_fnmadd_ps(_mm_set1_ps(8.f), corr, r);
    _mm_storeu_ps(out, r);
}
#endif

static int detect_isa(void) {
#ifdef FT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return FT_ISA_AVX2;
#endif
    return FT_ISA_PORTABLE;
}

static tile_dot_fn pick_tile_dot(int fmt) {
    if (g_isa < 0) g_isa = detect_isa();
#ifdef FT_X86
    if (g_isa == FT_ISA_AVX2) return fmt == FT_Q4 ? tile_dot_q4_avx2 : tile_dot_q8_avx2;
#endif
    return fmt == FT_Q4 ? tile_dot_q4_c : tile_dot_q8_c;
}

/* ---------------------------------------------------------------- public: configuration */

int ft_best_isa(void) { return detect_isa(); }

/* Force an ISA path (-1 = best available); returns the one in use, or -1 if this CPU lacks it. */
int ft_set_isa(int isa) {
    int best = detect_isa();
    if (isa > best) return -1;
    g_isa = isa < 0 ? best : isa;
    return g_isa;
}

int ft_set_threads(int n) { return ft_pool_resize(n); }

int ft_get_threads(void) { return g_pool.n_workers + 1; }

void ft_set_spin_us(int us) { g_pool.spin_us = us < 0 ? 0 : us; }

/* ---------------------------------------------------------------- public: linear and dequantize */

#define ROWS_PER_ITEM 16 /* 4 tiles: ~10 us of work at K=2048, enough to amortize the item hand-out */

typedef struct {
    const uint8_t *w;
    int64_t n, k, m, nb, tile_stride;
    const qact *a;
    float *y;
    tile_dot_fn dot;
} linear_ctx;

static void linear_item(void *p, int64_t item) {
    const linear_ctx *c = (const linear_ctx *)p;
    float o[TR];
    int64_t t0 = item * (ROWS_PER_ITEM / TR), t1 = t0 + ROWS_PER_ITEM / TR, ntiles = (c->n + TR - 1) / TR;
    if (t1 > ntiles) t1 = ntiles;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = c->w + t * c->tile_stride;
        for (int64_t i = 0; i < c->m; i++) {
            c->dot(tile, c->nb, c->a->q + i * c->nb * QK, c->a->d + i * c->nb, c->a->s + i * c->nb, o);
            for (int r = 0; r < TR && t * TR + r < c->n; r++) c->y[i * c->n + t * TR + r] = o[r];
        }
    }
}

/* y[M, N] = x[M, K] @ W^T for repacked W; returns 0, or -1 on allocation failure. */
int ft_linear(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    qact a;
    if (!qact_alloc(&a, m, k)) { qact_free(&a); return -1; }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * k, k, a.nb, a.q + i * a.nb * QK, a.d + i * a.nb, a.s + i * a.nb);
    linear_ctx c = {w, n, k, m, a.nb, a.nb * tile_block_bytes(fmt), &a, y, pick_tile_dot(fmt)};
    ft_parallel_for(linear_item, &c, (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM);
    qact_free(&a);
    return 0;
}

typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t n, k, nb;
    float *y;
} dequant_ctx;

static void dequant_item(void *p, int64_t t) {
    const dequant_ctx *c = (const dequant_ctx *)p;
    const uint8_t *tb = c->w + t * c->nb * tile_block_bytes(c->fmt);
    for (int64_t b = 0; b < c->nb; b++, tb += tile_block_bytes(c->fmt)) {
        for (int r = 0; r < TR; r++) {
            int64_t row = t * TR + r;
            if (row >= c->n) break;
            uint16_t h;
            memcpy(&h, tb + 2 * r, 2);
            float d = fp16_to_fp32(h), vals[QK];
            if (c->fmt == FT_Q8) {
                const int8_t *q = (const int8_t *)(tb + 8 + r * 32);
                for (int j = 0; j < QK; j++) vals[j] = d * (float)q[j];
            } else {
                const uint8_t *q = tb + 8 + r * 16;
                for (int j = 0; j < 16; j++) {
                    vals[j] = d * (float)((int)(q[j] & 0x0f) - 8);
                    vals[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
                }
            }
            int64_t j0 = b * QK, len = j0 + QK <= c->k ? QK : c->k - j0;
            memcpy(c->y + row * c->k + j0, vals, sizeof(float) * (size_t)len);
        }
    }
}

/* y[N, K] = the fp32 values of repacked W (the prefill path: dequantize once, then one BLAS matmul). */
void ft_dequant(int fmt, const uint8_t *w, int64_t n, int64_t k, float *y) {
    dequant_ctx c = {fmt, w, n, k, (k + QK - 1) / QK, y};
    ft_parallel_for(dequant_item, &c, (n + TR - 1) / TR);
}

/* ---------------------------------------------------------------- public: memory read bandwidth */

typedef struct {
    const uint8_t *buf;
    int64_t chunk, bytes;
    uint64_t sums[FT_MAX_THREADS * 8];
} bw_ctx;

static void bw_item(void *p, int64_t item) {
    bw_ctx *c = (bw_ctx *)p;
    const uint64_t *q = (const uint64_t *)(c->buf + item * c->chunk);
    int64_t n = c->chunk / 8;
    if ((item + 1) * c->chunk > c->bytes) n = (c->bytes - item * c->chunk) / 8;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = 0; i + 4 <= n; i += 4) { s0 ^= q[i]; s1 ^= q[i + 1]; s2 ^= q[i + 2]; s3 ^= q[i + 3]; }
    c->sums[(item % FT_MAX_THREADS) * 8] ^= s0 ^ s1 ^ s2 ^ s3;
}

/* Read `bytes` of buf `reps` times on the pool; returns seconds taken (best rep). */
double ft_read_bandwidth(const uint8_t *buf, int64_t bytes, int reps) {
    static bw_ctx c;
    c.buf = buf;
    c.bytes = bytes;
    c.chunk = 1 << 20;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = ft_now_us();
        ft_parallel_for(bw_item, &c, (bytes + c.chunk - 1) / c.chunk);
        double dt = (ft_now_us() - t0) * 1e-6;
        if (dt < best) best = dt;
    }
    return best;
}

/* ---------------------------------------------------------------- public: one fused MoE layer step */

typedef struct {
    int fmt;
    tile_dot_fn dot;
    const uint8_t *w13, *w2;
    int64_t w13_stride, w2_stride, D, I, nbD, nbI, n13, chunks13;
    int64_t n_groups;
    const int64_t *g_expert, *g_start; /* group g = one active expert: slots [g_start[g], g_start[g+1]) */
    const int64_t *s_token;
    const float *s_weight;
    qact qx, qa;
    float *h;   /* [S, n13] gate|up outputs (n13 = 2I padded to tiles) */
    float *out; /* [T, D] */
} moe_ctx;

static void moe_gate_up_item(void *p, int64_t item) {
    const moe_ctx *c = (const moe_ctx *)p;
    int64_t g = item / c->chunks13, chunk = item % c->chunks13;
    const uint8_t *base = c->w13 + c->g_expert[g] * c->w13_stride;
    int64_t tile_stride = c->nbD * tile_block_bytes(c->fmt), ntiles = c->n13 / TR;
    int64_t t0 = chunk * (ROWS_PER_ITEM / TR), t1 = t0 + ROWS_PER_ITEM / TR;
    if (t1 > ntiles) t1 = ntiles;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t s = c->g_start[g]; s < c->g_start[g + 1]; s++) {
            int64_t tok = c->s_token[s];
            c->dot(base + t * tile_stride, c->nbD, c->qx.q + tok * c->nbD * QK, c->qx.d + tok * c->nbD,
                   c->qx.s + tok * c->nbD, c->h + s * c->n13 + t * TR);
        }
}

static void moe_act_item(void *p, int64_t s) {
    const moe_ctx *c = (const moe_ctx *)p;
    const float *h = c->h + s * c->n13;
    float buf[QK];
    for (int64_t b = 0; b < c->nbI; b++) {
        int64_t j0 = b * QK;
        for (int j = 0; j < QK; j++) {
            int64_t jj = j0 + j;
            if (jj < c->I) {
                float g = h[jj];
                buf[j] = g / (1.f + expf(-g)) * h[c->I + jj];
            } else {
                buf[j] = 0.f;
            }
        }
        quantize_row(buf, QK, 1, c->qa.q + (s * c->nbI + b) * QK, c->qa.d + s * c->nbI + b,
                     c->qa.s + s * c->nbI + b);
    }
}

static void moe_down_item(void *p, int64_t item) {
    const moe_ctx *c = (const moe_ctx *)p;
    int64_t tile_stride = c->nbI * tile_block_bytes(c->fmt), ntiles = (c->D + TR - 1) / TR;
    int64_t t0 = item * (ROWS_PER_ITEM / TR), t1 = t0 + ROWS_PER_ITEM / TR;
    if (t1 > ntiles) t1 = ntiles;
    float o[TR];
    for (int64_t g = 0; g < c->n_groups; g++) {
        const uint8_t *base = c->w2 + c->g_expert[g] * c->w2_stride;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t s = c->g_start[g]; s < c->g_start[g + 1]; s++) {
                c->dot(base + t * tile_stride, c->nbI, c->qa.q + s * c->nbI * QK, c->qa.d + s * c->nbI,
                       c->qa.s + s * c->nbI, o);
                float *y = c->out + c->s_token[s] * c->D + t * TR;
                for (int r = 0; r < TR && t * TR + r < c->D; r++) y[r] += c->s_weight[s] * o[r];
            }
    }
}

/* out[T, D] = sum_k wts[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; ids < 0 are skipped.
 * Expert e's repacked gate|up weight [2I, D] starts at w13 + e * w13_stride, its down weight [D, I] at
 * w2 + e * w2_stride. Returns 0, -1 on allocation failure, -2 on an expert id >= E. */
int ft_moe(int fmt, const uint8_t *w13, int64_t w13_stride, const uint8_t *w2, int64_t w2_stride, int64_t E,
           int64_t D, int64_t I, const float *x, int64_t T, const int64_t *ids, const float *wts, int64_t KT,
           float *out) {
    moe_ctx c;
    memset(&c, 0, sizeof c);
    memset(out, 0, sizeof(float) * (size_t)(T * D));
    int64_t *count = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *g_expert = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
    int64_t *g_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 2));
    int64_t *s_token = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T * KT + 1));
    float *s_weight = (float *)malloc(sizeof(float) * (size_t)(T * KT + 1));
    int64_t *g_of_e = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
    int rc = 0;
    if (!count || !g_expert || !g_start || !s_token || !s_weight || !g_of_e) { rc = -1; goto done; }
    for (int64_t i = 0; i < T * KT; i++) {
        if (ids[i] < 0) continue;
        if (ids[i] >= E) { rc = -2; goto done; }
        count[ids[i]]++;
    }
    int64_t G = 0, S = 0;
    for (int64_t e = 0; e < E; e++) {
        g_of_e[e] = -1;
        if (!count[e]) continue;
        g_of_e[e] = G;
        g_expert[G] = e;
        g_start[G] = S;
        S += count[e];
        count[e] = g_start[G]; /* becomes the fill cursor */
        G++;
    }
    g_start[G] = S;
    for (int64_t i = 0; i < T * KT; i++) {
        if (ids[i] < 0) continue;
        int64_t pos = count[ids[i]]++;
        s_token[pos] = i / KT;
        s_weight[pos] = wts[i];
    }
    if (S == 0) goto done;
    c.fmt = fmt;
    c.dot = pick_tile_dot(fmt);
    c.w13 = w13; c.w2 = w2; c.w13_stride = w13_stride; c.w2_stride = w2_stride;
    c.D = D; c.I = I; c.nbD = (D + QK - 1) / QK; c.nbI = (I + QK - 1) / QK;
    c.n13 = (2 * I + TR - 1) / TR * TR;
    c.chunks13 = (c.n13 + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    c.n_groups = G; c.g_expert = g_expert; c.g_start = g_start; c.s_token = s_token; c.s_weight = s_weight;
    c.out = out;
    c.h = (float *)malloc(sizeof(float) * (size_t)(S * c.n13));
    if (!c.h || !qact_alloc(&c.qx, T, D) || !qact_alloc(&c.qa, S, I)) { rc = -1; goto done; }
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * D, D, c.nbD, c.qx.q + t * c.nbD * QK, c.qx.d + t * c.nbD, c.qx.s + t * c.nbD);
    ft_parallel_for(moe_gate_up_item, &c, G * c.chunks13);
    if (S >= 8) ft_parallel_for(moe_act_item, &c, S);
    else for (int64_t s = 0; s < S; s++) moe_act_item(&c, s);
    ft_parallel_for(moe_down_item, &c, (D + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM);
done:
    free(c.h); qact_free(&c.qx); qact_free(&c.qa);
    free(count); free(g_expert); free(g_start); free(s_token); free(s_weight); free(g_of_e);
    return rc;
}
