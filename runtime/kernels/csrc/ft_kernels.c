/* FreeToken CPU expert kernels: int8-activation GEMV/GEMM over repacked Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / MXFP4
 * weights, and one fused call per MoE layer step (gate+up, SiLU(gate)*up, down, weighted sum over the routed experts).
 *
 * Plain C, no Python C-API: loaded with ctypes. ISA paths are chosen at run time
 * (AVX-512 VNNI on 256-bit vectors, AVX2+FMA+F16C, else portable C).
 *
 * Legend: N weight rows, K reduction dim, nb = K/32 blocks, M activation rows (tokens), T tokens, K_top experts
 * per token, E experts, D hidden size, I expert intermediate size.
 *
 * Weights are repacked 8 rows at a time (layout in ft_tiles.h). Activations are quantized per 32-block to int8
 * (scale = absmax / 127) and the block's d * sum(q) is kept for the zero-point corrections of unsigned codes.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np: the pool keeps its threads on distinct CPUs */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ft_pool.h"
#include "ft_tiles.h"
#include "ft_quant.h"

int64_t ft_packed_bytes(int fmt, int64_t n, int64_t k) {
    return (n + TR - 1) / TR * ((k + QK - 1) / QK) * tile_block_bytes(fmt);
}

/* ---------------------------------------------------------------- activation quantization */

typedef struct {
    int8_t *q;   /* [M, nb*32] */
    float *d;    /* [M, nb] */
    float *s;    /* [M, nb]: d * sum(q) of the block */
    int64_t nb;
} qact;

static void quantize_row_c(const float *x, int64_t k, int64_t nb, int8_t *q, float *d, float *s) {
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

#ifdef FT_X86
/* Same values as quantize_row_c (round-half-even via cvtps, clamp is implied by amax scaling). */
FT_AVX2 static void quantize_row_avx2(const float *x, int64_t k, int64_t nb, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    int64_t full = k / QK;
    for (int64_t b = 0; b < full; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* pack 32 int32 -> 32 int8 in order: packs work per 128-bit lane, so fix the order with a permute */
        __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p8);
        d[b] = amax / 127.f;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(s4);
    }
    if (full < nb) quantize_row_c(x + full * QK, k - full * QK, nb - full, q + full * QK, d + full, s + full);
}
#endif

static void quantize_row(const float *x, int64_t k, int64_t nb, int8_t *q, float *d, float *s) {
#ifdef FT_X86
    if (g_isa < 0) g_isa = detect_isa();
    if (g_isa >= FT_ISA_AVX2) {
        quantize_row_avx2(x, k, nb, q, d, s);
        return;
    }
#endif
    quantize_row_c(x, k, nb, q, d, s);
}

static int qact_alloc(qact *a, int64_t m, int64_t k) {
    a->nb = (k + QK - 1) / QK;
    a->q = (int8_t *)aligned_alloc(64, (size_t)((m * a->nb * QK + 63) / 64 * 64));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * a->nb + 1));
    a->s = (float *)malloc(sizeof(float) * (size_t)(m * a->nb + 1));
    return a->q && a->d && a->s;
}

static void qact_free(qact *a) { free(a->q); free(a->d); free(a->s); }

#include "ft_amx.h"

/* ---------------------------------------------------------------- public: configuration */

int ft_best_isa(void) { return detect_isa(); }

/* The ISA path in use (ft_set_isa, $FREETOKEN_ISA, else the best). */
int ft_get_isa(void) {
    if (g_isa < 0) g_isa = detect_isa();
    return g_isa;
}

/* Force an ISA path (-1 = best available); returns the one in use, or -1 if this CPU lacks it. */
int ft_set_isa(int isa) {
    int best = detect_isa();
    if (isa > best) return -1;
    g_isa = isa < 0 ? best : isa;
    return g_isa;
}

int ft_set_threads(int n) { return ft_pool_resize(n); }

int ft_get_threads(void) { return g_pool.n_workers + 1; }

/* How long idle workers poll for the next job before sleeping; takes effect at once, also for workers polling now.
 * Returns the previous value. */
int ft_set_spin_us(int us) { return atomic_exchange(&g_pool.spin_us, us < 0 ? 0 : us); }

/* ---------------------------------------------------------------- public: linear and dequantize */

