/* The repacked weight layout and the 8-row tile dot products, one per ISA path.
 *
 * Layout ("tiles"): rows are grouped 8 at a time (N padded to a multiple of 8 with zero rows). A tile is nb
 * tile-blocks, one per 32-value block of K. A tile-block is
 *   fp16 scales[8]                                         (16 bytes, row order)
 *   then chunks of 32 bytes, each holding 4 bytes of every row (row r at bytes 4r..4r+3):
 *     q8: 8 chunks; chunk j byte p of row r = int8 code of value 4j + p                      (272 bytes in all)
 *     q4: 4 chunks; chunk j byte p of row r = code(8j + p) | code(8j + 4 + p) << 4, codes 0..15 (144 bytes)
 * So 8 rows stream from one contiguous range, and one 32-bit lane of a chunk meets 4 consecutive activation
 * values: a dot-product instruction (pmaddubsw+pmaddwd, or vpdpbusd) with the activation's 4 bytes broadcast
 * computes 8 rows at once, with no horizontal reductions.
 *
 * Activations are int8 per 32-block with scale d_a and s_a = d_a * sum(q_a). Codes are used unsigned, so
 *   q4: sum d_w (c - 8) d_a a = d_w d_a sum(c a) - 8 d_w s_a;  q8 on VNNI (c ^ 0x80 = c + 128 unsigned):
 *   sum d_w c d_a a = d_w d_a sum((c + 128) a) - 128 d_w s_a.
 */
#ifndef FT_TILES_H
#define FT_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_X86 1
#endif

enum { FT_Q8 = 0, FT_Q4 = 1, FT_Q4K = 2, FT_Q6K = 3, FT_Q5K = 4, FT_MXFP4 = 5 }; /* ft_kquant.h, ft_mxfp4.h */
enum { FT_ISA_PORTABLE = 0, FT_ISA_AVX2 = 1, FT_ISA_AVX512VNNI = 2, FT_ISA_AMX = 3 };

#define QK 32
#define TR 8

/* Tile bytes per 32 values of K (a K-quant tile's super-block of 256 values is 8 of these). */
static inline int64_t tile_block_bytes(int fmt) {
    switch (fmt) {
    case FT_Q8: return 2 * TR + TR * 32;
    case FT_Q6K: return TR * 210 / 8;
    case FT_Q5K: return TR * 176 / 8;
    case FT_MXFP4: return TR * 17;
    default: return 2 * TR + TR * 16; /* q4_0, and q4_k (144 bytes per 256 values) */
    }
}

static inline int fmt_is_kquant(int fmt) { return fmt == FT_Q4K || fmt == FT_Q5K || fmt == FT_Q6K; }

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

/* Value `v` (0..31) of row `r` in a tile-block: the code as stored (q4: 0..15 unsigned; q8: signed). */
static inline int tile_code(int fmt, const uint8_t *tb, int r, int v) {
    if (fmt == FT_Q8) return (int8_t)tb[2 * TR + (v / 4) * 32 + r * 4 + v % 4];
    int j = v / 8, p = v % 8;
    uint8_t byte = tb[2 * TR + j * 32 + r * 4 + p % 4];
    return p < 4 ? (byte & 0x0f) : (byte >> 4);
}

static inline float tile_scale(const uint8_t *tb, int r) {
    uint16_t h;
    memcpy(&h, tb + 2 * r, 2);
    return fp16_to_fp32(h);
}

/* out[r] = dot(row r of the tile, activation row), r = 0..7 */
typedef void (*tile_dot_fn)(const uint8_t *tile, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                            float *out);

#define FT_DEFINE_PORTABLE(NAME, FMT)                                                                          \
    static void NAME(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,         \
                     float *out) {                                                                             \
        float acc[TR] = {0};                                                                                   \
        for (int64_t b = 0; b < nb; b++, t += tile_block_bytes(FMT)) {                                         \
            const int8_t *a = aq + b * QK;                                                                     \
            for (int r = 0; r < TR; r++) {                                                                     \
                int32_t s = 0;                                                                                 \
                for (int v = 0; v < QK; v++) s += tile_code(FMT, t, r, v) * a[v];                              \
                float dw = tile_scale(t, r);                                                                   \
                acc[r] += (FMT) == FT_Q4 ? dw * (ad[b] * (float)s - 8.f * as[b]) : dw * ad[b] * (float)s;      \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < TR; r++) out[r] = acc[r];                                                          \
    }

FT_DEFINE_PORTABLE(tile_dot_q8_c, FT_Q8)
FT_DEFINE_PORTABLE(tile_dot_q4_c, FT_Q4)

#ifdef FT_X86
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define FT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FT_VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))

