/* Attention of query tokens over a KV cache, on the kernels' pool, split over keys.
 *
 * q [T, H, Dh]; keys k[s] = k + s * k_stride (Hkv rows of Dh floats each, contiguous), values likewise [Hkv, Dv];
 * query head h reads kv head h / (H / Hkv); query t sees keys [lo[t], hi[t]) (causal, sliding window, chunk).
 * Items are (a few queries, block of ATTN_BLOCK keys counted from each query's lo[t], kv heads): for each query,
 * the G query heads' scores against its keys, their block max, exp-sum and exp-weighted value sum, written to a
 * scratch row; then each query's blocks are merged in block order (the split-K "flash decoding" combine) in fp32.
 * The vector loops take the G heads of every query that shares a block start as rows of one pass (attn_item_rows),
 * each key and value piece loaded once for 4 rows; no row's arithmetic depends on the others. So a
 * query's bits depend only on its own q, keys and range: the same whether it is decoded alone (T = 1, a decode
 * step) or one of a prefill chunk (batch invariance). K and V are read by every pool thread at once — torch runs
 * the two matmuls on one thread, through a permuted (copied) view of K. exp is a vectorized polynomial (Cephes'
 * expf: relative error ~2e-7 on [-87, 0]).
 *
 * Reading the cache from memory: a pass reads one kv head's part of each row (a quarter of a 1 KiB row for 4 heads
 * of 128 fp16 values), a pattern the hardware stream prefetchers follow poorly (a Zen 4 core read 10-11 GB/s that
 * way and 27 GB/s reading the same rows whole, in address order). Since the pool gives each thread a contiguous run
 * of items, an item prefetches the next block's rows (all of its heads) while it computes (attn_pf: the values
 * during its score passes, the keys during its value passes, a line or a few per inner step), so a block's reads
 * overlap the previous block's arithmetic instead of following it: 1.25-1.7x on decode steps over 4-8k keys from
 * memory. Prefetches change no arithmetic.
 *
 * 16-bit caches (kv_type FT_KV_F16 / FT_KV_BF16: k and v point at IEEE halves / bfloat16s, strides in elements)
 * are read as they are: the AVX2 loops widen 8 values at a time in registers (F16C _mm256_cvtph_ps; bf16: a 16-bit
 * shift) right where the fp32 loops load them, and the portable path widens each block into a per-thread fp32
 * scratch first. Widening is exact and the arithmetic after it is the fp32 code's, so a 16-bit cache gives bitwise
 * what the fp32 kernel gives on the widened cache, on every path, at half the bytes streamed from memory (widening a
 * block into L1 once for all G heads measured 1.3-2x slower on an AVX2 EPYC than widening in registers; sharing each
 * widened register between 4 rows is what pays). The AVX-512 settings run the same arithmetic in 512-bit registers
 * (FT_ATTN_LOOPS512), bitwise equal to the AVX2 loops. One exception, a mode on by default: where the CPU has
 * AVX512-BF16, a bf16 cache's score pass rounds the query rows to bf16 and runs VDPBF16PS (qk_rows512_bf16dot).
 *
 * An 8-bit cache (FT_KV_F8, float8 e4m3fn) is read the same way: 8 or 16 codes zero-extended to 16 bits, moved into an
 * IEEE half's bit places (exact: the half holds the value times 2^-8), widened by F16C and multiplied by 256 (exact),
 * so it too gives bitwise what the fp32 kernel gives on its widened values, at a quarter of fp32's bytes.
 */
#ifndef FT_ATTN_H
#define FT_ATTN_H

#include <math.h>
#include <stdint.h>

#define ATTN_BLOCK 128
#define ATTN_AHEAD 8 /* keys between a cache row's software prefetch and its use */
#ifndef ATTN_PF_HINT
#define ATTN_PF_HINT _MM_HINT_T2
#endif

enum { FT_KV_F32 = 0, FT_KV_F16 = 1, FT_KV_BF16 = 2, FT_KV_F8 = 3 }; /* element type of the cached keys and values
                                                                        * (FT_KV_F8: float8 e4m3fn) */

/* Bytes per cached element of type t */
static inline size_t kv_elsize(int t) { return t == FT_KV_F32 ? 4 : t == FT_KV_F8 ? 1 : 2; }

/* float8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities) widened exactly: its bits moved
 * into an IEEE half's places (sign to bit 15, exponent and mantissa to bits 7-14) give a half of the same mantissa and
 * an exponent biased by 15 instead of 7, i.e. the value times 2^-8 (subnormals included); times 256 is the value.
 * The NaN codes 0x7f / 0xff widen to +-480 (the pool never stores them: writes saturate at +-448). */
static inline uint16_t fp8_to_half_bits(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }
static inline float fp8_to_fp32(uint8_t b) { return fp16_to_fp32(fp8_to_half_bits(b)) * 256.f; }

typedef struct {
    const float *q;
    const void *k, *v; /* float, uint16 (fp16 / bf16) or uint8 (fp8) per kv_type */
    const float *sinks;
    const int64_t *lo, *hi; /* query t sees keys [lo[t], hi[t]) */
    int64_t t, h, hkv, dh, dv, k_stride, v_stride, blocks; /* t queries; blocks: the most any query has */
    float scale;
    float *part; /* per (query, kv head, block, g): [max, sum, o[Dv]] */
    float *out;  /* [T, H, Dv] */
    int kv_type;
    _Atomic int failed; /* a worker could not get its widening scratch */
    int64_t hk_item;    /* kv heads per work item (AVX2 path): all of them where there are enough blocks */
    const uint16_t *qs; /* AMX path: each query row as three bf16 parts [T, H, 3, Dh] (attn_split_queries) */
    int amx;            /* AMX path: a bf16 cache on a CPU with AMX-BF16, Dh and Dv multiples of 32 */
    int bf16_dot;       /* a bf16 cache's score pass on VDPBF16PS (attn_bf16_dot_on) */
} attn_ctx;

/* ---- 16-bit keys and values: widen n rows of d values (row i at src + i * stride elements) to dst [n, d] */

static void kv_widen_c(int type, const void *src, int64_t stride, int64_t n, int64_t d, float *dst) {
    for (int64_t i = 0; i < n; i++) {
        float *o = dst + i * d;
        if (type == FT_KV_F8) {
            const uint8_t *r = (const uint8_t *)src + i * stride;
            for (int64_t j = 0; j < d; j++) o[j] = fp8_to_fp32(r[j]);
            continue;
        }
        const uint16_t *r = (const uint16_t *)src + i * stride;
        if (type == FT_KV_F16)
            for (int64_t j = 0; j < d; j++) o[j] = fp16_to_fp32(r[j]);
        else
            for (int64_t j = 0; j < d; j++) o[j] = bf16_to_f32(r[j]);
    }
}


/* This thread's fp32 scratch of at least `floats` (kept between calls, freed when the thread ends); NULL when it
 * cannot be allocated. */
static pthread_key_t g_attn_scratch_key;
static pthread_once_t g_attn_scratch_once = PTHREAD_ONCE_INIT;

static void attn_scratch_key_init(void) { pthread_key_create(&g_attn_scratch_key, free); }

static float *attn_scratch(int64_t floats) {
    pthread_once(&g_attn_scratch_once, attn_scratch_key_init);
    int64_t *s = (int64_t *)pthread_getspecific(g_attn_scratch_key);
    if (s && s[0] >= floats) return (float *)((char *)s + 64);
    free(s);
    s = (int64_t *)aligned_alloc(64, (size_t)((64 + floats * (int64_t)sizeof(float) + 63) / 64 * 64));
    if (s) s[0] = floats;
    pthread_setspecific(g_attn_scratch_key, s);
    return s ? (float *)((char *)s + 64) : NULL;
}

#ifdef FT_X86
/* Software prefetch (into L1) of every cache line of [p, p + bytes) */
static inline void ft_prefetch_span(const void *p, int64_t bytes) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T0);
}

/* A prefetch stream over the next work item's cache rows (rows of `span` bytes, `stride` bytes apart), issued `per`
 * lines at a time from inside the current item's loops so that the next block arrives while this one computes */
typedef struct {
    const char *p;
    int64_t stride, span, rows, row, off, per;
} attn_pf;

static inline void attn_pf_step(attn_pf *f) {
    for (int64_t u = 0; u < f->per && f->row < f->rows; u++) {
        _mm_prefetch(f->p + f->row * f->stride + f->off, ATTN_PF_HINT);
        f->off += 64;
        if (f->off >= f->span) {
            f->off = 0;
            f->row++;
        }
    }
}

/* exp256 / exp512: ft_tiles.h */

/* x[0:n] = exp(x - m), returns the sum */
FT_AVX2 static float exp_sub_sum_avx2(float *x, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float s = hsum256(acc);
    for (; i < n; i++) s += (x[i] = expf(x[i] - m));
    return s;
}

