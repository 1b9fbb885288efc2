/* Load-time quantization to GGUF Q8_0 / Q4_0 blocks, the same rules as runtime/quant/blocks.py (the reference):
 * q8: d = fp16(absmax / 127), q = round(x / d); q4: d = fp16(m / -8) with m the value of largest magnitude,
 * code = clamp(round(x / d + 8), 0, 15), then (refine) a few shrunken scales and a least-squares refit.
 * Sums run in a different order than torch's, so an exact tie may resolve differently in rare blocks.
 * Input fp32, bf16 or fp16 (widened per block, never copied whole). The AVX2 path gives the portable path's bytes
 * exactly: q8 per block (its only reduction is a max), q4 eight blocks at a time, one block per lane, so every sum
 * runs over the block's values in the same order with the same operations (no FMA: the build is ISO C, and the
 * intrinsics are separate mul/add); F16C's round-to-nearest-even conversion equals fp32_to_fp16. */
#ifndef FT_QUANT_H
#define FT_QUANT_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7fffff;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = mant >> 13, rem = mant & 0x1fff;
    uint32_t h = sign | ((uint32_t)exp << 10) | r;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) h++; /* carries into the exponent correctly */
    return (uint16_t)h;
}

static inline float fp16_round(float f) { return fp16_to_fp32(fp32_to_fp16(f)); }

/* codes for scale d; returns the squared error */
static float q4_codes(const float *x, float d, float *codes) {
    float inv = d != 0.f ? 1.f / d : 0.f, err = 0.f;
    for (int j = 0; j < QK; j++) {
        float c = rintf(x[j] * inv + 8.f);
        c = c < 0.f ? 0.f : (c > 15.f ? 15.f : c);
        codes[j] = c;
        float e = (c - 8.f) * d - x[j];
        err += e * e;
    }
    return err;
}

static void quantize_block(int fmt, const float *x, int refine, uint8_t *out) {
    uint16_t h;
    if (fmt == FT_Q8) {
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = fp16_round(amax / 127.f), inv = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; j++) {
            float q = rintf(x[j] * inv);
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            out[2 + j] = (uint8_t)(int8_t)q;
        }
        h = fp32_to_fp16(d);
        memcpy(out, &h, 2);
        return;
    }
    float m = 0.f, amax = -1.f;
    for (int j = 0; j < QK; j++)
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); m = x[j]; }
    float d = fp16_round(m / -8.f), codes[QK], cand[QK];
    float best = q4_codes(x, d, codes);
    if (refine) {
        static const float f[5] = {0.80f, 0.84f, 0.88f, 0.92f, 0.96f};
        for (int i = 0; i < 5; i++) {
            float dc = fp16_round(d * f[i]), err = q4_codes(x, dc, cand);
            if (err < best) { best = err; d = dc; memcpy(codes, cand, sizeof codes); }
        }
        float num = 0.f, den = 0.f;
        for (int j = 0; j < QK; j++) { float c = codes[j] - 8.f; num += c * x[j]; den += c * c; }
        float dl = fp16_round(den > 0.f ? num / (den > 1e-30f ? den : 1e-30f) : d), err = 0.f;
        for (int j = 0; j < QK; j++) { float e = (codes[j] - 8.f) * dl - x[j]; err += e * e; }
        if (err < best) d = dl;
    }
    h = fp32_to_fp16(d);
    memcpy(out, &h, 2);
    for (int j = 0; j < 16; j++) out[2 + j] = (uint8_t)((int)codes[j] | ((int)codes[j + 16] << 4));
}


enum { FT_IN_F32 = 0, FT_IN_BF16 = 1, FT_IN_F16 = 2 };

static inline size_t in_size(int dt) { return dt == FT_IN_F32 ? 4 : 2; }

/* x[0:QK] = the block's `len` values as fp32, zero-padded; returns 1 if any is inf or nan. */
static int load_block(int dt, const void *src, int64_t len, float *x) {
    int bad = 0;
    for (int64_t j = 0; j < len; j++) {
        float v;
        if (dt == FT_IN_F32) {
            v = ((const float *)src)[j];
        } else if (dt == FT_IN_BF16) {
            uint32_t u = (uint32_t)((const uint16_t *)src)[j] << 16;
            memcpy(&v, &u, 4);
        } else {
            v = fp16_to_fp32(((const uint16_t *)src)[j]);
        }
        x[j] = v;
        bad |= !(fabsf(v) <= FLT_MAX);
    }
    for (int64_t j = len; j < QK; j++) x[j] = 0.f;
    return bad;
}