/* exp(x) by range reduction and a degree-6 polynomial, one body for 8 and 16 lanes (P: the intrinsics' prefix,
 * ROUND: round to nearest, CASTI: integer bits as floats), so the 512-bit form runs the same operations lane by lane:
 * the same bits */
#define FT_EXPV(NAME, ATTR, V, VI, P, ROUND, CASTI)                                                                  \
    ATTR static inline V NAME(V x) {                                                                                  \
        x = P##_max_ps(x, P##_set1_ps(-87.3f)); /* below: 0 (exp underflows anyway) */                                \
        x = P##_min_ps(x, P##_set1_ps(88.3f));                                                                        \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));                                          \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                         \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                                        \
        V p = P##_set1_ps(1.9875691500E-4f);                                                                          \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507E-3f));                                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073E-3f));                                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894E-2f));                                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459E-1f));                                                        \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201E-1f));                                                        \
        p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.f)));                                       \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                      \
        return P##_mul_ps(p, CASTI(e));                                                                               \
    }
#define FT_ROUND256(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
FT_EXPV(exp256, FT_AVX2, __m256, __m256i, _mm256, FT_ROUND256, _mm256_castsi256_ps)
#define FT_ROUND512(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
FT_EXPV(exp512, FT_VNNI, __m512, __m512i, _mm512, FT_ROUND512, _mm512_castsi512_ps)

/* A one-token tile kernel asks for the weight bytes FT_TILE_AHEAD ahead of the block it reads (every 64-byte line
 * of a block's span): at M = 1 the kernels stream weights and little else, the L2 streamer does not cross 4 KiB
 * pages, and an item's tiles are only a few KiB. Measured on the AMX Xeon (2 threads, a 7.5B model's decode MoE
 * step, 24 layers of Q4_0 experts, 64 of top-8): 18.2 -> 23.5 GB/s; 1-3 KiB ahead all do about as well, 4 KiB and
 * more less. Prefetches never fault, so reading past a buffer's end is harmless. */
#ifndef FT_TILE_AHEAD
#define FT_TILE_AHEAD 2048
#endif
#define FT_PREFETCH_AHEAD(p, bytes)                                                                               \
    for (int pf_ = 0; pf_ < (bytes); pf_ += 64) _mm_prefetch((const char *)(p) + FT_TILE_AHEAD + pf_, _MM_HINT_T0)
FT_AVX2 static void tile_dot_q8_avx2(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                     const float *as, float *out) {
    (void)as;
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 16 + 256) {
        const int8_t *a = aq + b * QK;
        FT_PREFETCH_AHEAD(t, 16 + 256);
        __m256i s = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i x = _mm256_set1_epi32(load_i32(a + 4 * j));
            const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(ad[b])), acc);
    }
    _mm256_storeu_ps(out, acc);
}

FT_AVX2 static void tile_dot_q4_avx2(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                     const float *as, float *out) {
    __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 16 + 128) {
        const int8_t *a = aq + b * QK;
        FT_PREFETCH_AHEAD(t, 16 + 128);
        __m256i s16 = _mm256_setzero_si256(); /* per lane <= 8 * 2 * 15 * 127 = 30480: no int16 overflow */
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(c, m4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a + 8 * j))));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 8 * j + 4))));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc = _mm256_fmadd_ps(s, _mm256_mul_ps(dw, _mm256_set1_ps(ad[b])), acc);
        corr = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[b]), corr);
    }
    _mm256_storeu_ps(out, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), corr, acc));
}

FT_VNNI static void tile_dot_q8_vnni(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                     const float *as, float *out) {
    /* four independent vpdpbusd chains of two: a chain of four (latency ~5 cycles each) bound the loop */
    __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, t += 16 + 256) {
        const int8_t *a = aq + b * QK;
        FT_PREFETCH_AHEAD(t, 16 + 256);
        __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
        for (int j = 0; j < 8; j++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j)), flip);
            s[j & 3] = _mm256_dpbusd_epi32(s[j & 3], w, _mm256_set1_epi32(load_i32(a + 4 * j)));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 sum = _mm256_cvtepi32_ps(
            _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])));
        acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(ad[b])), acc);
        corr = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[b]), corr);
    }
    _mm256_storeu_ps(out, _mm256_fnmadd_ps(_mm256_set1_ps(128.f), corr, acc));
}