/* max of x[0:n] (n >= 1): exact in any order, so 8 lanes at a time */
FT_AVX2 static float max_avx2(const float *x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    float m8[8], m = -INFINITY;
    _mm256_storeu_ps(m8, mv);
    for (int u = 0; u < 8; u++) m = m8[u] > m ? m8[u] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* the 8 horizontal sums of a[0..7], in order, in one vector */
FT_AVX2 static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The 4 rows x 2 vectors tile of the loops below: a0..a7 += BCAST(row u's factor) * X0, X1 for rows P0..P3 (a query
 * piece against two keys' pieces, or a probability against two pieces of a value row) */
#define FT_TILE4X2(VEC, FMA, BCAST, P0, P1, P2, P3, X0, X1)                                                          \
    do {                                                                                                             \
        VEC f_ = BCAST(P0);                                                                                          \
        a0 = FMA(f_, X0, a0);                                                                                        \
        a1 = FMA(f_, X1, a1);                                                                                        \
        f_ = BCAST(P1);                                                                                              \
        a2 = FMA(f_, X0, a2);                                                                                        \
        a3 = FMA(f_, X1, a3);                                                                                        \
        f_ = BCAST(P2);                                                                                              \
        a4 = FMA(f_, X0, a4);                                                                                        \
        a5 = FMA(f_, X1, a5);                                                                                        \
        f_ = BCAST(P3);                                                                                              \
        a6 = FMA(f_, X0, a6);                                                                                        \
        a7 = FMA(f_, X1, a7);                                                                                        \
    } while (0)

/* pv's values from D0 on, one scalar fmaf chain each in key order: the bits the vector lanes give */
#define FT_PV_TAIL(SCALAR, D0)                                                                                       \
    for (int64_t r = 0; r < R; r++)                                                                                  \
        for (int64_t d = (D0); d < dv; d++) {                                                                        \
            float x = 0.f;                                                                                           \
            for (int64_t i = 0; i < n; i++) x = fmaf(p[r * ATTN_BLOCK + i], SCALAR(v[i * stride + d]), x);           \
            o[r][d] = x;                                                                                             \
        }

/* The loops that read the cache, one set per element type: T the stored type, LOAD8(p) 8 of them as fp32 (fp32: a
 * load; fp16: F16C's _mm256_cvtph_ps; bf16: a 16-bit shift), SCALAR(x) one. The same products and sums in the
 * same order for every type: a 16-bit cache gives the bits an fp32 one holding the widened values gives. */
#define FT_ATTN_LOOPS(SUF, T, LOAD8, SCALAR)                                                                       \
    /* sc[r * ATTN_BLOCK + i] = q[r] . k[i] * scale for R query rows (R a multiple of 4) and n keys, each key's \
     * 8-value piece loaded (and widened) once for a tile of 4 rows x 2 keys. Every (row, key) is two FMA chains in \
     * 8 lanes, the even 8-value pieces of d (d = 0, 16, 32, ...) and the odd ones (d = 8, 24, ...), run one after \
     * the other over the tile's keys (their rows stay in L1 between the passes), added lane by lane, reduced by \
     * hsum8x8's fixed tree, then the d tail past the last whole piece by fmaf: the 512-bit loops' order (there a \
     * register holds an even piece and the odd one after it), the same bits in any tile. An odd n also writes sc \
     * at key n (a copy of key n - 1's score: not read). */                                                    \
    FT_AVX2 static void qk_rows_##SUF(const float *const *q, int64_t R, const T *k, int64_t stride, int64_t n, \
                                      int64_t dh, float scale, float *sc, attn_pf *nxp) {                      \
        attn_pf nxl = nxp ? *nxp : (attn_pf){0}; /* in registers: the loops step it */                         \
        const int64_t d8 = dh / 8 * 8;                                                                         \
        for (int64_t i = 0; i < n; i += 2) {                                                                   \
            const T *k0 = k + i * stride, *k1 = i + 1 < n ? k0 + stride : k0;                                  \
            if (i + ATTN_AHEAD + 1 < n) { /* the rows a few keys ahead */                                      \
                ft_prefetch_span(k0 + ATTN_AHEAD * stride, dh * (int64_t)sizeof(T));                           \
                ft_prefetch_span(k0 + (ATTN_AHEAD + 1) * stride, dh * (int64_t)sizeof(T));                     \
            }                                                                                                  \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                if (nxl.row < nxl.rows) attn_pf_step(&nxl);                                                    \
                const float *q0 = q[r], *q1 = q[r + 1], *q2 = q[r + 2], *q3 = q[r + 3];                        \
                __m256 even[8];                                                                                \
                {                                                                                              \
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                    for (int64_t d = 0; d < d8; d += 16) {                                                     \
                        const __m256 x0 = LOAD8(k0 + d), x1 = LOAD8(k1 + d);                                   \
                        FT_TILE4X2(__m256, _mm256_fmadd_ps, _mm256_loadu_ps, q0 + d, q1 + d, q2 + d, q3 + d, x0, x1); \
                    }                                                                                          \
                    even[0] = a0, even[1] = a1, even[2] = a2, even[3] = a3;                                    \
                    even[4] = a4, even[5] = a5, even[6] = a6, even[7] = a7;                                    \
                }                                                                                              \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                for (int64_t d = 8; d < d8; d += 16) {                                                         \
                    const __m256 x0 = LOAD8(k0 + d), x1 = LOAD8(k1 + d);                                       \
                    FT_TILE4X2(__m256, _mm256_fmadd_ps, _mm256_loadu_ps, q0 + d, q1 + d, q2 + d, q3 + d, x0, x1); \
                }                                                                                              \
                const __m256 acc[8] = {_mm256_add_ps(even[0], a0), _mm256_add_ps(even[1], a1),                 \
                                       _mm256_add_ps(even[2], a2), _mm256_add_ps(even[3], a3),                 \
                                       _mm256_add_ps(even[4], a4), _mm256_add_ps(even[5], a5),                 \
                                       _mm256_add_ps(even[6], a6), _mm256_add_ps(even[7], a7)};                \
                float s8[8];                                                                                   \
                _mm256_storeu_ps(s8, hsum8x8(acc));                                                            \
                if (d8 < dh)                                                                                   \
                    for (int u = 0; u < 8; u++) {                                                              \
                        const float *qq = q[r + u / 2];                                                        \
                        const T *kk = u % 2 ? k1 : k0;                                                         \
                        for (int64_t d = d8; d < dh; d++) s8[u] = fmaf(qq[d], SCALAR(kk[d]), s8[u]);           \
                    }                                                                                          \
                for (int u = 0; u < 4; u++) {                                                                  \
                    sc[(r + u) * ATTN_BLOCK + i] = s8[2 * u] * scale;                                          \
                    sc[(r + u) * ATTN_BLOCK + i + 1] = s8[2 * u + 1] * scale;                                  \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        if (nxp) *nxp = nxl;                                                                                   \
    }                                                                                                          \
    /* o[r][0:dv] = sum_i p[r * ATTN_BLOCK + i] * v[i] for R rows (a multiple of 4), each 16-value piece of a     \
     * value row loaded (and widened) once for 4 rows. Every output is fma(p_i, v_i, .) in key order from 0: any  \
     * tile, any lane or the scalar tail give the same bits. */                                                \
    FT_AVX2 static void pv_rows_##SUF(const float *p, int64_t R, const T *v, int64_t stride, int64_t n,          \
                                      int64_t dv, float *const *o, attn_pf *nxp) {                 \
        attn_pf nxl = nxp ? *nxp : (attn_pf){0}; /* in registers: the loops step it */                         \
        const int64_t d16 = dv / 16 * 16;                                                                      \
        for (int64_t d0 = 0; d0 < d16; d0 += 16)                                                               \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                const float *p0 = p + r * ATTN_BLOCK, *p1 = p0 + ATTN_BLOCK, *p2 = p1 + ATTN_BLOCK,            \
                            *p3 = p2 + ATTN_BLOCK;                                                             \
                const T *vr = v + d0;                                                                          \
                for (int64_t i = 0; i < n; i++, vr += stride) {                                                \
                    if (nxl.row < nxl.rows) attn_pf_step(&nxl);                                                \
                    if (d0 == 0 && r == 0 && i + ATTN_AHEAD < n) /* the first pass fetches the rows */   \
                        ft_prefetch_span(vr + ATTN_AHEAD * stride, dv * (int64_t)sizeof(T));                   \
                    const __m256 x0 = LOAD8(vr), x1 = LOAD8(vr + 8);                                           \
                    FT_TILE4X2(__m256, _mm256_fmadd_ps, _mm256_broadcast_ss, p0 + i, p1 + i, p2 + i, p3 + i, x0,  \
                               x1);                                                                            \
                }                                                                                              \
                _mm256_storeu_ps(o[r] + d0, a0);                                                               \
                _mm256_storeu_ps(o[r] + d0 + 8, a1);                                                           \
                _mm256_storeu_ps(o[r + 1] + d0, a2);                                                           \
                _mm256_storeu_ps(o[r + 1] + d0 + 8, a3);                                                       \
                _mm256_storeu_ps(o[r + 2] + d0, a4);                                                           \
                _mm256_storeu_ps(o[r + 2] + d0 + 8, a5);                                                       \
                _mm256_storeu_ps(o[r + 3] + d0, a6);                                                           \
                _mm256_storeu_ps(o[r + 3] + d0 + 8, a7);                                                       \
            }                                                                                                  \
        if (nxp) *nxp = nxl;                                                                                   \
        FT_PV_TAIL(SCALAR, d16);                                                                               \
    }

#define FT_LOAD_F32(p) _mm256_loadu_ps(p)
#define FT_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define FT_SAME_F32(x) (x)

/* 8 fp8 values as fp32 (see fp8_to_half_bits): zero-extended to 16 bits, moved into a half's places, widened by F16C,
 * times 256 (exact) */
FT_AVX2 static inline __m256 load_f8x8(const uint8_t *p) {
    /* sign-extended and shifted by 7: the sign lands on bits 14 and 15 (kept: 15), the rest on 7-13 */
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                    _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

FT_ATTN_LOOPS(avx2, float, FT_LOAD_F32, FT_SAME_F32)
FT_ATTN_LOOPS(f16_avx2, uint16_t, FT_LOAD_F16, fp16_to_fp32)
FT_ATTN_LOOPS(bf16_avx2, uint16_t, load_bf16x8, bf16_to_f32)
FT_ATTN_LOOPS(f8_avx2, uint8_t, load_f8x8, fp8_to_fp32)

/* The same loops in 512-bit registers (the AVX-512 ISA settings), bitwise equal to the AVX2 ones: qk loads 16 values
 * of d of a key at once against 16 of the query row, so a register's low half is the AVX2 loop's even-piece chain
 * and its high half the odd-piece chain (4 rows x 4 keys per tile, halves added, reduced by the same hsum8x8 tree);
 * pv is one FMA chain per output value in key order whatever the width. Half the instructions for the same
 * arithmetic. */
#define FT_ATTN_LOOPS512(SUF, T, LOAD2X8, LOAD16, SCALAR)                                                          \
    FT_VNNI static void qk_rows512_##SUF(const float *const *q, int64_t R, const T *k, int64_t stride, int64_t n, \
                                         int64_t dh, float scale, float *sc, attn_pf *nxp) {                     \
        attn_pf nxl = nxp ? *nxp : (attn_pf){0}; /* in registers: the loops step it */                           \
        const int64_t d8 = dh / 8 * 8, d16 = dh / 16 * 16;                                                       \
        for (int64_t i = 0; i < n; i += 4) { /* 4 rows x 4 keys a tile, 16 values of d a step */                 \
            const T *kk[4];                                                                                      \
            for (int j = 0; j < 4; j++) kk[j] = k + (i + j < n ? i + j : n - 1) * stride;                        \
            if (i + ATTN_AHEAD + 3 < n)                                                                          \
                for (int j = 0; j < 4; j++) ft_prefetch_span(kk[j] + ATTN_AHEAD * stride, dh * (int64_t)sizeof(T)); \
            for (int64_t r = 0; r < R; r += 4) {                                                                 \
                if (nxl.row < nxl.rows) attn_pf_step(&nxl);                                                      \
                __m512 a[4][4]; /* [row][key]: lanes 0-7 the even pieces' chain, 8-15 the odd ones' */           \
                for (int u = 0; u < 4; u++)                                                                      \
                    for (int w = 0; w < 4; w++) a[u][w] = _mm512_setzero_ps();                                   \
                for (int64_t d = 0; d < d16; d += 16) {                                                          \
                    const __m512 x0 = LOAD16(kk[0] + d), x1 = LOAD16(kk[1] + d), x2 = LOAD16(kk[2] + d),         \
                                 x3 = LOAD16(kk[3] + d);                                                         \
                    for (int u = 0; u < 4; u++) {                                                                \
                        const __m512 f = _mm512_loadu_ps(q[r + u] + d);                                          \
                        a[u][0] = _mm512_fmadd_ps(f, x0, a[u][0]);                                               \
                        a[u][1] = _mm512_fmadd_ps(f, x1, a[u][1]);                                               \
                        a[u][2] = _mm512_fmadd_ps(f, x2, a[u][2]);                                               \
                        a[u][3] = _mm512_fmadd_ps(f, x3, a[u][3]);                                               \
                    }                                                                                            \
                }                                                                                                \
                if (d16 < d8) { /* a last even piece alone: the odd lanes are masked off and keep their bits */  \
                    const __m512 x0 = LOAD2X8(kk[0] + d16, kk[0] + d16), x1 = LOAD2X8(kk[1] + d16, kk[1] + d16), \
                                 x2 = LOAD2X8(kk[2] + d16, kk[2] + d16), x3 = LOAD2X8(kk[3] + d16, kk[3] + d16); \
                    for (int u = 0; u < 4; u++) {                                                                \
                        const __m512 f = ft_bcast8x2(q[r + u] + d16);                                            \
                        a[u][0] = _mm512_mask3_fmadd_ps(f, x0, a[u][0], 0x00ff);                                 \
                        a[u][1] = _mm512_mask3_fmadd_ps(f, x1, a[u][1], 0x00ff);                                 \
                        a[u][2] = _mm512_mask3_fmadd_ps(f, x2, a[u][2], 0x00ff);                                 \
                        a[u][3] = _mm512_mask3_fmadd_ps(f, x3, a[u][3], 0x00ff);                                 \
                    }                                                                                            \
                }                                                                                                \
                if (d8 == dh) { /* no d tail: the tile's 16 scores scaled and stored 4 at a time */             \
                    ft_store_scores4x4(ft_hsum4x4v(a), scale, sc + r * ATTN_BLOCK + i, ATTN_BLOCK);             \
                    continue;                                                                                    \
                }                                                                                                \
                float s8[16];                                                                                    \
                ft_hsum4x4(a, s8);                                                                               \
                for (int u = 0; u < 4; u++)                                                                      \
                    for (int j = 0; j < 4; j++) {                                                                \
                        float x = s8[4 * u + j];                                                                 \
                        for (int64_t d = d8; d < dh; d++) x = fmaf(q[r + u][d], SCALAR(kk[j][d]), x);            \
                        sc[(r + u) * ATTN_BLOCK + i + j] = x * scale;                                            \
                    }                                                                                            \
            }                                                                                                    \
        }                                                                                                        \
        if (nxp) *nxp = nxl;                                                                                     \
    }                                                                                                            \
    FT_VNNI static void pv_rows512_##SUF(const float *p, int64_t R, const T *v, int64_t stride, int64_t n,       \
                                         int64_t dv, float *const *o, attn_pf *nxp) {              \
        attn_pf nxl = nxp ? *nxp : (attn_pf){0}; /* in registers: the loops step it */                         \
        const int64_t d64 = dv / 64 * 64, d32 = dv / 32 * 32, d16 = dv / 16 * 16;                              \
        /* 4 rows x 64 values a tile (16 accumulators): each probability broadcast once for 4 FMAs */          \
        for (int64_t d0 = 0; d0 < d64; d0 += 64)                                                               \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                __m512 acc[16];                                                                                \
                for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();                                     \
                const float *pr = p + r * ATTN_BLOCK;                                                          \
                const T *vr = v + d0;                                                                          \
                for (int64_t i = 0; i < n; i++, vr += stride) {                                                \
                    if (nxl.row < nxl.rows) attn_pf_step(&nxl);                                                \
                    if (d0 == 0 && r == 0 && i + ATTN_AHEAD < n)                                         \
                        ft_prefetch_span(vr + ATTN_AHEAD * stride, dv * (int64_t)sizeof(T));                   \
                    const __m512 x0 = LOAD16(vr), x1 = LOAD16(vr + 16), x2 = LOAD16(vr + 32),                  \
                                 x3 = LOAD16(vr + 48);                                                         \
                    for (int u = 0; u < 4; u++) {                                                              \
                        const __m512 f = ft_bcast1(pr + u * ATTN_BLOCK + i);                                   \
                        acc[4 * u] = _mm512_fmadd_ps(f, x0, acc[4 * u]);                                       \
                        acc[4 * u + 1] = _mm512_fmadd_ps(f, x1, acc[4 * u + 1]);                               \
                        acc[4 * u + 2] = _mm512_fmadd_ps(f, x2, acc[4 * u + 2]);                               \
                        acc[4 * u + 3] = _mm512_fmadd_ps(f, x3, acc[4 * u + 3]);                               \
                    }                                                                                          \
                }                                                                                              \
                for (int u = 0; u < 4; u++)                                                                    \
                    for (int w = 0; w < 4; w++) _mm512_storeu_ps(o[r + u] + d0 + 16 * w, acc[4 * u + w]);      \
            }                                                                                                  \
        for (int64_t d0 = d64; d0 < d16; d0 += d0 < d32 ? 32 : 16) {                                           \
            const int two = d0 < d32;                                                                          \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                const float *p0 = p + r * ATTN_BLOCK, *p1 = p0 + ATTN_BLOCK, *p2 = p1 + ATTN_BLOCK,            \
                            *p3 = p2 + ATTN_BLOCK;                                                             \
                const T *vr = v + d0;                                                                          \
                for (int64_t i = 0; i < n; i++, vr += stride) {                                                \
                    if (nxl.row < nxl.rows) attn_pf_step(&nxl);                                                \
                    if (d0 == 0 && r == 0 && i + ATTN_AHEAD < n)                                         \
                        ft_prefetch_span(vr + ATTN_AHEAD * stride, dv * (int64_t)sizeof(T));                   \
                    const __m512 x0 = LOAD16(vr), x1 = two ? LOAD16(vr + 16) : x0;                             \
                    FT_TILE4X2(__m512, _mm512_fmadd_ps, ft_bcast1, p0 + i, p1 + i, p2 + i, p3 + i, x0, x1);    \
                }                                                                                              \
                _mm512_storeu_ps(o[r] + d0, a0);                                                               \
                _mm512_storeu_ps(o[r + 1] + d0, a2);                                                           \
                _mm512_storeu_ps(o[r + 2] + d0, a4);                                                           \
                _mm512_storeu_ps(o[r + 3] + d0, a6);                                                           \
                if (two) {                                                                                     \
                    _mm512_storeu_ps(o[r] + d0 + 16, a1);                                                      \
                    _mm512_storeu_ps(o[r + 1] + d0 + 16, a3);                                                  \
                    _mm512_storeu_ps(o[r + 2] + d0 + 16, a5);                                                  \
                    _mm512_storeu_ps(o[r + 3] + d0 + 16, a7);                                                  \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        if (nxp) *nxp = nxl;                                                                                   \
        FT_PV_TAIL(SCALAR, d16);                                                                               \
    }

FT_VNNI static inline __m256 ft_lo8(__m512 z) { return _mm512_castps512_ps256(z); }
FT_VNNI static inline __m256 ft_hi8(__m512 z) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)); }
/* s[4 * u + j] = the sum of a[u][j]'s 16 lanes, for a tile of 4 rows x 4 keys: halves added lane by lane (the
 * even and odd 8-value chains), then hsum8x8 over 2 rows x 4 keys at a time */
