/* Attention of query tokens over a KV cache, on the kernels' pool, split over keys.
 *
 * q [T, H, Dh]; keys k[s] = k + s * k_stride (Hkv rows of Dh floats each, contiguous), values likewise [Hkv, Dv];
 * query head h reads kv head h / (H / Hkv); query t sees keys [lo[t], hi[t]) (causal, sliding window, chunk).
 * Items are (a few queries, kv head, block of ATTN_BLOCK keys counted from each query's lo[t]): for each query, the
 * G query heads' scores against its keys, their block max, exp-sum and exp-weighted value sum, written to a scratch
 * row; then each query's blocks are merged in block order (the split-K "flash decoding" combine) in fp32. So a
 * query's bits depend only on its own q, keys and range: the same whether it is decoded alone (T = 1, a decode
 * step) or one of a prefill chunk (batch invariance). K and V are read by every pool thread at once — torch runs
 * the two matmuls on one thread, through a permuted (copied) view of K. exp is a vectorized polynomial (Cephes'
 * expf: relative error ~2e-7 on [-87, 0]).
 *
 * 16-bit caches (kv_type FT_KV_F16 / FT_KV_BF16: k and v point at IEEE halves / bfloat16s, strides in elements)
 * are read as they are: the AVX2 loops widen 8 values at a time in registers (F16C _mm256_cvtph_ps; bf16: a 16-bit
 * shift) right where the fp32 loops load them, and the portable path widens each block into a per-thread fp32
 * scratch first. Widening is exact and the arithmetic after it is the fp32 code's, so a 16-bit cache gives bitwise
 * what the fp32 kernel gives on the widened cache, on every path, at half the bytes streamed from memory (the
 * block comes from DRAM once; the G query heads of a kv head reread it from L1/L2 and convert again: widening 8 rows
 * once into L1 for all G heads measured 1.3-2x slower on an AVX2 EPYC, the loads and stores of the widened rows
 * costing more than the conversions). The AVX-512 ISA setting runs these AVX2 loops, as it does for an fp32 cache.
 */
#ifndef FT_ATTN_H
#define FT_ATTN_H

#include <math.h>
#include <stdint.h>

#define ATTN_BLOCK 128

enum { FT_KV_F32 = 0, FT_KV_F16 = 1, FT_KV_BF16 = 2 }; /* element type of the cached keys and values */

typedef struct {
    const float *q;
    const void *k, *v; /* float, or uint16 (fp16 / bf16) per kv_type */
    const float *sinks;
    const int64_t *lo, *hi; /* query t sees keys [lo[t], hi[t]) */
    int64_t t, h, hkv, dh, dv, k_stride, v_stride, blocks; /* t queries; blocks: the most any query has */
    float scale;
    float *part; /* per (query, kv head, block, g): [max, sum, o[Dv]] */
    float *out;  /* [T, H, Dv] */
    int kv_type;
    _Atomic int failed; /* a worker could not get its widening scratch */
} attn_ctx;

/* ---- 16-bit keys and values: widen n rows of d values (row i at src + i * stride elements) to dst [n, d] */

static void kv_widen_c(int type, const uint16_t *src, int64_t stride, int64_t n, int64_t d, float *dst) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *r = src + i * stride;
        float *o = dst + i * d;
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

/* the 8 horizontal sums of a[0..7], in order, in one vector */
FT_AVX2 static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The loops that read the cache, one set per element type: T the stored type, LOAD8(p) 8 of them as fp32 (fp32: a
 * load; fp16: F16C's _mm256_cvtph_ps; bf16: a 16-bit shift), SCALAR(x) one. The same products and sums in the
 * same order for every type: a 16-bit cache gives the bits an fp32 one holding the widened values gives. */
#define FT_ATTN_LOOPS(SUF, T, LOAD8, SCALAR)                                                                       \
    FT_AVX2 static float dot_##SUF(const float *a, const T *b, int64_t k) {                                     \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                             \
        int64_t i = 0;                                                                                         \
        for (; i + 16 <= k; i += 16) {                                                                         \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOAD8(b + i), a0);                                    \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), LOAD8(b + i + 8), a1);                            \
        }                                                                                                      \
        float s = hsum256(_mm256_add_ps(a0, a1));                                                              \
        for (; i < k; i++) s += a[i] * SCALAR(b[i]);                                                           \
        return s;                                                                                              \
    }                                                                                                          \
    /* o[0:n] += p * v[0:n] */                                                                                 \
    FT_AVX2 static void axpy_##SUF(float *o, float p, const T *v, int64_t n) {                                  \
        const __m256 pv = _mm256_set1_ps(p);                                                                   \
        int64_t i = 0;                                                                                         \
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, LOAD8(v + i), _mm256_loadu_ps(o + i))); \
        for (; i < n; i++) o[i] += p * SCALAR(v[i]);                                                           \
    }                                                                                                          \
    /* sc[i] = q . k[i] * scale for n keys (key i at k + i * stride): 8 keys at a time, 8 independent FMA chains */ \
    FT_AVX2 static void qk_##SUF(const float *q, const T *k, int64_t stride, int64_t n, int64_t dh, float scale, \
                                 float *sc) {                                                                  \
        int64_t i = 0;                                                                                         \
        if (dh % 8 == 0)                                                                                       \
            for (; i + 8 <= n; i += 8) {                                                                       \
                __m256 a[8];                                                                                   \
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();                                        \
                const T *kb = k + i * stride;                                                                  \
                for (int64_t d = 0; d < dh; d += 8) {                                                          \
                    const __m256 qv = _mm256_loadu_ps(q + d);                                                  \
                    for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, LOAD8(kb + u * stride + d), a[u]);  \
                }                                                                                              \
                _mm256_storeu_ps(sc + i, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));                    \
            }                                                                                                  \
        for (; i < n; i++) sc[i] = dot_##SUF(q, k + i * stride, dh) * scale;                                   \
    }                                                                                                          \
    /* o[0:dv] = sum_i p[i] * v[i] (value i at v + i * stride), 64 output values at a time in registers */     \
    FT_AVX2 static void pv_##SUF(const float *p, const T *v, int64_t stride, int64_t n, int64_t dv, float *o) { \
        int64_t d0 = 0;                                                                                        \
        for (; d0 + 64 <= dv; d0 += 64) {                                                                      \
            __m256 a[8];                                                                                       \
            for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();                                            \
            for (int64_t i = 0; i < n; i++) {                                                                  \
                const __m256 pv = _mm256_set1_ps(p[i]);                                                        \
                const T *vr = v + i * stride + d0;                                                             \
                for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(pv, LOAD8(vr + 8 * u), a[u]);               \
            }                                                                                                  \
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + d0 + 8 * u, a[u]);                                \
        }                                                                                                      \
        if (d0 < dv) {                                                                                         \
            memset(o + d0, 0, sizeof(float) * (size_t)(dv - d0));                                              \
            for (int64_t i = 0; i < n; i++) axpy_##SUF(o + d0, p[i], v + i * stride + d0, dv - d0);            \
        }                                                                                                      \
    }