FT_VNNI static void tile_dot_q4_vnni(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                     const float *as, float *out) {
    __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, t += 16 + 128) {
        const int8_t *a = aq + b * QK;
        FT_PREFETCH_AHEAD(t, 16 + 128);
        __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
        for (int j = 0; j < 4; j++) { /* four chains of two, as in the q8 kernel */
            const __m256i c = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(c, m4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
            s[2 * (j & 1)] = _mm256_dpbusd_epi32(s[2 * (j & 1)], lo, _mm256_set1_epi32(load_i32(a + 8 * j)));
            s[2 * (j & 1) + 1] = _mm256_dpbusd_epi32(s[2 * (j & 1) + 1], hi, _mm256_set1_epi32(load_i32(a + 8 * j + 4)));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 sum = _mm256_cvtepi32_ps(
            _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])));
        acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(ad[b])), acc);
        corr = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[b]), corr);
    }
    _mm256_storeu_ps(out, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), corr, acc));
}

/* Four tokens against one tile at once: the weight chunk is unpacked once and meets four activation rows, so
 * M > 1 (prefill, several tokens on one expert) costs less than four single-token passes. out[i][r] as in
 * tile_dot; token i's quantized row is aq[i] / ad[i] / as[i]. */
typedef void (*tile_dot4_fn)(const uint8_t *tile, int64_t nb, const int8_t *const *aq, const float *const *ad,
                             const float *const *as, float *const *out);

#define FT_DOT4_EPILOGUE(ZERO)                                                                                 \
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[i], _mm256_fnmadd_ps(_mm256_set1_ps(ZERO), corr[i], acc[i]));

FT_VNNI static void tile_dot4_q4_vnni(const uint8_t *t, int64_t nb, const int8_t *const *aq,
                                      const float *const *ad, const float *const *as, float *const *out) {
    __m256 acc[4], corr[4];
    for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, t += 16 + 128) {
        __m256i s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(c, m4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
            for (int i = 0; i < 4; i++) {
                const int8_t *a = aq[i] + b * QK + 8 * j;
                s[i] = _mm256_dpbusd_epi32(s[i], lo, _mm256_set1_epi32(load_i32(a)));
                s[i] = _mm256_dpbusd_epi32(s[i], hi, _mm256_set1_epi32(load_i32(a + 4)));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int i = 0; i < 4; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dw, _mm256_set1_ps(ad[i][b])), acc[i]);
            corr[i] = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[i][b]), corr[i]);
        }
    }
    FT_DOT4_EPILOGUE(8.f)
}

FT_VNNI static void tile_dot4_q8_vnni(const uint8_t *t, int64_t nb, const int8_t *const *aq,
                                      const float *const *ad, const float *const *as, float *const *out) {
    __m256 acc[4], corr[4];
    for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, t += 16 + 256) {
        __m256i s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j)), flip);
            for (int i = 0; i < 4; i++)
                s[i] = _mm256_dpbusd_epi32(s[i], w, _mm256_set1_epi32(load_i32(aq[i] + b * QK + 4 * j)));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int i = 0; i < 4; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dw, _mm256_set1_ps(ad[i][b])), acc[i]);
            corr[i] = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[i][b]), corr[i]);
        }
    }
    FT_DOT4_EPILOGUE(128.f)
}

FT_AVX2 static void tile_dot4_q4_avx2(const uint8_t *t, int64_t nb, const int8_t *const *aq,
                                      const float *const *ad, const float *const *as, float *const *out) {
    __m256 acc[4], corr[4];
    for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 16 + 128) {
        __m256i s16[4];
        for (int i = 0; i < 4; i++) s16[i] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(c, m4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
            for (int i = 0; i < 4; i++) {
                const int8_t *a = aq[i] + b * QK + 8 * j;
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a))));
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 4))));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int i = 0; i < 4; i++) {
            const __m256 sf = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
            acc[i] = _mm256_fmadd_ps(sf, _mm256_mul_ps(dw, _mm256_set1_ps(ad[i][b])), acc[i]);
            corr[i] = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[i][b]), corr[i]);
        }
    }
    FT_DOT4_EPILOGUE(8.f)
}

FT_AVX2 static void tile_dot4_q8_avx2(const uint8_t *t, int64_t nb, const int8_t *const *aq,
                                      const float *const *ad, const float *const *as, float *const *out) {
    (void)as;
    __m256 acc[4], corr[4];
    for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += 16 + 256) {
        __m256i s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 16 + 32 * j));
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int i = 0; i < 4; i++) {
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(aq[i] + b * QK + 4 * j)), w);
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        for (int i = 0; i < 4; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dw, _mm256_set1_ps(ad[i][b])), acc[i]);
    }
    FT_DOT4_EPILOGUE(0.f)
}