FT_VNNI static inline __m512 ft_hsum4x4v(__m512 a[4][4]) {
    /* The same sums, all 16 in one vector (lane 4u + j), each step one add over several tiles' lanes lined up by
     * shuffles (float addition commutes, so only the tree matters): z = a[e / 4][e % 4]; v[p] = [h(z[2p]),
     * h(z[2p + 1])] with h = lo + hi (128-bit chunks h0-3 | h4-7 of each) */
    const __m512 *z = &a[0][0];
    __m512 v[8], x[4], y[2];
    for (int p = 0; p < 8; p++)
        v[p] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* chunk c: [h0 + h1, h2 + h3] of v[2p]'s chunk c, then of v[2p + 1]'s */
        x[p] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * p], v[2 * p + 1], 0x88),
                             _mm512_shuffle_ps(v[2 * p], v[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* chunk c lane l: the 4-lane sum of v[4p + l]'s chunk c */
        y[p] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0x88),
                             _mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0xDD));
    /* chunks 0 + 1 of v[p] are z[2p]'s halves, 2 + 3 z[2p + 1]'s: lane 4c + l of t is z[8 (c / 2) + 2l + c % 2] */
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), t);
}
FT_VNNI static inline void ft_hsum4x4(__m512 a[4][4], float *s) { _mm512_storeu_ps(s, ft_hsum4x4v(a)); }
/* Row r + u's 4 scores of keys i..i + 3 = lane 4u..4u + 3 of s (the tile's sums) times scale */
FT_VNNI static inline void ft_store_scores4x4(__m512 s, float scale, float *sc, int64_t ld) {
    s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
    _mm_storeu_ps(sc, _mm512_castps512_ps128(s));
    _mm_storeu_ps(sc + ld, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(sc + 2 * ld, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(sc + 3 * ld, _mm512_extractf32x4_ps(s, 3));
}

/* exp_sub_sum_avx2 16 values a step: the 8-lane sum takes the low half, then the high half (the AVX2 loop's two
 * steps), so the same bits */
FT_VNNI static float exp_sub_sum512(float *x, int64_t n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
        _mm512_storeu_ps(x + i, e);
        acc = _mm256_add_ps(_mm256_add_ps(acc, ft_lo8(e)), ft_hi8(e));
    }
    if (i + 8 <= n) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    float s = hsum256(acc);
    for (; i < n; i++) s += (x[i] = expf(x[i] - m));
    return s;
}

/* max of x[0:n] (n >= 1), 16 lanes at a time (exact in any order) */
FT_VNNI static float max512(const float *x, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
    float m = _mm512_reduce_max_ps(mv);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* the float at p in every lane */
FT_VNNI static inline __m512 ft_bcast1(const float *p) { return _mm512_set1_ps(*p); }
/* 8 floats at p in both halves */
FT_VNNI static inline __m512 ft_bcast8x2(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
/* 8 values at a in the low half, 8 at b in the high half, widened to fp32 */
FT_VNNI static inline __m512 ft_pair_f32(const float *a, const float *b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
FT_VNNI static inline __m256i ft_pair_u16(const uint16_t *a, const uint16_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}
FT_VNNI static inline __m512 ft_pair_f16(const uint16_t *a, const uint16_t *b) {
    return _mm512_cvtph_ps(ft_pair_u16(a, b));
}
FT_VNNI static inline __m512 ft_widen_bf16x16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
FT_VNNI static inline __m512 ft_pair_bf16(const uint16_t *a, const uint16_t *b) {
    return ft_widen_bf16x16(ft_pair_u16(a, b));
}
/* 16 fp8 values (16 bytes) as fp32, as load_f8x8 */
FT_VNNI static inline __m512 ft_widen_f8x16(__m128i b) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
FT_VNNI static inline __m512 ft_pair_f8(const uint8_t *a, const uint8_t *b) {
    return ft_widen_f8x16(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
#define FT_LOAD16_F8(p) ft_widen_f8x16(_mm_loadu_si128((const __m128i *)(p)))
#define FT_LOAD16_F32(p) _mm512_loadu_ps(p)
#define FT_LOAD16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define FT_LOAD16_BF16(p) ft_widen_bf16x16(_mm256_loadu_si256((const __m256i *)(p)))

FT_ATTN_LOOPS512(f32, float, ft_pair_f32, FT_LOAD16_F32, FT_SAME_F32)
FT_ATTN_LOOPS512(f16, uint16_t, ft_pair_f16, FT_LOAD16_F16, fp16_to_fp32)
FT_ATTN_LOOPS512(bf16, uint16_t, ft_pair_bf16, FT_LOAD16_BF16, bf16_to_f32)
FT_ATTN_LOOPS512(f8, uint8_t, ft_pair_f8, FT_LOAD16_F8, fp8_to_fp32)

/* ---------------------------------------------------------------- AVX512-BF16 score pass for bf16 caches
 * A bf16 cache's keys go into VDPBF16PS as they are (32 values a register, two products a lane), against the query
 * rows rounded to bf16 once per block (RNE, attn_bf16_rows): one instruction does the work of a widen and two FMAs
 * of the 16-value loop, so the score pass's arithmetic, which bounds it once the cache streams (4 query rows per
 * key: 4 flops a byte), halves. Rounding the query is what llama.cpp's CPU attention does over a bf16 cache (its
 * Q converted to the cache's type); the scores are no longer bitwise those of the fp32 kernel on the widened cache
 * (each product q_bf16 * k is exact in fp32; only q's rounding differs), so the path is a mode (attn_bf16_dot_on):
 * on by default where the CPU has AVX512-BF16, off with $FREETOKEN_ATTN_BF16_DOT=0 or ft_attn_set_bf16_dot(0). A
 * decode step, a verify row and a prefill chunk take the same path, so a query's bits do not depend on how many
 * queries share its block. The value pass is unchanged. */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define FT_HAVE_BF16DOT 1 /* the compiler has the AVX512-BF16 intrinsics (else the path is never taken) */
#include <cpuid.h>
#define FT_BF16DOT __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx512bf16,avx2,fma,f16c")))

static int attn_bf16_dot_cpu = -1; /* the CPU has AVX512-BF16 (cpuid: a VM exit, so asked once); -1: not yet asked */
static int attn_bf16_dot_mode = -1; /* -1: not yet read from the environment */

static int attn_bf16_dot_supported(void) {
    if (attn_bf16_dot_cpu < 0) {
        unsigned a, b, c, d;
        attn_bf16_dot_cpu = __builtin_cpu_supports("avx512f") && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
    }
    return attn_bf16_dot_cpu;
}

/* the mode as set, or as $FREETOKEN_ATTN_BF16_DOT says at first use (on unless it is 0) */
static int attn_bf16_dot_setting(void) {
    if (attn_bf16_dot_mode < 0) {
        const char *env = getenv("FREETOKEN_ATTN_BF16_DOT");
        attn_bf16_dot_mode = !(env && env[0] == '0');
    }
    return attn_bf16_dot_mode;
}

static int attn_bf16_dot_on(void) {
    return attn_bf16_dot_setting() && g_isa >= FT_ISA_AVX512VNNI && attn_bf16_dot_supported();
}

/* R query rows of dh floats as bf16 rows of dp (dh rounded up to 32) values, zero past dh */
FT_BF16DOT static void attn_bf16_rows(const float *const *q, int64_t R, int64_t dh, int64_t dp, uint16_t *out) {
    for (int64_t r = 0; r < R; r++) {
        uint16_t *o = out + r * dp;
        for (int64_t d = 0; d < dp; d += 32) {
            const int64_t m0 = dh - d >= 16 ? 16 : dh - d > 0 ? dh - d : 0;
            const int64_t m1 = dh - d - 16 >= 16 ? 16 : dh - d - 16 > 0 ? dh - d - 16 : 0;
            const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)((1u << m0) - 1), q[r] + d);
            const __m512 hi = m1 ? _mm512_maskz_loadu_ps((__mmask16)((1u << m1) - 1), q[r] + d + 16) : _mm512_setzero_ps();
            _mm512_storeu_si512((void *)(o + d), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* qk_rows512_bf16 with the query rows as bf16 (qb: R rows of dp values) and VDPBF16PS: 4 rows x 4 keys a tile, 32
 * values of d a step, a last partial step's key values loaded under a mask (zeros: the query's padding is zero) */
FT_BF16DOT static void qk_rows512_bf16dot(const uint16_t *qb, int64_t dp, int64_t R, const uint16_t *k, int64_t stride,
                                          int64_t n, int64_t dh, float scale, float *sc, attn_pf *nxp) {
    attn_pf nxl = nxp ? *nxp : (attn_pf){0};
    const __mmask32 tail = (__mmask32)((1ull << (dh % 32)) - 1); /* the last step's values when dh is off 32 */
    for (int64_t i = 0; i < n; i += 4) {
        const uint16_t *kk[4];
        for (int j = 0; j < 4; j++) kk[j] = k + (i + j < n ? i + j : n - 1) * stride;
        if (i + ATTN_AHEAD + 3 < n)
            for (int j = 0; j < 4; j++) ft_prefetch_span(kk[j] + ATTN_AHEAD * stride, dh * 2);
        for (int64_t r = 0; r < R; r += 4) {
            if (nxl.row < nxl.rows) attn_pf_step(&nxl);
            __m512 a[4][4];
            for (int u = 0; u < 4; u++)
                for (int w = 0; w < 4; w++) a[u][w] = _mm512_setzero_ps();
            const uint16_t *qr = qb + r * dp;
            for (int64_t d = 0; d < dh; d += 32) {
                const __mmask32 m = d + 32 <= dh ? (__mmask32)~0u : tail;
                const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(m, kk[0] + d),
                               x1 = (__m512bh)_mm512_maskz_loadu_epi16(m, kk[1] + d),
                               x2 = (__m512bh)_mm512_maskz_loadu_epi16(m, kk[2] + d),
                               x3 = (__m512bh)_mm512_maskz_loadu_epi16(m, kk[3] + d);
                for (int u = 0; u < 4; u++) {
                    const __m512bh f = (__m512bh)_mm512_loadu_si512(qr + u * dp + d);
                    a[u][0] = _mm512_dpbf16_ps(a[u][0], f, x0);
                    a[u][1] = _mm512_dpbf16_ps(a[u][1], f, x1);
                    a[u][2] = _mm512_dpbf16_ps(a[u][2], f, x2);
                    a[u][3] = _mm512_dpbf16_ps(a[u][3], f, x3);
                }
            }
            ft_store_scores4x4(ft_hsum4x4v(a), scale, sc + r * ATTN_BLOCK + i, ATTN_BLOCK);
        }
    }
    if (nxp) *nxp = nxl;
}
#endif /* FT_HAVE_BF16DOT */
#endif

#define ATTN_QUERIES_PER_ITEM 8 /* queries of a chunk that share an item: its key block is read once for them */

#ifdef FT_HAVE_AMX
/* ---------------------------------------------------------------- AMX-BF16 path for bf16 caches
 *
 * A bf16 cache needs no widening for AMX: keys go straight from the cache into tiles. Each fp32 query row and each
 * row of probabilities is split into three bf16 parts (x = hi + mid + lo, each the rounding of what the parts
 * before leave: exact for normal values), and the parts run along the tiles' summed dimension: a score is
 * q_hi . k + q_mid . k + q_lo . k accumulated in one fp32 tile element, so the sums hold the exact products of the
 * fp32 operands with the cache's values: the accuracy of the fp32 loops (within fp32 rounding of them, not their
 * bits). Scores: C [16 keys x 16 query-head rows] += K tile (16 cached key rows, 32 values each, as stored) . B (a
 * part of 32 query values of each row, transposed into AMX's pair layout), for each 32-value chunk and part; the
 * transpose of C is the rows' scores. Values: C [16 rows x 16 values] += P tile (a part of 32 probabilities of each
 * row) . V tile, the V tile built from pairs of cached value rows (unpacklo / unpackhi of two rows: the values of a
 * 32-value span in a fixed permuted order, restored on the way out). Every output element of a tile product
 * depends only on its own row and column, keys past a row's range enter with probability 0 (adding +0 changes no
 * sum), and blocks start at each query's lo as on the other paths: a query's bits are the same alone or in a chunk
 * (batch invariance), and the same at any thread count. */

#define AMX_ATT_ROWS 16 /* query-head rows per tile (its columns for scores, its rows for values) */

/* out (16 rows of 64 bytes) = the 32-bit transpose of r[0..15] */
FT_AMX static void amx_tr16(const __m512i *r, void *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* u[4a + b] lane L: column 4L + b, rows 4a..4a+3 */
        u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    __m512i *o = (__m512i *)out;
    for (int b = 0; b < 4; b++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88), w0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xdd), w1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xdd);
        _mm512_store_si512(o + b, _mm512_shuffle_i32x4(v0, w0, 0x88));
        _mm512_store_si512(o + 8 + b, _mm512_shuffle_i32x4(v0, w0, 0xdd));
        _mm512_store_si512(o + 4 + b, _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_store_si512(o + 12 + b, _mm512_shuffle_i32x4(v1, w1, 0xdd));
    }
}

FT_AMX static inline __m512 amx_bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* 16 floats as three bf16 parts at hi, hi + stride, hi + 2 * stride (elements) */
FT_AMX static inline void amx_split3(__m512 x, uint16_t *hi, int64_t stride) {
    for (int part = 0; part < 3; part++) {
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
        _mm256_storeu_si256((__m256i *)(hi + part * stride), b);
        x = _mm512_sub_ps(x, amx_bf16_widen(b));
    }
}

/* qs[(row * 3 + part) * dh + d] for the rows of q [rows, dh] (dh a multiple of 16) */
FT_AMX static void attn_split_queries(const float *q, int64_t rows, int64_t dh, uint16_t *qs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < dh; d += 16) amx_split3(_mm512_loadu_ps(q + r * dh + d), qs + r * 3 * dh + d, dh);
}

/* Bytes of attn_run_amx's workspace for up to `rows` query-head rows */
static inline size_t attn_amx_ws_bytes(int64_t rows, int64_t dh, int64_t dv) {
    const int64_t groups = (rows + AMX_ATT_ROWS - 1) / AMX_ATT_ROWS;
    return (size_t)(groups * (dh / 32) * 3 * 1024 + groups * 3 * 16 * ATTN_BLOCK * 2 +
                    (ATTN_BLOCK / 32) * (dv / 16) * 1024 + 16 * dh * 2 + 2 * 1024 + 1024);
}

static _Atomic int64_t attn_amx_calls; /* blocks run on the AMX path since load (tests: proof it ran) */

/* The AMX path is opt-in ($FREETOKEN_ATTN_AMX=1 at load, or ft_attn_set_amx): on the AMX Xeon it measured 2.0-2.15x the
 * vector loops on prefill chunks and verify rows (compute-bound: a block read once for 8 queries) but 0.7x on single
 * decode queries (memory-bound; the vector loops' loads overlap the stream better than tile loads), and a run
 * must use one path for every query count (a chunk's query has to be bitwise the same query decoded alone).
 * -1: not yet read from the environment. */
static int attn_amx_mode = -1;

/* Whether a call with this cache type and these head sizes runs on the AMX path (turned on, the ISA in use is AMX,
 * the CPU has AMX-BF16 and AVX512-BF16, a bf16 cache, Dh and Dv multiples of 32) */
static int attn_amx_applies(int kv_type, int64_t dh, int64_t dv) {
    if (g_isa < 0) g_isa = detect_isa();
    if (attn_amx_mode < 0) {
        const char *env = getenv("FREETOKEN_ATTN_AMX");
        attn_amx_mode = env && env[0] == '1';
    }
    return attn_amx_mode && kv_type == FT_KV_BF16 && g_isa >= FT_ISA_AMX && amx_bf16_supported() && dh % 32 == 0 &&
           dv % 32 == 0 && dh > 0 && dv > 0;
}

/* One block of n keys for R query-head rows (qrow[r]: the row's index in qs; orow[r]: [max, sum, o[Dv]];
 * nrow[r]: its keys in the block, 1..n), sc: R x ATTN_BLOCK floats, ws: attn_amx_ws_bytes(R, ...) bytes, 64-aligned */
FT_AMX static void attn_run_amx(const attn_ctx *c, int64_t R, const int64_t *qrow, float *const *orow,
                                const int64_t *nrow, int64_t n, const uint16_t *kb, const uint16_t *vb, float *sc,
                                uint8_t *ws) {
    const int64_t dh = c->dh, dv = c->dv, nc = dh / 32, nd = dv / 16, n32 = (n + 31) / 32 * 32;
    const int64_t groups = (R + AMX_ATT_ROWS - 1) / AMX_ATT_ROWS;
    uint16_t *qb = (uint16_t *)ws;                      /* [groups][nc][3 parts] B tiles of the queries */
    uint16_t *pb = qb + groups * nc * 3 * 512;          /* [groups][3 parts][16 rows][ATTN_BLOCK] probabilities */
    uint16_t *vt = pb + groups * 3 * 16 * ATTN_BLOCK;   /* [ATTN_BLOCK / 32][nd] V tiles */
    uint16_t *kpad = vt + (ATTN_BLOCK / 32) * nd * 512; /* a last partial tile of keys, zero-padded */
    float *cb = (float *)(kpad + 16 * dh);              /* two C tiles stored */
    float *tb = cb + 512;                               /* a transposed C tile */
    amx_load_full_tiles();
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t gi = 0; gi < groups; gi++) { /* column j of group gi's tiles: row r0 + j's part */
        const int64_t r0 = gi * AMX_ATT_ROWS, rn = R - r0 < AMX_ATT_ROWS ? R - r0 : AMX_ATT_ROWS;
        for (int64_t ci = 0; ci < nc; ci++)
            for (int part = 0; part < 3; part++) {
                __m512i m[16];
                for (int j = 0; j < 16; j++)
                    m[j] = j < rn ? _mm512_loadu_si512(c->qs + (qrow[r0 + j] * 3 + part) * dh + ci * 32) : zero;
                amx_tr16(m, qb + ((gi * nc + ci) * 3 + part) * 512);
            }
    }
    const __m512 scale = _mm512_set1_ps(c->scale);
    /* a sub-block's 16 key rows: straight from the cache, or a zero-padded copy of the last partial one */
    const uint16_t *ka[ATTN_BLOCK / 16];
    int64_t astride[ATTN_BLOCK / 16];
    const int64_t subs = (n + 15) / 16;
    for (int64_t sb = 0; sb < subs; sb++) {
        ka[sb] = kb + sb * 16 * c->k_stride;
        astride[sb] = c->k_stride * 2;
        if (n - sb * 16 < 16) {
            memset(kpad, 0, (size_t)(16 * dh * 2));
            for (int64_t i = 0; i < n - sb * 16; i++) memcpy(kpad + i * dh, ka[sb] + i * c->k_stride, (size_t)(dh * 2));
            ka[sb] = kpad;
            astride[sb] = dh * 2;
        }
    }
    /* scores, two sub-blocks at a time: C 0 / 3, their keys A 1 / 2, the three query parts B 4 5 6 */
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t r0 = gi * AMX_ATT_ROWS, rn = R - r0 < AMX_ATT_ROWS ? R - r0 : AMX_ATT_ROWS;
        for (int64_t sb = 0; sb < subs; sb += 2) {
            const int two = sb + 1 < subs;
            _tile_zero(0);
            if (two) _tile_zero(3);
            for (int64_t ci = 0; ci < nc; ci++) {
                const uint16_t *qt = qb + (gi * nc + ci) * 3 * 512;
                _tile_loadd(1, ka[sb] + ci * 32, astride[sb]);
                if (two) _tile_loadd(2, ka[sb + 1] + ci * 32, astride[sb + 1]);
                _tile_loadd(4, qt, 64);
                _tile_loadd(5, qt + 512, 64);
                _tile_loadd(6, qt + 1024, 64);
                _tile_dpbf16ps(0, 1, 4);
                if (two) _tile_dpbf16ps(3, 2, 4);
                _tile_dpbf16ps(0, 1, 5);
                if (two) _tile_dpbf16ps(3, 2, 5);
                _tile_dpbf16ps(0, 1, 6);
                if (two) _tile_dpbf16ps(3, 2, 6);
            }
            _tile_stored(0, cb, 64);
            if (two) _tile_stored(3, cb + 256, 64);
            for (int u = 0; u <= two; u++) {
                __m512i m[16];
                for (int i = 0; i < 16; i++) m[i] = _mm512_load_si512(cb + 256 * u + 16 * i);
                amx_tr16(m, tb);
                for (int64_t j = 0; j < rn; j++)
                    _mm512_storeu_ps(sc + (r0 + j) * ATTN_BLOCK + (sb + u) * 16, _mm512_mul_ps(_mm512_load_ps(tb + 16 * j), scale));
            }
        }
    }
    for (int64_t r = 0; r < R; r++) { /* softmax of the block; probabilities past the row's keys are 0 */
        float *row = sc + r * ATTN_BLOCK;
        orow[r][0] = max_avx2(row, nrow[r]);
        orow[r][1] = exp_sub_sum_avx2(row, nrow[r], orow[r][0]);
        for (int64_t i = nrow[r]; i < n32; i++) row[i] = 0.f;
    }
    for (int64_t gi = 0; gi < groups; gi++) { /* row j of part tile p: row r0 + j's part p */
        const int64_t r0 = gi * AMX_ATT_ROWS, rn = R - r0 < AMX_ATT_ROWS ? R - r0 : AMX_ATT_ROWS;
        uint16_t *pg = pb + gi * 3 * 16 * ATTN_BLOCK;
        for (int64_t j = 0; j < rn; j++)
            for (int64_t i = 0; i < n32; i += 16)
                amx_split3(_mm512_loadu_ps(sc + (r0 + j) * ATTN_BLOCK + i), pg + j * ATTN_BLOCK + i, 16 * ATTN_BLOCK);
        for (int part = 0; part < 3; part++)
            for (int64_t j = rn; j < 16; j++) memset(pg + (part * 16 + j) * ATTN_BLOCK, 0, (size_t)(n32 * 2));
    }
    for (int64_t ks = 0; ks < n32 / 32; ks++) /* V tiles: row i = keys 2i, 2i + 1 of the step, interleaved */
        for (int64_t sp = 0; sp < dv / 32; sp++) {
            uint16_t *tlo = vt + (ks * nd + 2 * sp) * 512, *thi = tlo + 512;
            for (int64_t i = 0; i < 16; i++) {
                const int64_t a = ks * 32 + 2 * i;
                const __m512i x = a < n ? _mm512_loadu_si512(vb + a * c->v_stride + sp * 32) : zero;
                const __m512i y = a + 1 < n ? _mm512_loadu_si512(vb + (a + 1) * c->v_stride + sp * 32) : zero;
                _mm512_store_si512(tlo + i * 32, _mm512_unpacklo_epi16(x, y));
                _mm512_store_si512(thi + i * 32, _mm512_unpackhi_epi16(x, y));
            }
        }
    /* a C tile of the low half of span sp holds values 8L + 0..3 in lane L, the high half's 8L + 4..7. Tiles: C 0
     * and 3 (a span's two halves), the probability parts A 1 2 7, the value tiles B 4 5 */
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t r0 = gi * AMX_ATT_ROWS, rn = R - r0 < AMX_ATT_ROWS ? R - r0 : AMX_ATT_ROWS;
        const uint16_t *pg = pb + gi * 3 * 16 * ATTN_BLOCK;
        for (int64_t sp = 0; sp < dv / 32; sp++) {
            _tile_zero(0);
            _tile_zero(3);
            for (int64_t ks = 0; ks < n32 / 32; ks++) {
                const uint16_t *blo = vt + (ks * nd + 2 * sp) * 512;
                _tile_loadd(4, blo, 64);
                _tile_loadd(5, blo + 512, 64);
                _tile_loadd(1, pg + ks * 32, ATTN_BLOCK * 2);
                _tile_loadd(2, pg + 16 * ATTN_BLOCK + ks * 32, ATTN_BLOCK * 2);
                _tile_loadd(7, pg + 32 * ATTN_BLOCK + ks * 32, ATTN_BLOCK * 2);
                _tile_dpbf16ps(0, 1, 4);
                _tile_dpbf16ps(3, 1, 5);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(3, 2, 5);
                _tile_dpbf16ps(0, 7, 4);
                _tile_dpbf16ps(3, 7, 5);
            }
            _tile_stored(0, cb, 64);
            _tile_stored(3, cb + 256, 64);
            for (int64_t j = 0; j < rn; j++) {
                const __m512 a = _mm512_load_ps(cb + 16 * j), b = _mm512_load_ps(cb + 256 + 16 * j);
                float *o = orow[r0 + j] + 2 + sp * 32;
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(a, idx0, b));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a, idx1, b));
            }
        }
    }
    _tile_release();
    atomic_fetch_add(&attn_amx_calls, 1);
}
#endif

