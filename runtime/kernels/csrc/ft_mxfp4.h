/* GGUF MXFP4 (block_mxfp4: an E8M0 exponent byte e, then qs[16]: byte j holds value j in its low nibble, j + 16 in
 * its high one) in the 8-row tile layout, and its tile dot products, one per ISA path (included by ft_tiles.h, which
 * dispatches to them).
 *
 * Layout: per 32 values of K a tile-block holds the 8 rows' blocks field by field, so it is exactly 8 GGUF blocks
 * long (136 bytes) and the bytes are the file's:
 *   e[8] (row order) | 4 chunks of 32 bytes: chunk m holds qs bytes 4m..4m+3 of every row (row r at 4r)
 * One 32-bit lane of chunk m meets activation values 4m..4m+3 (low nibbles) and 16 + 4m.. (high nibbles).
 *
 * Values: kvalues[code] * 2^(e - 128), kvalues = the doubled e2m1 values {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12}
 * (ggml's E8M0_TO_FP32_HALF: exact for every e). The SIMD kernels look the codes up as unsigned u = kvalues + 12
 * (0..24, a vpshufb of the nibbles) and correct with the Q8_0 activations' s_a = d_a * sum(q_a):
 *   sum_v kv_v d_w d_a a_v = d_w (d_a sum(u a) - 12 s_a)
 */
#ifndef FT_MXFP4_H
#define FT_MXFP4_H

#define MX_TILE (TR * 17) /* tile bytes per 32 values */

static const int8_t MX_KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as ggml computes it (e < 2: a subnormal) */
static inline float mx_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The code (0..15) of value v (0..31) of row r in a tile-block. */
static inline int mx_code(const uint8_t *t, int r, int v) {
    const int j = v % 16;
    const uint8_t byte = t[TR + (j / 4) * 32 + 4 * r + j % 4];
    return v < 16 ? byte & 15 : byte >> 4;
}

static void tile_dot_mxfp4_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                             float *out) {
    (void)as;
    float acc[TR] = {0};
    for (int64_t b = 0; b < nb; b++, t += MX_TILE) {
        const int8_t *a = aq + b * QK;
        for (int r = 0; r < TR; r++) {
            int32_t sum = 0;
            for (int v = 0; v < QK; v++) sum += MX_KVALUES[mx_code(t, r, v)] * a[v];
            acc[r] += mx_scale(t[r]) * (ad[b] * (float)sum);
        }
    }
    for (int r = 0; r < TR; r++) out[r] = acc[r];
}

/* Rows [0, rows) of one tile's nb blocks to fp32, y[r * k + v] for v < k (the prefill path's dequantize): the
 * plain-torch dequantizer's values (quant/mxfp4.py) bit for bit (every product is exact). */
static void mx_dequant_tile(const uint8_t *t, int64_t nb, int rows, float *y, int64_t k) {
    for (int64_t b = 0; b < nb; b++, t += MX_TILE) {
        const int64_t len = b * QK + QK <= k ? QK : k - b * QK;
        for (int r = 0; r < rows; r++) {
            const float d = mx_scale(t[r]);
            float *o = y + r * k + b * QK;
            for (int v = 0; v < len; v++) o[v] = d * (float)MX_KVALUES[mx_code(t, r, v)];
        }
    }
}

#ifdef FT_X86
/* The 8 rows' 2^(e - 128) (mx_scale, vectorized). */
FT_AVX2 static inline __m256 mx_scales8(const uint8_t *t) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)t));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

#define MX_LUT _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, \
                                24, 12, 11, 10, 9, 8, 6, 4, 0)

/* Chunk m's looked-up codes u (0..24): LO for values 4m + p, HI for values 16 + 4m + p. */
#define MX_CODES(T, M, LO, HI)                                                                                    \
    do {                                                                                                          \
        const __m256i w_ = _mm256_loadu_si256((const __m256i *)((T) + TR + 32 * (M)));                            \
        LO = _mm256_shuffle_epi8(lut, _mm256_and_si256(w_, m4));                                                  \
        HI = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(w_, 4), m4));                            \
    } while (0)