typedef struct {
    int fmt, refine, dt;
    const uint8_t *w; /* [N, K] of dt */
    int64_t n, k, nb;
    uint8_t *out;     /* [N, nb, 34|18], or packed: the tile layout (ft_tiles.h) */
    int packed;
    _Atomic int bad;  /* set when an input value is inf or nan */
} quant_ctx;

/* Block t (row t / nb, block t % nb) of the input as fp32. */
static inline int quant_load(const quant_ctx *c, int64_t t, float *x) {
    int64_t r = t / c->nb, j0 = (t % c->nb) * QK, len = j0 + QK <= c->k ? QK : c->k - j0;
    return load_block(c->dt, c->w + (size_t)(r * c->k + j0) * in_size(c->dt), len, x);
}

/* Blocks t0..t1-1 (flat over rows) into out[t - t0]; returns 1 if an input value is inf or nan. */
static int quant_blocks_c(const quant_ctx *c, int64_t t0, int64_t t1, uint8_t *out) {
    const int64_t bb = c->fmt == FT_Q4 ? 18 : 34;
    float x[QK];
    int bad = 0;
    for (int64_t t = t0; t < t1; t++) {
        bad |= quant_load(c, t, x);
        quantize_block(c->fmt, x, c->refine, out + (t - t0) * bb);
    }
    return bad;
}

/* One tile of GGUF blocks g[R][nb][34|18] (rows past the weight's end all zero) into the tile layout at `tile`
 * (layout.py's pack_blocks: per tile-block the 8 scales, then q8 chunk j = values 4j..4j+3 of each row, q4 chunk
 * j byte p = value 8j+p | value 8j+4+p << 4). */
static void pack_tile(int fmt, const uint8_t *g, int64_t nb, uint8_t *tile) {
    const int64_t bb = fmt == FT_Q4 ? 18 : 34, tbb = tile_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *tb = tile + b * tbb;
        for (int r = 0; r < TR; r++) {
            const uint8_t *blk = g + (r * nb + b) * bb;
            memcpy(tb + 2 * r, blk, 2);
            if (fmt == FT_Q8) {
                for (int j = 0; j < 8; j++) memcpy(tb + 2 * TR + (j * TR + r) * 4, blk + 2 + 4 * j, 4);
                continue;
            }
            uint8_t code[QK];
            for (int i = 0; i < QK / 2; i++) code[i] = blk[2 + i] & 15, code[i + QK / 2] = blk[2 + i] >> 4;
            for (int j = 0; j < 4; j++)
                for (int q = 0; q < 4; q++)
                    tb[2 * TR + (j * TR + r) * 4 + q] = (uint8_t)(code[8 * j + q] | code[8 * j + 4 + q] << 4);
        }
    }
}

#ifdef FT_X86
FT_AVX2 static inline __m256 f16_round8(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

/* One block as fp32 into x[QK] (full blocks widened in registers); returns 1 if any value is inf or nan. */
FT_AVX2 static int quant_load_avx2(const quant_ctx *c, int64_t t, float *x) {
    int64_t r = t / c->nb, j0 = (t % c->nb) * QK;
    if (j0 + QK > c->k) return quant_load(c, t, x);
    const uint8_t *src = c->w + (size_t)(r * c->k + j0) * in_size(c->dt);
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
    __m256 bad = _mm256_setzero_ps();
    for (int q = 0; q < QK / 8; q++) {
        __m256 v;
        if (c->dt == FT_IN_F32) {
            v = _mm256_loadu_ps((const float *)src + 8 * q);
        } else {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + 8 * q));
            v = c->dt == FT_IN_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                    : _mm256_cvtph_ps(h);
        }
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), big, _CMP_NLE_UQ));
        _mm256_storeu_ps(x + 8 * q, v);
    }
    return _mm256_movemask_ps(bad) != 0;
}