#ifdef FT_X86
/* attn_item on the AVX2 path. The rows of one pass are the G query heads of kv head hk for a run of the item's
 * queries whose block starts at the same key (queries with the same lo: a decode step's one query, a verify row of
 * speculative decoding, a causal chunk), so each key and value vector is loaded and widened once for 4 of them
 * (the per-query loops loaded it once per query head).
 * The pass covers the longest of the run's ranges in the block; a shorter query's scores past its end are set to 0
 * before the value sum (fma(0, v, o) = o), so each query's bits are those it gets alone. */
FT_AVX2 static void attn_item_rows(attn_ctx *c, int64_t grp, int64_t hk, int64_t blk, attn_pf *qk_nx,
                                   attn_pf *pv_nx) {
    const int64_t g = c->h / c->hkv, t1 = (grp + 1) * ATTN_QUERIES_PER_ITEM < c->t ? (grp + 1) * ATTN_QUERIES_PER_ITEM : c->t;
    const int64_t rmax = (ATTN_QUERIES_PER_ITEM * g + 3) / 4 * 4, pad = c->dh > c->dv + 2 ? c->dh : c->dv + 2;
    /* scores [rmax][ATTN_BLOCK], a zero query row / dummy output row for the padding rows of the last tile of 4,
     * then the rows' pointers and lengths (2 floats each) */
    const int64_t base = (rmax * ATTN_BLOCK + (pad + 7) / 8 * 8 + 8 * rmax + 15) / 16 * 16; /* floats, 64-byte multiple */
#ifdef FT_HAVE_AMX
    const int64_t extra = c->amx ? (int64_t)attn_amx_ws_bytes(rmax, c->dh, c->dv) / 4 : 0;
#else
    const int64_t extra = 0;
#endif
    const int64_t dp = (c->dh + 31) / 32 * 32; /* the bf16 score pass's query rows (bf16_dot) */
    float *sc = attn_scratch(base + extra + (c->bf16_dot ? rmax * dp / 2 : 0));
    if (!sc) {
        atomic_store(&c->failed, 1);
        return;
    }
    float *spare = sc + rmax * ATTN_BLOCK;
    const float **qr = (const float **)(spare + (pad + 7) / 8 * 8);
    float **orow = (float **)(spare + (pad + 7) / 8 * 8 + 2 * rmax);
    int64_t *nrow = (int64_t *)(spare + (pad + 7) / 8 * 8 + 4 * rmax);
    uint16_t *qbf = (uint16_t *)(sc + base + extra);
    const size_t es = kv_elsize(c->kv_type);
    for (int64_t tq = grp * ATTN_QUERIES_PER_ITEM; tq < t1;) {
        const int64_t s0 = c->lo[tq] + blk * ATTN_BLOCK;
        if (s0 >= c->hi[tq]) { /* this query has fewer blocks */
            tq++;
            continue;
        }
        int64_t te = tq, n = 0, R = 0;
        for (; te < t1 && c->lo[te] == c->lo[tq] && s0 < c->hi[te]; te++) {
            const int64_t nq = c->hi[te] - s0 < ATTN_BLOCK ? c->hi[te] - s0 : ATTN_BLOCK;
            n = nq > n ? nq : n;
            for (int64_t j = 0; j < g; j++, R++) {
                qr[R] = c->q + (te * c->h + hk * g + j) * c->dh;
                orow[R] = c->part + (((te * c->hkv + hk) * c->blocks + blk) * g + j) * (2 + c->dv);
                nrow[R] = nq;
            }
        }
        const int64_t R4 = (R + 3) / 4 * 4;
        if (R4 > R) memset(spare, 0, sizeof(float) * (size_t)c->dh);
        for (int64_t r = R; r < R4; r++) { /* padding rows: a zero query, scores set to 0, output dropped */
            qr[r] = spare;
            orow[r] = spare;
            nrow[r] = 0;
        }
        const void *kb = (const char *)c->k + (size_t)(s0 * c->k_stride + hk * c->dh) * es;
        const void *vb = (const char *)c->v + (size_t)(s0 * c->v_stride + hk * c->dv) * es;
#ifdef FT_HAVE_AMX
        if (c->amx) {
            int64_t *qrow = nrow + rmax; /* the rows' indices in c->qs */
            for (int64_t r = 0; r < R; r++) qrow[r] = (qr[r] - c->q) / c->dh;
            attn_run_amx(c, R, qrow, orow, nrow, n, (const uint16_t *)kb, (const uint16_t *)vb, sc,
                         (uint8_t *)(sc + base));
            tq = te;
            continue;
        }
#endif
        const int wide = g_isa >= FT_ISA_AVX512VNNI;
#ifdef FT_HAVE_BF16DOT
        if (c->bf16_dot) {
            attn_bf16_rows(qr, R4, c->dh, dp, qbf);
            qk_rows512_bf16dot(qbf, dp, R4, (const uint16_t *)kb, c->k_stride, n, c->dh, c->scale, sc, qk_nx);
        } else
#endif
        if (c->kv_type == FT_KV_F16)
            (wide ? qk_rows512_f16 : qk_rows_f16_avx2)(qr, R4, (const uint16_t *)kb, c->k_stride, n, c->dh, c->scale, sc, qk_nx);
        else if (c->kv_type == FT_KV_BF16)
            (wide ? qk_rows512_bf16 : qk_rows_bf16_avx2)(qr, R4, (const uint16_t *)kb, c->k_stride, n, c->dh, c->scale,
                                                          sc, qk_nx);
        else if (c->kv_type == FT_KV_F8)
            (wide ? qk_rows512_f8 : qk_rows_f8_avx2)(qr, R4, (const uint8_t *)kb, c->k_stride, n, c->dh, c->scale, sc, qk_nx);
        else
            (wide ? qk_rows512_f32 : qk_rows_avx2)(qr, R4, (const float *)kb, c->k_stride, n, c->dh, c->scale, sc, qk_nx);
        for (int64_t r = 0; r < R4; r++) {
            float *row = sc + r * ATTN_BLOCK;
            if (r < R) {
                const float m = wide ? max512(row, nrow[r]) : max_avx2(row, nrow[r]);
                orow[r][0] = m;
                orow[r][1] = wide ? exp_sub_sum512(row, nrow[r], m) : exp_sub_sum_avx2(row, nrow[r], m);
                orow[r] += 2; /* the value sum's place in the row */
            }
            for (int64_t i = nrow[r]; i < n; i++) row[i] = 0.f;
        }
        if (c->kv_type == FT_KV_F16)
            (wide ? pv_rows512_f16 : pv_rows_f16_avx2)(sc, R4, (const uint16_t *)vb, c->v_stride, n, c->dv, orow, pv_nx);
        else if (c->kv_type == FT_KV_BF16)
            (wide ? pv_rows512_bf16 : pv_rows_bf16_avx2)(sc, R4, (const uint16_t *)vb, c->v_stride, n, c->dv, orow, pv_nx);
        else if (c->kv_type == FT_KV_F8)
            (wide ? pv_rows512_f8 : pv_rows_f8_avx2)(sc, R4, (const uint8_t *)vb, c->v_stride, n, c->dv, orow, pv_nx);
        else
            (wide ? pv_rows512_f32 : pv_rows_avx2)(sc, R4, (const float *)vb, c->v_stride, n, c->dv, orow, pv_nx);
        tq = te;
    }
}
#endif