/* Tile rows against `count` activation rows (row i = tok ? tok[i] : first + i); the 8 outputs for row i go to
 * out + i * out_stride. Four rows at a time through the 4-token kernel where the ISA has one. */
static void dot_rows(tile_dot_fn dot, tile_dot4_fn dot4, const uint8_t *tile, int64_t nb, const qact *a,
                     const int64_t *tok, int64_t first, int64_t count, float *out, int64_t out_stride) {
    int64_t i = 0;
    if (dot4)
        for (; i + 4 <= count; i += 4) {
            const int8_t *q[4];
            const float *d[4], *s[4];
            float *o[4];
            for (int u = 0; u < 4; u++) {
                int64_t r = tok ? tok[i + u] : first + i + u;
                q[u] = a->q + r * nb * QK;
                d[u] = a->d + r * nb;
                s[u] = a->s + r * nb;
                o[u] = out + (i + u) * out_stride;
            }
            dot4(tile, nb, q, d, s, o);
        }
    for (; i < count; i++) {
        int64_t r = tok ? tok[i] : first + i;
        dot(tile, nb, a->q + r * nb * QK, a->d + r * nb, a->s + r * nb, out + i * out_stride);
    }
}



#define ROWS_PER_ITEM 16 /* 2 tiles: ~5-10 us of work at K=2048, enough to amortize the item hand-out */

typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t n, k, m, nb, tile_stride;
    const qact *a;
    float *y;
    tile_dot_fn dot;
    tile_dot4_fn dot4;
    const amx_panel *panel; /* the activations gathered for AMX, or NULL */
} linear_ctx;

static void linear_item(void *p, int64_t item) {
    const linear_ctx *c = (const linear_ctx *)p;
    float o[64 * TR];
    const int64_t rows = c->panel ? AMX_ROWS : ROWS_PER_ITEM;
    int64_t t0 = item * (rows / TR), t1 = t0 + rows / TR, ntiles = (c->n + TR - 1) / TR;
    if (t1 > ntiles) t1 = ntiles;
    if (c->panel && amx_rows(c->fmt, c->w + t0 * c->tile_stride, c->tile_stride, (int)(t1 - t0),
                             (int)(c->n - t0 * TR < rows ? c->n - t0 * TR : rows), c->panel, 0, c->m,
                             c->y + t0 * TR, c->n))
        return;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = c->w + t * c->tile_stride;
        for (int64_t i0 = 0; i0 < c->m; i0 += 64) {
            int64_t cnt = c->m - i0 < 64 ? c->m - i0 : 64;
            dot_rows(c->dot, c->dot4, tile, c->nb, c->a, NULL, i0, cnt, o, TR);
            for (int64_t i = 0; i < cnt; i++)
                for (int r = 0; r < TR && t * TR + r < c->n; r++) c->y[(i0 + i) * c->n + t * TR + r] = o[i * TR + r];
        }
    }
}

/* Each calling thread keeps its quantized-activation buffers between calls (grown when needed, never shared with
 * another caller; whole cache lines, so no neighbour's writes bounce the lines workers read): no malloc per call. */
static _Thread_local struct {
    int8_t *q;
    float *d, *s;
    int64_t cap_q, cap_b;
} tl_act;

static void *ft_lines(void *old, int64_t bytes) {
    free(old);
    return aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
}

static int qact_scratch(qact *a, int64_t m, int64_t k) {
    a->nb = (k + QK - 1) / QK;
    const int64_t nq = m * a->nb * QK, nbk = m * a->nb + 1;
    if (nq > tl_act.cap_q) {
        tl_act.q = (int8_t *)ft_lines(tl_act.q, nq);
        tl_act.cap_q = tl_act.q ? nq : 0;
    }
    if (nbk > tl_act.cap_b) {
        tl_act.d = (float *)ft_lines(tl_act.d, nbk * (int64_t)sizeof(float));
        tl_act.s = (float *)ft_lines(tl_act.s, nbk * (int64_t)sizeof(float));
        tl_act.cap_b = tl_act.d && tl_act.s ? nbk : 0;
    }
    a->q = tl_act.q;
    a->d = tl_act.d;
    a->s = tl_act.s;
    return tl_act.cap_q >= nq && tl_act.cap_b >= nbk;
}

/* y[M, N] = x[M, K] @ W^T for repacked W (K-quants: K % 256 == 0); returns 0, or -1 on allocation failure. */
#define FT_KEEP_ACT (1 << 20) /* bigger activations (long prefills) are allocated per call and freed */

