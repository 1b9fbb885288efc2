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
 * 16-bit caches (kv_type FT_KV_F16 / FT_KV_BF16: k and v point at IEEE halves / bfloat16s, strides in elements)
 * are read as they are: the AVX2 loops widen 8 values at a time in registers (F16C _mm256_cvtph_ps; bf16: a 16-bit
 * shift) right where the fp32 loops load them, and the portable path widens each block into a per-thread fp32
 * scratch first. Widening is exact and the arithmetic after it is the fp32 code's, so a 16-bit cache gives bitwise
 * what the fp32 kernel gives on the widened cache, on every path, at half the bytes streamed from memory (widening a
 * block into L1 once for all G heads measured 1.3-2x slower on an AVX2 EPYC than widening in registers; sharing each
 * widened register between 4 rows is what pays). The AVX-512 settings run the same arithmetic in 512-bit registers
 * (FT_ATTN_LOOPS512), bitwise equal to the AVX2 loops.
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
FT_AVX2 static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f)); /* below: 0 (exp underflows anyway) */
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

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
    /* sc[r * ATTN_BLOCK + i] = q[r] . k[i] * scale for R query rows (R a multiple of 4) and n keys, each key's   \
     * 8-value vector loaded (and widened) once for a tile of 4 rows x 2 keys. Every (row, key) is one FMA chain  \
     * over d in 8-lane steps, reduced by hsum8x8's fixed tree, then the d tail by fmaf: the same bits in any     \
     * tile. An odd n also writes sc at key n (a copy of key n - 1's score: not read). */                          \
    FT_AVX2 static void qk_rows_##SUF(const float *const *q, int64_t R, const T *k, int64_t stride, int64_t n,    \
                                      int64_t dh, float scale, float *sc) {                                   \
        const int64_t d8 = dh / 8 * 8;                                                                         \
        for (int64_t i = 0; i < n; i += 2) {                                                                   \
            const T *k0 = k + i * stride, *k1 = i + 1 < n ? k0 + stride : k0;                                  \
            if (i + ATTN_AHEAD + 1 < n) /* the rows a few keys ahead: they sit at a stride of all kv heads */    \
                for (int64_t b = 0; b < dh * (int64_t)sizeof(T); b += 64) {                                    \
                    _mm_prefetch((const char *)(k0 + ATTN_AHEAD * stride) + b, _MM_HINT_T0);                   \
                    _mm_prefetch((const char *)(k0 + (ATTN_AHEAD + 1) * stride) + b, _MM_HINT_T0);             \
                }                                                                                              \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                const float *q0 = q[r], *q1 = q[r + 1], *q2 = q[r + 2], *q3 = q[r + 3];                        \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                for (int64_t d = 0; d < d8; d += 8) {                                                          \
                    const __m256 x0 = LOAD8(k0 + d), x1 = LOAD8(k1 + d);                                       \
                    FT_TILE4X2(__m256, _mm256_fmadd_ps, _mm256_loadu_ps, q0 + d, q1 + d, q2 + d, q3 + d, x0, x1); \
                }                                                                                              \
                const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};                                        \
                float s8[8];                                                                                   \
                _mm256_storeu_ps(s8, hsum8x8(acc));                                                            \
                if (d8 < dh)                                                                                   \
                    for (int u = 0; u < 8; u++) {                                                              \
                        const float *qq = q[r + u / 2];                                                        \
                        const T *kk = u % 2 ? k1 : k0;                                                         \
                        for (int64_t d = d8; d < dh; d++) s8[u] = fmaf(qq[d], SCALAR(kk[d]), s8[u]);          \
                    }                                                                                          \
                for (int u = 0; u < 4; u++) {                                                                  \
                    sc[(r + u) * ATTN_BLOCK + i] = s8[2 * u] * scale;                                          \
                    sc[(r + u) * ATTN_BLOCK + i + 1] = s8[2 * u + 1] * scale;                                  \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    /* o[r][0:dv] = sum_i p[r * ATTN_BLOCK + i] * v[i] for R rows (a multiple of 4), each 16-value piece of a     \
     * value row loaded (and widened) once for 4 rows. Every output is fma(p_i, v_i, .) in key order from 0: any  \
     * tile, any lane or the scalar tail give the same bits. */                                                \
    FT_AVX2 static void pv_rows_##SUF(const float *p, int64_t R, const T *v, int64_t stride, int64_t n,          \
                                      int64_t dv, float *const *o) {                                          \
        const int64_t d16 = dv / 16 * 16;                                                                      \
        for (int64_t d0 = 0; d0 < d16; d0 += 16)                                                               \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                const float *p0 = p + r * ATTN_BLOCK, *p1 = p0 + ATTN_BLOCK, *p2 = p1 + ATTN_BLOCK,            \
                            *p3 = p2 + ATTN_BLOCK;                                                             \
                const T *vr = v + d0;                                                                          \
                for (int64_t i = 0; i < n; i++, vr += stride) {                                                \
                    if (d0 == 0 && r == 0 && i + ATTN_AHEAD < n) /* the first pass over the rows fetches them */ \
                        for (int64_t b = 0; b < dv * (int64_t)sizeof(T); b += 64)                              \
                            _mm_prefetch((const char *)(vr + ATTN_AHEAD * stride) + b, _MM_HINT_T0);           \
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

/* The same loops in 512-bit registers (the AVX-512 ISA settings), bitwise equal to the AVX2 ones: qk puts two
 * keys' 8-value pieces side by side in one register against the query piece broadcast to both halves, so each half
 * is exactly an AVX2 accumulator (4 rows x 4 keys per tile, reduced by the same hsum8x8 tree); pv is one FMA chain
 * per output value in key order whatever the width. Half the instructions for the same arithmetic. */
#define FT_ATTN_LOOPS512(SUF, T, LOAD2X8, LOAD16, SCALAR)                                                          \
    FT_VNNI static void qk_rows512_##SUF(const float *const *q, int64_t R, const T *k, int64_t stride, int64_t n, \
                                         int64_t dh, float scale, float *sc) {                                \
        const int64_t d8 = dh / 8 * 8;                                                                         \
        for (int64_t i = 0; i < n; i += 4) {                                                                   \
            const T *kk[4];                                                                                    \
            for (int j = 0; j < 4; j++) kk[j] = k + (i + j < n ? i + j : n - 1) * stride;                     \
            if (i + ATTN_AHEAD + 3 < n)                                                                        \
                for (int64_t b = 0; b < dh * (int64_t)sizeof(T); b += 64)                                      \
                    for (int j = 0; j < 4; j++)                                                                \
                        _mm_prefetch((const char *)(kk[j] + ATTN_AHEAD * stride) + b, _MM_HINT_T0);            \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                const float *q0 = q[r], *q1 = q[r + 1], *q2 = q[r + 2], *q3 = q[r + 3];                        \
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                for (int64_t d = 0; d < d8; d += 8) {                                                          \
                    const __m512 x0 = LOAD2X8(kk[0] + d, kk[1] + d), x1 = LOAD2X8(kk[2] + d, kk[3] + d);       \
                    FT_TILE4X2(__m512, _mm512_fmadd_ps, ft_bcast8x2, q0 + d, q1 + d, q2 + d, q3 + d, x0, x1);  \
                }                                                                                              \
                /* keys 0, 1 of each row, then keys 2, 3: the AVX2 tile's (row, key) accumulator order */       \
                const __m256 lo[8] = {ft_lo8(a0), ft_hi8(a0), ft_lo8(a2), ft_hi8(a2),                          \
                                      ft_lo8(a4), ft_hi8(a4), ft_lo8(a6), ft_hi8(a6)};                         \
                const __m256 hi[8] = {ft_lo8(a1), ft_hi8(a1), ft_lo8(a3), ft_hi8(a3),                          \
                                      ft_lo8(a5), ft_hi8(a5), ft_lo8(a7), ft_hi8(a7)};                         \
                float s8[16];                                                                                  \
                _mm256_storeu_ps(s8, hsum8x8(lo));                                                             \
                _mm256_storeu_ps(s8 + 8, hsum8x8(hi));                                                         \
                for (int u = 0; u < 4; u++)                                                                    \
                    for (int j = 0; j < 4; j++) {                                                              \
                        float x = s8[(j / 2) * 8 + 2 * u + j % 2];                                             \
                        for (int64_t d = d8; d < dh; d++) x = fmaf(q[r + u][d], SCALAR(kk[j][d]), x);         \
                        sc[(r + u) * ATTN_BLOCK + i + j] = x * scale;                                          \
                    }                                                                                          \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    FT_VNNI static void pv_rows512_##SUF(const float *p, int64_t R, const T *v, int64_t stride, int64_t n,       \
                                         int64_t dv, float *const *o) {                                       \
        const int64_t d32 = dv / 32 * 32, d16 = dv / 16 * 16;                                                  \
        for (int64_t d0 = 0; d0 < d16; d0 += d0 < d32 ? 32 : 16) {                                             \
            const int two = d0 < d32;                                                                          \
            for (int64_t r = 0; r < R; r += 4) {                                                               \
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                const float *p0 = p + r * ATTN_BLOCK, *p1 = p0 + ATTN_BLOCK, *p2 = p1 + ATTN_BLOCK,            \
                            *p3 = p2 + ATTN_BLOCK;                                                             \
                const T *vr = v + d0;                                                                          \
                for (int64_t i = 0; i < n; i++, vr += stride) {                                                \
                    if (d0 == 0 && r == 0 && i + ATTN_AHEAD < n)                                               \
                        for (int64_t b = 0; b < dv * (int64_t)sizeof(T); b += 64)                              \
                            _mm_prefetch((const char *)(vr + ATTN_AHEAD * stride) + b, _MM_HINT_T0);           \
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
        FT_PV_TAIL(SCALAR, d16);                                                                               \
    }

FT_VNNI static inline __m256 ft_lo8(__m512 z) { return _mm512_castps512_ps256(z); }
FT_VNNI static inline __m256 ft_hi8(__m512 z) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)); }
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
#endif

#define ATTN_QUERIES_PER_ITEM 8 /* queries of a chunk that share an item: its key block is read once for them */

#ifdef FT_X86
/* attn_item on the AVX2 path. The rows of one pass are the G query heads of kv head hk for a run of the item's
 * queries whose block starts at the same key (queries with the same lo: a decode step's one query, a verify row of
 * speculative decoding, a causal chunk), so each key and value vector is loaded and widened once for 4 of them
 * (the per-query loops loaded it once per query head).
 * The pass covers the longest of the run's ranges in the block; a shorter query's scores past its end are set to 0
 * before the value sum (fma(0, v, o) = o), so each query's bits are those it gets alone. */
FT_AVX2 static void attn_item_rows(attn_ctx *c, int64_t grp, int64_t hk, int64_t blk) {
    const int64_t g = c->h / c->hkv, t1 = (grp + 1) * ATTN_QUERIES_PER_ITEM < c->t ? (grp + 1) * ATTN_QUERIES_PER_ITEM : c->t;
    const int64_t rmax = (ATTN_QUERIES_PER_ITEM * g + 3) / 4 * 4, pad = c->dh > c->dv + 2 ? c->dh : c->dv + 2;
    /* scores [rmax][ATTN_BLOCK], a zero query row / dummy output row for the padding rows of the last tile of 4,
     * then the rows' pointers and lengths (2 floats each) */
    float *sc = attn_scratch(rmax * ATTN_BLOCK + (pad + 7) / 8 * 8 + 6 * rmax);
    if (!sc) {
        atomic_store(&c->failed, 1);
        return;
    }
    float *spare = sc + rmax * ATTN_BLOCK;
    const float **qr = (const float **)(spare + (pad + 7) / 8 * 8);
    float **orow = (float **)(spare + (pad + 7) / 8 * 8 + 2 * rmax);
    int64_t *nrow = (int64_t *)(spare + (pad + 7) / 8 * 8 + 4 * rmax);
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
        const int wide = g_isa >= FT_ISA_AVX512VNNI;
        if (c->kv_type == FT_KV_F16)
            (wide ? qk_rows512_f16 : qk_rows_f16_avx2)(qr, R4, (const uint16_t *)kb, c->k_stride, n, c->dh, c->scale, sc);
        else if (c->kv_type == FT_KV_BF16)
            (wide ? qk_rows512_bf16 : qk_rows_bf16_avx2)(qr, R4, (const uint16_t *)kb, c->k_stride, n, c->dh, c->scale,
                                                          sc);
        else if (c->kv_type == FT_KV_F8)
            (wide ? qk_rows512_f8 : qk_rows_f8_avx2)(qr, R4, (const uint8_t *)kb, c->k_stride, n, c->dh, c->scale, sc);
        else
            (wide ? qk_rows512_f32 : qk_rows_avx2)(qr, R4, (const float *)kb, c->k_stride, n, c->dh, c->scale, sc);
        for (int64_t r = 0; r < R4; r++) {
            float *row = sc + r * ATTN_BLOCK;
            if (r < R) {
                const float m = max_avx2(row, nrow[r]);
                orow[r][0] = m;
                orow[r][1] = exp_sub_sum_avx2(row, nrow[r], m);
                orow[r] += 2; /* the value sum's place in the row */
            }
            for (int64_t i = nrow[r]; i < n; i++) row[i] = 0.f;
        }
        if (c->kv_type == FT_KV_F16)
            (wide ? pv_rows512_f16 : pv_rows_f16_avx2)(sc, R4, (const uint16_t *)vb, c->v_stride, n, c->dv, orow);
        else if (c->kv_type == FT_KV_BF16)
            (wide ? pv_rows512_bf16 : pv_rows_bf16_avx2)(sc, R4, (const uint16_t *)vb, c->v_stride, n, c->dv, orow);
        else if (c->kv_type == FT_KV_F8)
            (wide ? pv_rows512_f8 : pv_rows_f8_avx2)(sc, R4, (const uint8_t *)vb, c->v_stride, n, c->dv, orow);
        else
            (wide ? pv_rows512_f32 : pv_rows_avx2)(sc, R4, (const float *)vb, c->v_stride, n, c->dv, orow);
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
    for (int64_t hk = h0; hk < h0 + c->hk_item && hk < c->hkv; hk++) attn_item_rows(c, grp, hk, blk);
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

/* query tq's heads: merge its blocks in order, rescaling each by exp(its max - the max) */
static void attn_merge_item(void *p, int64_t tq) {
    const attn_ctx *c = (const attn_ctx *)p;
    const int64_t g = c->h / c->hkv, dv = c->dv;
    const int64_t nb = (c->hi[tq] - c->lo[tq] + ATTN_BLOCK - 1) / ATTN_BLOCK;
    for (int64_t hh = 0; hh < c->h; hh++) {
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
    int rc = 0;
    for (int64_t t0 = 0; t0 < t && !rc; t0 += round) {
        const int64_t n = t - t0 < round ? t - t0 : round;
        attn_ctx c = {q + t0 * h * dh, k, v, sinks, lo + t0, hi + t0, n, h, hkv, dh, dv, k_stride, v_stride, blocks,
                      scale, part, out + t0 * h * dv, kv_type, 0, hkv};
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
        if (n >= 4) ft_parallel_for(attn_merge_item, &c, n);
        else for (int64_t i = 0; i < n; i++) attn_merge_item(&c, i);
    }
    free(part);
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

int ft_attn_decode(const float *q, const float *k, const float *v, int64_t s, int64_t h, int64_t hkv, int64_t dh,
                   int64_t dv, int64_t k_stride, int64_t v_stride, float scale, const float *sinks, float *out) {
    return ft_attn_decode_kv(q, k, v, FT_KV_F32, s, h, hkv, dh, dv, k_stride, v_stride, scale, sinks, out);
}

#endif