/* item = (group of queries, kv head, key block): each query of the group on its own block of keys, in the same
 * order as when it is alone (the group only keeps the block in cache) */
#ifdef FT_X86
/* item = (group of queries, key block, run of hk_item kv heads): a block's keys of all kv heads lie side by side in
 * each position's row, so one item reading every head consumes whole cache lines and pages in order (one item per
 * head read a quarter of each row at a 4-head stride, and the hardware prefetchers fetched the rest for nothing:
 * 1.6x slower at 4k keys). Heads are split over items only where there are too few blocks to feed the pool. */
static void attn_rows_item(void *p, int64_t item) {
    attn_ctx *c = (attn_ctx *)p;
    const int64_t runs = (c->hkv + c->hk_item - 1) / c->hk_item;
    const int64_t grp = item / (c->blocks * runs), blk = item / runs % c->blocks, h0 = item % runs * c->hk_item;
    const int64_t h1 = h0 + c->hk_item < c->hkv ? h0 + c->hk_item : c->hkv;
    /* The pool hands each thread a contiguous run of items, so this thread's next item is most likely the next
     * block of the same heads: its rows (the group's first query's range) are prefetched while this block
     * computes, the values during the score passes and the keys during the value passes, a few lines per inner
     * step spread over the whole item (a burst, or a whole-row prefetch a few keys ahead, fetched no faster). */
    attn_pf kx = {0}, vx = {0};
    const int64_t tq = grp * ATTN_QUERIES_PER_ITEM, s1 = c->lo[tq] + (blk + 1) * ATTN_BLOCK;
    if (blk + 1 < c->blocks && s1 < c->hi[tq]) {
        const int64_t es = (int64_t)kv_elsize(c->kv_type), g = c->h / c->hkv, heads = h1 - h0;
        const int64_t rows = c->hi[tq] - s1 < ATTN_BLOCK ? c->hi[tq] - s1 : ATTN_BLOCK;
        const int64_t rn = c->hi[tq] - c->lo[tq] - blk * ATTN_BLOCK, n = rn < ATTN_BLOCK ? rn : ATTN_BLOCK;
        const int wide = g_isa >= FT_ISA_AVX512VNNI;
        const int64_t tiles = (g + 3) / 4; /* tiles of 4 rows per pass for one query */
        const int64_t qk_steps = heads * tiles * (wide ? (n + 3) / 4 : (n + 1) / 2);
        const int64_t rest = c->dv % 64; /* the 512-bit value passes: 64 values, then 32, then 16 */
        const int64_t pv_steps = heads * tiles * n * (wide ? c->dv / 64 + rest / 32 + rest % 32 / 16 : c->dv / 16);
        kx = (attn_pf){(const char *)c->k + (s1 * c->k_stride + h0 * c->dh) * es, c->k_stride * es,
                       heads * c->dh * es, rows, 0, 0, 1};
        vx = (attn_pf){(const char *)c->v + (s1 * c->v_stride + h0 * c->dv) * es, c->v_stride * es,
                       heads * c->dv * es, rows, 0, 0, 1};
        const int64_t klines = rows * ((kx.span + 63) / 64), vlines = rows * ((vx.span + 63) / 64);
        vx.per = (vlines + qk_steps - 1) / (qk_steps > 0 ? qk_steps : 1);
        kx.per = (klines + pv_steps - 1) / (pv_steps > 0 ? pv_steps : 1);
    }
    for (int64_t hk = h0; hk < h1; hk++) attn_item_rows(c, grp, hk, blk, vx.rows ? &vx : NULL, kx.rows ? &kx : NULL);
}
#endif