int ft_linear(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    qact a;
    const int keep = m * ((k + QK - 1) / QK) * QK <= FT_KEEP_ACT;
    if (keep ? !qact_scratch(&a, m, k) : !qact_alloc(&a, m, k)) {
        if (!keep) qact_free(&a);
        return -1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * k, k, a.nb, a.q + i * a.nb * QK, a.d + i * a.nb, a.s + i * a.nb);
    linear_ctx c = {fmt, w, n, k, m, a.nb, a.nb * tile_block_bytes(fmt), &a, y, pick_tile_dot(fmt), pick_tile_dot4(fmt),
                    NULL};
    amx_panel panel;
    uint8_t *panel_mem = NULL;
    if (amx_takes(fmt, m)) { /* gathered once here, read by every 16-row item (without memory: the tile kernels) */
        const int64_t chunks = (m + AMX_TOKENS - 1) / AMX_TOKENS;
        panel_mem = (uint8_t *)aligned_alloc(64, (amx_chunk_bytes(a.nb) * (size_t)chunks + 63) / 64 * 64);
        if (panel_mem) {
            amx_panel_at(&panel, panel_mem, chunks, a.nb);
            panel.bf16 = amx_takes_bf16(amx_bf16_on(), fmt, m); /* q4 / q8 / q4_k / q6_k, enough tokens, bf16 mode */
            amx_fill_ctx f = {fmt, &a, NULL, NULL, NULL, m, &panel, x, k, k, NULL, 0};
            ft_parallel_for(amx_fill_item, &f, chunks);
            c.panel = &panel;
        }
    }
    const int64_t rows = c.panel ? AMX_ROWS : ROWS_PER_ITEM;
    ft_parallel_for(linear_item, &c, (n + rows - 1) / rows);
    free(panel_mem);
    if (!keep) qact_free(&a);
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
    const int64_t tbb = tile_block_bytes(c->fmt);
    const uint8_t *tb = c->w + t * c->nb * tbb;
    float vals[QK];
    for (int64_t b = 0; b < c->nb; b++, tb += tbb) {
        const int64_t len = b * QK + QK <= c->k ? QK : c->k - b * QK;
        for (int r = 0; r < TR && t * TR + r < c->n; r++) {
#ifdef FT_X86
            if (g_isa >= FT_ISA_AVX2) {
                tile_row_dequant_avx2(c->fmt, tb, r, vals);
                memcpy(c->y + (t * TR + r) * c->k + b * QK, vals, sizeof(float) * (size_t)len);
                continue;
            }
#endif
            const float d = tile_scale(tb, r);
            const uint8_t *q = tb + 2 * TR + 4 * r;
            uint8_t raw[QK]; /* this row's bytes of the block, gathered from the chunks */
            if (c->fmt == FT_Q4) {
                for (int j = 0; j < 4; j++) memcpy(raw + 4 * j, q + 32 * j, 4);
                uint8_t codes[QK];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        codes[8 * j + i] = raw[4 * j + i] & 0x0f;
                        codes[8 * j + 4 + i] = raw[4 * j + i] >> 4;
                    }
                for (int v = 0; v < QK; v++) vals[v] = d * (float)((int)codes[v] - 8);
            } else {
                for (int j = 0; j < 8; j++) memcpy(raw + 4 * j, q + 32 * j, 4);
                for (int v = 0; v < QK; v++) vals[v] = d * (float)(int8_t)raw[v];
            }
            memcpy(c->y + (t * TR + r) * c->k + b * QK, vals, sizeof(float) * (size_t)len);
        }
    }
}

static void kq_dequant_item(void *p, int64_t t) {
    const dequant_ctx *c = (const dequant_ctx *)p;
    const int rows = c->n - t * TR < TR ? (int)(c->n - t * TR) : TR;
    kq_dequant_tile(c->fmt, c->w + t * c->nb * tile_block_bytes(c->fmt), c->nb / 8, rows, c->y + t * TR * c->k, c->k);
}

static void mx_dequant_item(void *p, int64_t t) {
    const dequant_ctx *c = (const dequant_ctx *)p;
    const int rows = c->n - t * TR < TR ? (int)(c->n - t * TR) : TR;
    mx_dequant_tile(c->w + t * c->nb * MX_TILE, c->nb, rows, c->y + t * TR * c->k, c->k);
}