/* One row of one tile-block to 32 fp32 values (the prefill path's dequantize). */
FT_AVX2 static void tile_row_dequant_avx2(int fmt, const uint8_t *tb, int r, float *out) {
    const uint8_t *q = tb + 2 * TR + 4 * r;
    const float d = tile_scale(tb, r);
    const __m256 dd = _mm256_set1_ps(d);
    __m128i v[2];
    __m256 off = _mm256_setzero_ps();
    if (fmt == FT_Q4) {
        const __m128i raw = _mm_set_epi32(load_i32((const int8_t *)q + 96), load_i32((const int8_t *)q + 64),
                                          load_i32((const int8_t *)q + 32), load_i32((const int8_t *)q));
        const __m128i m4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        v[0] = _mm_unpacklo_epi32(lo, hi); /* values 0..15 */
        v[1] = _mm_unpackhi_epi32(lo, hi); /* values 16..31 */
        off = _mm256_set1_ps(-8.f * d);
        for (int h = 0; h < 2; h++) {
            const __m128i part[2] = {v[h], _mm_srli_si128(v[h], 8)};
            for (int i = 0; i < 2; i++)
                _mm256_storeu_ps(out + 16 * h + 8 * i,
                                 _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i])), dd, off));
        }
    } else {
        for (int j = 0; j < 8; j += 2) {
            const __m128i two = _mm_set_epi32(0, 0, load_i32((const int8_t *)q + 32 * j + 32),
                                              load_i32((const int8_t *)q + 32 * j));
            _mm256_storeu_ps(out + 4 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(two)), dd));
        }
    }
}
#endif

#include "ft_kquant.h"
#include "ft_mxfp4.h"

/* AMX intrinsics need GCC 11 or clang 12; an older compiler builds everything else (the ISA stays AVX-512 VNNI) */
#if defined(FT_X86) && defined(__linux__) &&                                                                      \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FT_HAVE_AMX 1 /* ft_amx.h */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX-TILE and AMX-INT8 in cpuid, and Linux grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA; asked once, a no-op when granted already). */
static int amx_supported(void) {
    static int cached = -1;
    if (cached >= 0) return cached;
    unsigned a, b, c, d;
    cached = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1) && ((d >> 25) & 1) &&
             syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return cached;
}
#endif

static int detect_isa(void) {
#ifdef FT_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw")) {
#ifdef FT_HAVE_AMX
        if (__builtin_cpu_supports("avx512f") && amx_supported()) return FT_ISA_AMX;
#endif
        return FT_ISA_AVX512VNNI;
    }
    if (avx2) return FT_ISA_AVX2;
#endif
    return FT_ISA_PORTABLE;
}

static int g_isa = -1;

static tile_dot_fn pick_tile_dot(int fmt) {
    if (g_isa < 0) g_isa = detect_isa();
    /* by format code: FT_Q8, FT_Q4, FT_Q4K, FT_Q6K, FT_Q5K, FT_MXFP4 */
    static const tile_dot_fn portable[] = {tile_dot_q8_c, tile_dot_q4_c, tile_dot_q4k_c, tile_dot_q6k_c,
                                           tile_dot_q5k_c, tile_dot_mxfp4_c};
#ifdef FT_X86
    static const tile_dot_fn avx2[] = {tile_dot_q8_avx2, tile_dot_q4_avx2, tile_dot_q4k_avx2, tile_dot_q6k_avx2,
                                       tile_dot_q5k_avx2, tile_dot_mxfp4_avx2};
    static const tile_dot_fn vnni[] = {tile_dot_q8_vnni, tile_dot_q4_vnni, tile_dot_q4k_vnni, tile_dot_q6k_vnni,
                                       tile_dot_q5k_vnni, tile_dot_mxfp4_vnni};
    if (g_isa >= FT_ISA_AVX512VNNI) return vnni[fmt];
    if (g_isa == FT_ISA_AVX2) return avx2[fmt];
#endif
    return portable[fmt];
}

/* The 4-token variant, or NULL on the portable path (callers then loop the 1-token kernel). */
static tile_dot4_fn pick_tile_dot4(int fmt) {
    if (g_isa < 0) g_isa = detect_isa();
#ifdef FT_X86
    static const tile_dot4_fn avx2[] = {tile_dot4_q8_avx2, tile_dot4_q4_avx2, tile_dot4_q4k_avx2, tile_dot4_q6k_avx2,
                                        tile_dot4_q5k_avx2, tile_dot4_mxfp4_avx2};
    static const tile_dot4_fn vnni[] = {tile_dot4_q8_vnni, tile_dot4_q4_vnni, tile_dot4_q4k_vnni, tile_dot4_q6k_vnni,
                                        tile_dot4_q5k_vnni, tile_dot4_mxfp4_vnni};
    if (g_isa >= FT_ISA_AVX512VNNI) return vnni[fmt];
    if (g_isa == FT_ISA_AVX2) return avx2[fmt];
#endif
    (void)fmt;
    return NULL;
}

#endif