FT_AVX2 static void q8_block_avx2(const float *xs, uint8_t *out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 x[4], m = _mm256_setzero_ps();
    for (int q = 0; q < 4; q++) {
        x[q] = _mm256_loadu_ps(xs + 8 * q);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[q])); /* a max: the same value in any order */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4), d = fp16_round(amax / 127.f), inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(x[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_max_ps(lo, _mm256_min_ps(hi, v)); /* (v > 127 ? 127 : v), then (v < -127 ? -127 : v) */
        q[i] = _mm256_cvtps_epi32(v);
    }
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    uint16_t h = fp32_to_fp16(d);
    memcpy(out, &h, 2);
    _mm256_storeu_si256((__m256i *)(out + 2), p);
}

/* q4_codes for QG x eight blocks, one per lane: x[g][j] holds value j of each block of group g. Per lane the
 * operations and their order are q4_codes's (max_ps(0, c) is c < 0 ? 0 : c and min_ps(15, c) is c > 15 ? 15 : c,
 * NaN included). err[g] gets the squared errors, or (codes not NULL) codes[g] the codes: a code is a function of
 * (x, d) alone, so candidate scales are scored without storing theirs and the winner's are computed once. The QG
 * groups' sums are independent chains: one alone waits on its adds' latency. */
#define QG 2
FT_AVX2 static inline void q4_codes_avx2(__m256 (*x)[QK], const __m256 *d, __m256 *err, __m256 (*codes)[QK]) {
    const __m256 zero = _mm256_setzero_ps(), eight = _mm256_set1_ps(8.f), fifteen = _mm256_set1_ps(15.f);
    __m256 inv[QG], acc[QG];
    for (int g = 0; g < QG; g++) {
        inv[g] = _mm256_and_ps(_mm256_cmp_ps(d[g], zero, _CMP_NEQ_UQ), _mm256_div_ps(_mm256_set1_ps(1.f), d[g]));
        acc[g] = zero;
    }
    for (int j = 0; j < QK; j++)
        for (int g = 0; g < QG; g++) {
            __m256 c = _mm256_round_ps(_mm256_add_ps(_mm256_mul_ps(x[g][j], inv[g]), eight),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            c = _mm256_min_ps(fifteen, _mm256_max_ps(zero, c));
            if (codes) {
                codes[g][j] = c;
                continue;
            }
            __m256 e = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(c, eight), d[g]), x[g][j]);
            acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(e, e));
        }
    if (err)
        for (int g = 0; g < QG; g++) err[g] = acc[g];
}