static void attn_item(void *p, int64_t item) {
    attn_ctx *c = (attn_ctx *)p;
    const int64_t grp = item / (c->hkv * c->blocks), hk = item / c->blocks % c->hkv, blk = item % c->blocks;
    const int64_t g = c->h / c->hkv;
    float sc[ATTN_BLOCK];
    float *kw = NULL, *vw = NULL; /* the portable path's widened block of a 16-bit cache */
    int64_t widened = -1;         /* first key of the block in kw / vw */
    if (c->kv_type != FT_KV_F32) {
        kw = attn_scratch(ATTN_BLOCK * (c->dh + c->dv));
        if (!kw) {
            atomic_store(&c->failed, 1);
            return;
        }
        vw = kw + ATTN_BLOCK * c->dh;
    }
    for (int64_t tq = grp * ATTN_QUERIES_PER_ITEM; tq < (grp + 1) * ATTN_QUERIES_PER_ITEM && tq < c->t; tq++) {
        const int64_t s0 = c->lo[tq] + blk * ATTN_BLOCK;
        if (s0 >= c->hi[tq]) continue; /* this query has fewer blocks */
        const int64_t n = c->hi[tq] - s0 < ATTN_BLOCK ? c->hi[tq] - s0 : ATTN_BLOCK;
        const size_t es = kv_elsize(c->kv_type);
        const void *kb = (const char *)c->k + (size_t)(s0 * c->k_stride + hk * c->dh) * es;
        const void *vb = (const char *)c->v + (size_t)(s0 * c->v_stride + hk * c->dv) * es;
        int64_t ks = c->k_stride, vs = c->v_stride;
        if (kw) {
            if (widened != s0) { /* queries of a chunk with the same range share the widened block */
                kv_widen_c(c->kv_type, kb, ks, n, c->dh, kw);
                kv_widen_c(c->kv_type, vb, vs, n, c->dv, vw);
                widened = n == ATTN_BLOCK ? s0 : -1; /* a partial block is not reused by a longer range */
            }
            kb = kw;
            vb = vw;
            ks = c->dh;
            vs = c->dv;
        }
        for (int64_t j = 0; j < g; j++) {
            const int64_t h = hk * g + j;
            const float *q = c->q + (tq * c->h + h) * c->dh;
            float *row = c->part + (((tq * c->hkv + hk) * c->blocks + blk) * g + j) * (2 + c->dv);
            float *o = row + 2, m = -INFINITY, sum;
            const float *kf = (const float *)kb, *vf = (const float *)vb; /* fp32, or widened into kw / vw */
            for (int64_t i = 0; i < n; i++) {
                sc[i] = dot_f32_c(q, kf + i * ks, c->dh) * c->scale;
                if (sc[i] > m) m = sc[i];
            }
            sum = 0.f;
            for (int64_t i = 0; i < n; i++) sum += (sc[i] = expf(sc[i] - m));
            memset(o, 0, sizeof(float) * (size_t)c->dv);
            for (int64_t i = 0; i < n; i++)
                for (int64_t d = 0; d < c->dv; d++) o[d] += sc[i] * vf[i * vs + d];
            row[0] = m;
            row[1] = sum;
        }
    }
}