#define FT_LOAD_F32(p) _mm256_loadu_ps(p)
#define FT_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define FT_SAME_F32(x) (x)

FT_ATTN_LOOPS(avx2, float, FT_LOAD_F32, FT_SAME_F32)
FT_ATTN_LOOPS(f16_avx2, uint16_t, FT_LOAD_F16, fp16_to_fp32)
FT_ATTN_LOOPS(bf16_avx2, uint16_t, load_bf16x8, bf16_to_f32)
#endif

#define ATTN_QUERIES_PER_ITEM 8 /* queries of a chunk that share an item: its key block is read once for them */

/* item = (group of queries, kv head, key block): each query of the group on its own block of keys, in the same
 * order as when it is alone (the group only keeps the block in cache) */
static void attn_item(void *p, int64_t item) {
    attn_ctx *c = (attn_ctx *)p;
    const int64_t grp = item / (c->hkv * c->blocks), hk = item / c->blocks % c->hkv, blk = item % c->blocks;
    const int64_t g = c->h / c->hkv;
    float sc[ATTN_BLOCK];
#ifdef FT_X86
    const int avx = g_isa >= FT_ISA_AVX2;
#endif
    float *kw = NULL, *vw = NULL; /* the portable path's widened block of a 16-bit cache */
    int64_t widened = -1;         /* first key of the block in kw / vw */
    if (c->kv_type != FT_KV_F32
#ifdef FT_X86
        && !avx
#endif
    ) {
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
        const size_t es = c->kv_type == FT_KV_F32 ? sizeof(float) : sizeof(uint16_t);
        const void *kb = (const char *)c->k + (size_t)(s0 * c->k_stride + hk * c->dh) * es;
        const void *vb = (const char *)c->v + (size_t)(s0 * c->v_stride + hk * c->dv) * es;
        int64_t ks = c->k_stride, vs = c->v_stride;
        if (kw) {
            if (widened != s0) { /* queries of a chunk with the same range share the widened block */
                kv_widen_c(c->kv_type, (const uint16_t *)kb, ks, n, c->dh, kw);
                kv_widen_c(c->kv_type, (const uint16_t *)vb, vs, n, c->dv, vw);
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
#ifdef FT_X86
            if (avx) {
                if (c->kv_type == FT_KV_F16)
                    qk_f16_avx2(q, (const uint16_t *)kb, ks, n, c->dh, c->scale, sc);
                else if (c->kv_type == FT_KV_BF16)
                    qk_bf16_avx2(q, (const uint16_t *)kb, ks, n, c->dh, c->scale, sc);
                else
                    qk_avx2(q, (const float *)kb, ks, n, c->dh, c->scale, sc);
                for (int64_t i = 0; i < n; i++) m = sc[i] > m ? sc[i] : m;
                sum = exp_sub_sum_avx2(sc, n, m);
                if (c->kv_type == FT_KV_F16)
                    pv_f16_avx2(sc, (const uint16_t *)vb, vs, n, c->dv, o);
                else if (c->kv_type == FT_KV_BF16)
                    pv_bf16_avx2(sc, (const uint16_t *)vb, vs, n, c->dv, o);
                else
                    pv_avx2(sc, (const float *)vb, vs, n, c->dv, o);
                row[0] = m;
                row[1] = sum;
                continue;
            }
#endif
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
 * (GPT-OSS). k and v hold kv_type elements (FT_KV_F32 / F16 / BF16; strides in elements). Every range must be
 * non-empty. Returns 0, or -1 on bad sizes or allocation failure. */
int ft_attn_queries_kv(const float *q, int64_t t, const void *k, const void *v, int kv_type, const int64_t *lo,
                       const int64_t *hi, int64_t h, int64_t hkv, int64_t dh, int64_t dv, int64_t k_stride,
                       int64_t v_stride, float scale, const float *sinks, float *out) {
    if (g_isa < 0) g_isa = detect_isa();
    if (t < 1 || hkv < 1 || h % hkv || kv_type < FT_KV_F32 || kv_type > FT_KV_BF16) return -1;
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
                      scale, part, out + t0 * h * dv, kv_type, 0};
        const int64_t groups = (n + ATTN_QUERIES_PER_ITEM - 1) / ATTN_QUERIES_PER_ITEM;
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