FT_AVX2 static inline void transpose8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* quantize_block's q4 rule for the blocks xs[0 .. 8 QG - 1] (each QK values) into outs[0..n-1]. */
FT_AVX2 static void q4_group_avx2(float (*xs)[QK], int refine, uint8_t **outs, int n) {
    const __m256 zero = _mm256_setzero_ps(), eight = _mm256_set1_ps(8.f), sign = _mm256_set1_ps(-0.f);
    __m256 x[QG][QK], codes[QG][QK], d[QG];
    for (int g = 0; g < QG; g++) {
        for (int q = 0; q < QK / 8; q++) {
            for (int l = 0; l < 8; l++) x[g][8 * q + l] = _mm256_loadu_ps(xs[8 * g + l] + 8 * q);
            transpose8(x[g] + 8 * q);
        }
        __m256 m = zero, amax = _mm256_set1_ps(-1.f);
        for (int j = 0; j < QK; j++) { /* the first value of largest magnitude, as the scalar loop picks it */
            __m256 a = _mm256_andnot_ps(sign, x[g][j]), gt = _mm256_cmp_ps(a, amax, _CMP_GT_OQ);
            amax = _mm256_blendv_ps(amax, a, gt);
            m = _mm256_blendv_ps(m, x[g][j], gt);
        }
        d[g] = f16_round8(_mm256_div_ps(m, _mm256_set1_ps(-8.f)));
    }
    if (refine) {
        static const float f[5] = {0.80f, 0.84f, 0.88f, 0.92f, 0.96f};
        __m256 best[QG], err[QG], dc[QG];
        q4_codes_avx2(x, d, best, NULL);
        for (int i = 0; i < 5; i++) {
            for (int g = 0; g < QG; g++) dc[g] = f16_round8(_mm256_mul_ps(d[g], _mm256_set1_ps(f[i])));
            q4_codes_avx2(x, dc, err, NULL);
            for (int g = 0; g < QG; g++) {
                __m256 win = _mm256_cmp_ps(err[g], best[g], _CMP_LT_OQ);
                best[g] = _mm256_blendv_ps(best[g], err[g], win);
                d[g] = _mm256_blendv_ps(d[g], dc[g], win);
            }
        }
        q4_codes_avx2(x, d, NULL, codes);
        const __m256 tiny = _mm256_set1_ps(1e-30f);
        __m256 num[QG], den[QG], dl[QG];
        for (int g = 0; g < QG; g++) num[g] = den[g] = err[g] = zero;
        for (int j = 0; j < QK; j++)
            for (int g = 0; g < QG; g++) {
                __m256 c = _mm256_sub_ps(codes[g][j], eight);
                num[g] = _mm256_add_ps(num[g], _mm256_mul_ps(c, x[g][j]));
                den[g] = _mm256_add_ps(den[g], _mm256_mul_ps(c, c));
            }
        for (int g = 0; g < QG; g++) {
            __m256 q = _mm256_div_ps(num[g], _mm256_blendv_ps(tiny, den[g], _mm256_cmp_ps(den[g], tiny, _CMP_GT_OQ)));
            dl[g] = f16_round8(_mm256_blendv_ps(d[g], q, _mm256_cmp_ps(den[g], zero, _CMP_GT_OQ)));
        }
        for (int j = 0; j < QK; j++)
            for (int g = 0; g < QG; g++) {
                __m256 e = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(codes[g][j], eight), dl[g]), x[g][j]);
                err[g] = _mm256_add_ps(err[g], _mm256_mul_ps(e, e));
            }
        for (int g = 0; g < QG; g++) d[g] = _mm256_blendv_ps(d[g], dl[g], _mm256_cmp_ps(err[g], best[g], _CMP_LT_OQ));
    } else {
        q4_codes_avx2(x, d, NULL, codes);
    }
    for (int g = 0; g < QG && 8 * g < n; g++) {
        uint16_t h[8];
        int32_t packed[QK / 2][8];
        _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(d[g], _MM_FROUND_TO_NEAREST_INT)); /* already fp16: exact */
        for (int j = 0; j < QK / 2; j++)
            _mm256_storeu_si256((__m256i *)packed[j],
                                _mm256_or_si256(_mm256_cvtps_epi32(codes[g][j]),
                                                _mm256_slli_epi32(_mm256_cvtps_epi32(codes[g][j + QK / 2]), 4)));
        for (int l = 0; l < 8 && 8 * g + l < n; l++) {
            memcpy(outs[8 * g + l], &h[l], 2);
            for (int j = 0; j < QK / 2; j++) outs[8 * g + l][2 + j] = (uint8_t)packed[j][l];
        }
    }
}

FT_AVX2 static int quant_blocks_avx2(const quant_ctx *c, int64_t t0, int64_t t1, uint8_t *out) {
    const int64_t bb = c->fmt == FT_Q4 ? 18 : 34;
    float xs[8 * QG][QK];
    int bad = 0;
    if (c->fmt == FT_Q8) {
        for (int64_t t = t0; t < t1; t++) {
            bad |= quant_load_avx2(c, t, xs[0]);
            q8_block_avx2(xs[0], out + (t - t0) * bb);
        }
        return bad;
    }
    for (int64_t t = t0; t < t1; t += 8 * QG) {
        int n = t1 - t < 8 * QG ? (int)(t1 - t) : 8 * QG;
        uint8_t *outs[8 * QG];
        for (int l = 0; l < 8 * QG; l++) {
            if (l < n) {
                bad |= quant_load_avx2(c, t + l, xs[l]);
                outs[l] = out + (t + l - t0) * bb;
            } else {
                memset(xs[l], 0, sizeof xs[l]); /* an idle lane: quantized, never written */
            }
        }
        q4_group_avx2(xs, c->refine, outs, n);
    }
    return bad;
}
#endif

#endif