/* One token. Two sums per block, of chunks 0, 2 and 1, 3 (VNNI: int32; AVX2: int16, each <= 4 * 2 * 24 * 127). */
#define MX_DOT(NAME, ATTR, VNNI)                                                                                  \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,       \
                          float *out) {                                                                           \
        __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();                                             \
        const __m256i m4 = _mm256_set1_epi8(0x0f), lut = MX_LUT, ones = _mm256_set1_epi16(1);                     \
        (void)ones;                                                                                               \
        for (int64_t b = 0; b < nb; b++, t += MX_TILE) {                                                          \
            const int8_t *a = aq + b * QK;                                                                        \
            __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                                      \
            for (int m = 0; m < 4; m++) {                                                                         \
                __m256i lo, hi;                                                                                   \
                MX_CODES(t, m, lo, hi);                                                                           \
                const __m256i xl = _mm256_set1_epi32(load_i32(a + 4 * m));                                        \
                const __m256i xh = _mm256_set1_epi32(load_i32(a + 16 + 4 * m));                                   \
                s[m & 1] = VNNI ? _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s[m & 1], lo, xl), hi, xh)              \
                                : _mm256_add_epi16(_mm256_add_epi16(s[m & 1], _mm256_maddubs_epi16(lo, xl)),      \
                                                   _mm256_maddubs_epi16(hi, xh));                                 \
            }                                                                                                     \
            const __m256i sum = VNNI ? _mm256_add_epi32(s[0], s[1])                                               \
                                     : _mm256_add_epi32(_mm256_madd_epi16(s[0], ones), _mm256_madd_epi16(s[1], ones)); \
            const __m256 dw = mx_scales8(t);                                                                      \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(ad[b])), acc);        \
            corr = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[b]), corr);                                              \
        }                                                                                                         \
        _mm256_storeu_ps(out, _mm256_fnmadd_ps(_mm256_set1_ps(12.f), corr, acc));                                 \
    }

/* Four tokens: each chunk looked up once and met by the four activation rows. */
#define MX_DOT4(NAME, ATTR, VNNI)                                                                                 \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *const *aq, const float *const *ad,          \
                          const float *const *as, float *const *out) {                                            \
        __m256 acc[4], corr[4];                                                                                   \
        for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();                                       \
        const __m256i m4 = _mm256_set1_epi8(0x0f), lut = MX_LUT, ones = _mm256_set1_epi16(1);                     \
        (void)ones;                                                                                               \
        for (int64_t b = 0; b < nb; b++, t += MX_TILE) {                                                          \
            __m256i s[4][2];                                                                                      \
            for (int i = 0; i < 4; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();                              \
            for (int m = 0; m < 4; m++) {                                                                         \
                __m256i lo, hi;                                                                                   \
                MX_CODES(t, m, lo, hi);                                                                           \
                for (int i = 0; i < 4; i++) {                                                                     \
                    const int8_t *a = aq[i] + b * QK + 4 * m;                                                     \
                    const __m256i xl = _mm256_set1_epi32(load_i32(a)), xh = _mm256_set1_epi32(load_i32(a + 16));  \
                    s[i][m & 1] = VNNI ? _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s[i][m & 1], lo, xl), hi, xh)    \
                                       : _mm256_add_epi16(_mm256_add_epi16(s[i][m & 1], _mm256_maddubs_epi16(lo, xl)), \
                                                          _mm256_maddubs_epi16(hi, xh));                          \
                }                                                                                                 \
            }                                                                                                     \
            const __m256 dw = mx_scales8(t);                                                                      \
            for (int i = 0; i < 4; i++) {                                                                         \
                const __m256i sum = VNNI ? _mm256_add_epi32(s[i][0], s[i][1])                                     \
                                         : _mm256_add_epi32(_mm256_madd_epi16(s[i][0], ones),                     \
                                                            _mm256_madd_epi16(s[i][1], ones));                    \
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(ad[i][b]));                                 \
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[i]);                                 \
                corr[i] = _mm256_fmadd_ps(dw, _mm256_set1_ps(as[i][b]), corr[i]);                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < 4; i++)                                                                               \
            _mm256_storeu_ps(out[i], _mm256_fnmadd_ps(_mm256_set1_ps(12.f), corr[i], acc[i]));                    \
    }

MX_DOT(tile_dot_mxfp4_avx2, FT_AVX2, 0)
MX_DOT(tile_dot_mxfp4_vnni, FT_VNNI, 1)
MX_DOT4(tile_dot4_mxfp4_avx2, FT_AVX2, 0)
MX_DOT4(tile_dot4_mxfp4_vnni, FT_VNNI, 1)
#endif

#endif