/* query tq's heads [h0, h1): merge its blocks in order, rescaling each by exp(its max - the max) */
static void attn_merge_heads(const attn_ctx *c, int64_t tq, int64_t h0, int64_t h1) {
    const int64_t g = c->h / c->hkv, dv = c->dv;
    const int64_t nb = (c->hi[tq] - c->lo[tq] + ATTN_BLOCK - 1) / ATTN_BLOCK;
    for (int64_t hh = h0; hh < h1; hh++) {
        const int64_t hk = hh / g, j = hh % g;
        const float *first = c->part + ((tq * c->hkv + hk) * c->blocks * g + j) * (2 + dv);
        const int64_t step = g * (2 + dv); /* from one block's row to the next */
        float m = c->sinks ? c->sinks[hh] : -INFINITY, sum = 0.f;
        for (int64_t b = 0; b < nb; b++)
            if (first[b * step] > m) m = first[b * step];
        if (c->sinks) sum = expf(c->sinks[hh] - m);
        float *o = c->out + (tq * c->h + hh) * dv;
        memset(o, 0, sizeof(float) * (size_t)dv);
        for (int64_t b = 0; b < nb; b++) {
            const float *row = first + b * step;
            const float w = expf(row[0] - m);
            sum += w * row[1];
            for (int64_t d = 0; d < dv; d++) o[d] += w * row[2 + d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < dv; d++) o[d] *= inv;
    }
}

static void attn_merge_item(void *p, int64_t tq) {
    const attn_ctx *c = (const attn_ctx *)p;
    attn_merge_heads(c, tq, 0, c->h);
}

/* Heads per item of a merge split over heads (a decode step's one query over a long range: the merge reads
 * H x blocks x (2 + Dv) floats, ~0.5 MB at 8k keys, and ran on the calling thread while the others waited) */
#define ATTN_MERGE_HEADS 4

static void attn_merge_split_item(void *p, int64_t item) {
    const attn_ctx *c = (const attn_ctx *)p;
    const int64_t per = (c->h + ATTN_MERGE_HEADS - 1) / ATTN_MERGE_HEADS, tq = item / per;
    const int64_t h0 = item % per * ATTN_MERGE_HEADS;
    attn_merge_heads(c, tq, h0, h0 + ATTN_MERGE_HEADS < c->h ? h0 + ATTN_MERGE_HEADS : c->h);
}

/* Merge floats above which a round of fewer than 4 queries splits its merge over heads on the pool */
#define ATTN_MERGE_SPLIT_FLOATS (32 << 10)

#define ATTN_PART_BYTES (8 << 20) /* scratch per round of queries */

/* out[T, H, Dv]: query t (q + t * H * Dh) attends keys [lo[t], hi[t]) with softmax(q k^T * scale) v; with `sinks`
 * (NULL: none) head h's softmax has one more logit, sinks[h], that takes probability but carries no value
 * (GPT-OSS). k and v hold kv_type elements (FT_KV_F32 / F16 / BF16 / F8; strides in elements). Every range must be
 * non-empty. Returns 0, or -1 on bad sizes or allocation failure. */
int ft_attn_queries_kv(const float *q, int64_t t, const void *k, const void *v, int kv_type, const int64_t *lo,
                       const int64_t *hi, int64_t h, int64_t hkv, int64_t dh, int64_t dv, int64_t k_stride,
                       int64_t v_stride, float scale, const float *sinks, float *out) {
    if (g_isa < 0) g_isa = detect_isa();
    if (t < 1 || hkv < 1 || h % hkv || kv_type < FT_KV_F32 || kv_type > FT_KV_F8) return -1;
    int64_t blocks = 1;
    for (int64_t i = 0; i < t; i++) {
        if (hi[i] <= lo[i] || lo[i] < 0) return -1;
        const int64_t b = (hi[i] - lo[i] + ATTN_BLOCK - 1) / ATTN_BLOCK;
        blocks = b > blocks ? b : blocks;
    }
    const int64_t per_query = hkv * blocks * (h / hkv) * (2 + dv); /* floats of scratch */
    int64_t round = ATTN_PART_BYTES / (int64_t)sizeof(float) / per_query;
    round = round < 1 ? 1 : (round > t ? t : round);
    float *part = (float *)malloc(sizeof(float) * (size_t)(round * per_query));
    if (!part) return -1;
    uint16_t *qs = NULL; /* AMX path: the queries' bf16 parts */
#ifdef FT_HAVE_AMX
    const int amx = attn_amx_applies(kv_type, dh, dv);
    if (amx) {
        qs = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(t * h * 3 * dh));
        if (!qs) {
            free(part);
            return -1;
        }
        attn_split_queries(q, t * h, dh, qs);
    }
#else
    const int amx = 0;
#endif
#ifdef FT_HAVE_BF16DOT
    const int bf16_dot = !amx && kv_type == FT_KV_BF16 && attn_bf16_dot_on();
#else
    const int bf16_dot = 0;
#endif
    int rc = 0;
    for (int64_t t0 = 0; t0 < t && !rc; t0 += round) {
        const int64_t n = t - t0 < round ? t - t0 : round;
        attn_ctx c = {q + t0 * h * dh, k, v, sinks, lo + t0, hi + t0, n, h, hkv, dh, dv, k_stride, v_stride, blocks,
                      scale, part, out + t0 * h * dv, kv_type, 0, hkv, qs ? qs + t0 * h * 3 * dh : NULL, amx, bf16_dot};
        const int64_t groups = (n + ATTN_QUERIES_PER_ITEM - 1) / ATTN_QUERIES_PER_ITEM;
#ifdef FT_X86
        if (g_isa >= FT_ISA_AVX2) {
            const int64_t want = 4 * (int64_t)(g_pool.n_workers + 1); /* items that keep every thread busy */
            if (groups * blocks < want) {
                int64_t split = (want + groups * blocks - 1) / (groups * blocks); /* items per block */
                split = split < hkv ? split : hkv;
                c.hk_item = (hkv + split - 1) / split;
            }
            ft_parallel_for(attn_rows_item, &c, groups * blocks * ((hkv + c.hk_item - 1) / c.hk_item));
        } else
#endif
            ft_parallel_for(attn_item, &c, groups * hkv * blocks);
        if (atomic_load(&c.failed)) {
            rc = -1;
            break;
        }
        if (n >= 4)
            ft_parallel_for(attn_merge_item, &c, n);
        else if (c.h > ATTN_MERGE_HEADS && c.h * blocks * (2 + dv) >= ATTN_MERGE_SPLIT_FLOATS)
            ft_parallel_for(attn_merge_split_item, &c, n * ((c.h + ATTN_MERGE_HEADS - 1) / ATTN_MERGE_HEADS));
        else
            for (int64_t i = 0; i < n; i++) attn_merge_item(&c, i);
    }
    free(part);
    free(qs);
    return rc;
}