/* y[N, K] = the fp32 values of repacked W (the prefill path: dequantize once, then one BLAS matmul). K-quants need
 * K % 256 == 0. */
void ft_dequant(int fmt, const uint8_t *w, int64_t n, int64_t k, float *y) {
    if (g_isa < 0) g_isa = detect_isa();
    dequant_ctx c = {fmt, w, n, k, (k + QK - 1) / QK, y};
    /* the values go to torch.mm next */
    ft_parallel_run(fmt_is_kquant(fmt) ? kq_dequant_item : fmt == FT_MXFP4 ? mx_dequant_item : dequant_item, &c,
                    (n + TR - 1) / TR, 1);
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
    bw_ctx c;
    memset(&c, 0, sizeof c);
    c.buf = buf;
    c.bytes = bytes;
    c.chunk = 64 << 10; /* small enough that every thread gets a share of a one-weight (< 1 MB) read */
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = ft_now_us();
        ft_parallel_for(bw_item, &c, (bytes + c.chunk - 1) / c.chunk);
        double dt = (ft_now_us() - t0) * 1e-6;
        if (dt < best) best = dt;
    }
    return best;
}

#include "ft_moe.h"
#include "ft_dense.h"
#include "ft_attn.h"
#include "ft_layer.h"

/* ---------------------------------------------------------------- public: load-time quantization */

#define QUANT_ROWS_PER_ITEM 32

static int quant_run(const quant_ctx *c, int64_t t0, int64_t t1, uint8_t *out) {
#ifdef FT_X86
    if (g_isa >= FT_ISA_AVX2) return quant_blocks_avx2(c, t0, t1, out);
#endif
    return quant_blocks_c(c, t0, t1, out);
}

static void quant_item(void *p, int64_t item) {
    quant_ctx *c = (quant_ctx *)p;
    int64_t r0 = item * QUANT_ROWS_PER_ITEM, r1 = r0 + QUANT_ROWS_PER_ITEM < c->n ? r0 + QUANT_ROWS_PER_ITEM : c->n;
    const int64_t bb = c->fmt == FT_Q4 ? 18 : 34;
    int bad = 0;
    if (!c->packed) {
        bad = quant_run(c, r0 * c->nb, r1 * c->nb, c->out + r0 * c->nb * bb);
    } else { /* one tile's GGUF blocks at a time (a few KiB), then reordered into the tile */
        uint8_t *g = (uint8_t *)malloc((size_t)(TR * c->nb * bb));
        if (!g) {
            atomic_fetch_or(&c->bad, 2);
            return;
        }
        for (int64_t r = r0; r < r1; r += TR) {
            int64_t rows = r1 - r < TR ? r1 - r : TR;
            bad |= quant_run(c, r * c->nb, (r + rows) * c->nb, g);
            memset(g + rows * c->nb * bb, 0, (size_t)((TR - rows) * c->nb * bb)); /* padding rows: zero blocks */
            pack_tile(c->fmt, g, c->nb, c->out + (r / TR) * c->nb * tile_block_bytes(c->fmt));
        }
        free(g);
    }
    if (bad) atomic_fetch_or(&c->bad, 1);
}

/* GGUF blocks out[N, nb, 34|18] for w[N, K] (dt: 0 fp32, 1 bf16, 2 fp16; K padded with zeros to whole blocks), or
 * with `packed` the same blocks in the tile layout (ft_packed_bytes(fmt, N, K) bytes, pack_blocks's order).
 * Returns 0; | 1 when w holds inf or nan; | 2 when out of memory (out is then meaningless). The workers sleep
 * after the job: the caller goes on with torch work (copying), and a polling worker would only take turns with
 * torch's threads. */
int ft_quantize(int fmt, int dt, const void *w, int64_t n, int64_t k, uint8_t *out, int refine, int packed) {
    if (g_isa < 0) g_isa = detect_isa();
    quant_ctx c = {fmt, refine, dt, (const uint8_t *)w, n, k, (k + QK - 1) / QK, out, packed, 0};
    ft_parallel_run(quant_item, &c, (n + QUANT_ROWS_PER_ITEM - 1) / QUANT_ROWS_PER_ITEM, 1);
    return atomic_load(&c.bad);
}