/* ft_attn_queries_kv over an fp32 cache */
int ft_attn_queries(const float *q, int64_t t, const float *k, const float *v, const int64_t *lo, const int64_t *hi,
                    int64_t h, int64_t hkv, int64_t dh, int64_t dv, int64_t k_stride, int64_t v_stride, float scale,
                    const float *sinks, float *out) {
    return ft_attn_queries_kv(q, t, k, v, FT_KV_F32, lo, hi, h, hkv, dh, dv, k_stride, v_stride, scale, sinks, out);
}

/* out[H, Dv] for one query over all s keys (a decode step): ft_attn_queries_kv with the range [0, s). */
int ft_attn_decode_kv(const float *q, const void *k, const void *v, int kv_type, int64_t s, int64_t h, int64_t hkv,
                      int64_t dh, int64_t dv, int64_t k_stride, int64_t v_stride, float scale, const float *sinks,
                      float *out) {
    const int64_t lo = 0, hi = s;
    return ft_attn_queries_kv(q, 1, k, v, kv_type, &lo, &hi, h, hkv, dh, dv, k_stride, v_stride, scale, sinks, out);
}

/* 1 if attention over a kv_type cache with these head sizes runs on the AMX-BF16 path here, else 0 */
int ft_attn_amx_applies(int kv_type, int64_t dh, int64_t dv) {
#ifdef FT_HAVE_AMX
    return attn_amx_applies(kv_type, dh, dv);
#else
    (void)kv_type, (void)dh, (void)dv;
    return 0;
#endif
}

/* Turn the AMX-BF16 path for bf16 caches on (1) or off (0); returns the previous setting */
int ft_attn_set_amx(int on) {
#ifdef FT_HAVE_AMX
    const int before = attn_amx_mode > 0;
    attn_amx_mode = on != 0;
    return before;
#else
    (void)on;
    return 0;
#endif
}

/* 1 if a bf16 cache's score pass runs on AVX512-BF16 dot products here (turned on, an AVX-512 path in use, the CPU
 * has AVX512-BF16), else 0 */
int ft_attn_bf16_dot_applies(void) {
#ifdef FT_HAVE_BF16DOT
    if (g_isa < 0) g_isa = detect_isa();
    return attn_bf16_dot_on();
#else
    return 0;
#endif
}

/* Turn the AVX512-BF16 score pass for bf16 caches on (1) or off (0); returns the previous setting */
int ft_attn_set_bf16_dot(int on) {
#ifdef FT_HAVE_BF16DOT
    const int before = attn_bf16_dot_setting();
    attn_bf16_dot_mode = on != 0;
    return before;
#else
    (void)on;
    return 0;
#endif
}

/* Key blocks run on the AMX-BF16 path since the library loaded */
int64_t ft_attn_amx_calls(void) {
#ifdef FT_HAVE_AMX
    return atomic_load(&attn_amx_calls);
#else
    return 0;
#endif
}

int ft_attn_decode(const float *q, const float *k, const float *v, int64_t s, int64_t h, int64_t hkv, int64_t dh,
                   int64_t dv, int64_t k_stride, int64_t v_stride, float scale, const float *sinks, float *out) {
    return ft_attn_decode_kv(q, k, v, FT_KV_F32, s, h, hkv, dh, dv, k_stride, v_stride, scale, sinks, out);
}

#endif
