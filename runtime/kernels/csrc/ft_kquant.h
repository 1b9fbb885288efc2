/* GGUF K-quants (Q4_K, Q5_K, Q6_K) in the 8-row tile layout, and their tile dot products, one per ISA path
 * (included by ft_tiles.h, which dispatches to them).
 *
 * Layout: a tile is 8 rows; per 256-value super-block it holds the 8 rows' GGUF blocks (block_q4_K: d, dmin,
 * scales[12], qs[128]; block_q5_K: d, dmin, scales[12], qh[32], qs[128]; block_q6_K: ql[128], qh[64], scales[16],
 * d) with the bytes of each field interleaved by row, so the tile super-block is exactly 8 GGUF blocks long (1152 /
 * 1408 / 1680 bytes) and the bytes are the file's. A "chunk" of a code field holds 4 bytes of every row (row r at
 * 4r): chunk m = the field's bytes 4m..4m+3.
 *   q4_k: fp16 d[8] | fp16 dmin[8] | scales: byte i of row r at 8i + r (12 x 8) | qs: chunks 0..31 in order
 *                                                                                                      (1152 bytes)
 *   q5_k: q4_k's d, dmin, scales | 8 groups q = 0..7 of five chunks: qh chunk q, qs chunks q, 8 + q, 16 + q, 24 + q
 *                                                                                                      (1408 bytes)
 *   q6_k: fp16 d[8] | scales: int8 i of row r at 8i + r (16 x 8) | 16 groups g = 8n + q (n = 0..1, q = 0..7) of
 *         three chunks: ql chunk 16n + q, ql chunk 16n + 8 + q, qh chunk 8n + q                          (1680 bytes)
 * so each kernel reads its super-block front to back (q6_k's three code streams one after another in separate
 * regions streamed from RAM at a third of the speed: the prefetchers lost them). One 32-bit lane of a chunk meets
 * 4 consecutive activation values, as in the Q4_0 tiles: a dot-product instruction with the activation's 4 bytes
 * broadcast computes 8 rows at once.
 *
 * Activations are the Q8_0 kernels' own (int8 per 32 values, scale d_a, s_a = d_a * sum(q_a)), so one quantized
 * activation row serves every format, and each 32-value block keeps its own scale (finer than ggml's Q8_K, one scale
 * per 256). Per 32-block b of the weight row:
 *   q4_k, q5_k (sub-block j = b mod 8): sum (d sc_j q - dmin m_j) d_a a = d sc_j d_a sum(q a) - dmin m_j s_a
 *   q6_k (16-value halves h with scales sc_h): sum d sc_h (q - 32) d_a a = d sc_h d_a (sum_h(q a) - 32 sum_h(a))
 * Codes are used unsigned (q4: 0..15, q5: 0..31, q6: 0..63), the activation signed. A q5_k code is its qs nibble
 * plus 16 times bit j of its qh byte (sub-block j): group q's qh chunk serves the four qs chunks after it.
 */
#ifndef FT_KQUANT_H
#define FT_KQUANT_H

#define QKK 256                              /* values per super-block */
#define KQ_TILE_Q4K (TR * 144)               /* tile bytes per super-block */
#define KQ_TILE_Q6K (TR * 210)
#define KQ_TILE_Q5K (TR * 176)
#define KQ_Q5K_BODY (4 * TR + 12 * TR)       /* where a q5_k tile super-block's code groups start */
#define KQ_Q5K_GROUP (5 * 4 * TR)            /* bytes per group: one qh chunk and four qs chunks */
#define KQ_Q6K_BODY (2 * TR + 16 * TR)       /* where a q6_k tile super-block's code groups start */
#define KQ_Q6K_GROUP (3 * 4 * TR)            /* bytes per group: two ql chunks and one qh chunk */

/* Row r of a q4_k / q5_k tile super-block's sub-block scales: dsc[8] = d * sc_j, dm[8] = dmin * m_j. */
static void q4k_row_scales(const uint8_t *t, int r, float *dsc, float *dm) {
    const float d = tile_scale(t, r), dmin = tile_scale(t + 2 * TR, r);
    uint8_t s[12];
    for (int i = 0; i < 12; i++) s[i] = t[4 * TR + TR * i + r];
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        dsc[j] = d * (float)sc;
        dm[j] = dmin * (float)m;
    }
}

/* Row r of a q4_k tile super-block: codes[256] (0..15), dsc[8] = d * sc_j, dm[8] = dmin * m_j. */
static void q4k_row(const uint8_t *t, int r, uint8_t *codes, float *dsc, float *dm) {
    q4k_row_scales(t, r, dsc, dm);
    const uint8_t *qs = t + 16 * TR + 4 * r;
    for (int x = 0; x < 128; x++) {
        const uint8_t byte = qs[(x / 4) * 4 * TR + x % 4];
        const int c = x / 32, l = x % 32; /* qs byte 32c + l: value 64c + l (low nibble), 64c + 32 + l (high) */
        codes[64 * c + l] = byte & 15;
        codes[64 * c + 32 + l] = byte >> 4;
    }
}

/* Row r of a q5_k tile super-block: codes[256] (0..31), dsc[8], dm[8] as q4k_row's. */
static void q5k_row(const uint8_t *t, int r, uint8_t *codes, float *dsc, float *dm) {
    q4k_row_scales(t, r, dsc, dm);
    const uint8_t *body = t + KQ_Q5K_BODY + 4 * r;
    for (int v = 0; v < QKK; v++) {
        /* value 32j + l: qs byte 32c + l (c = j / 2; chunk 8c + l / 4) and qh byte l (chunk l / 4), in group l / 4 */
        const int j = v / 32, l = v % 32;
        const uint8_t *g = body + (l / 4) * KQ_Q5K_GROUP + l % 4;
        const uint8_t qs = g[(1 + j / 2) * 4 * TR], qh = g[0];
        codes[v] = (uint8_t)(((j & 1) ? qs >> 4 : qs & 15) | (((qh >> j) & 1) << 4));
    }
}

/* Row r of a q6_k tile super-block: codes[256] (q - 32, -32..31), dsc[16] = d * sc_i. */
static void q6k_row(const uint8_t *t, int r, int8_t *codes, float *dsc) {
    const float d = tile_scale(t, r);
    for (int i = 0; i < 16; i++) dsc[i] = d * (float)(int8_t)t[2 * TR + TR * i + r];
    const uint8_t *body = t + KQ_Q6K_BODY + 4 * r;
    for (int v = 0; v < QKK; v++) {
        /* ql byte 64n + 32(k & 1) + l and qh byte 32n + l, both in group 8n + l / 4 */
        const int n = v / 128, k = (v % 128) / 32, l = v % 32;
        const uint8_t *g = body + (8 * n + l / 4) * KQ_Q6K_GROUP + l % 4;
        const uint8_t lb = g[(k & 1) * 4 * TR], hb = g[2 * 4 * TR];
        const int lo = k < 2 ? lb & 15 : lb >> 4, hi = (hb >> (2 * k)) & 3;
        codes[v] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* q4_k and q5_k: the same sums over their own codes */
static void kq_asym_dot_c(int fmt, const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                          float *out) {
    float acc[TR] = {0}, dsc[8], dm[8];
    uint8_t codes[QKK];
    for (int64_t s = 0; s < nb / 8; s++, t += fmt == FT_Q4K ? KQ_TILE_Q4K : KQ_TILE_Q5K)
        for (int r = 0; r < TR; r++) {
            if (fmt == FT_Q4K) q4k_row(t, r, codes, dsc, dm);
            else q5k_row(t, r, codes, dsc, dm);
            for (int j = 0; j < 8; j++) {
                const int64_t b = 8 * s + j;
                const int8_t *a = aq + b * QK;
                int32_t sum = 0;
                for (int v = 0; v < QK; v++) sum += codes[32 * j + v] * a[v];
                acc[r] += dsc[j] * (ad[b] * (float)sum) - dm[j] * as[b];
            }
        }
    for (int r = 0; r < TR; r++) out[r] = acc[r];
}

static void tile_dot_q4k_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                           float *out) {
    kq_asym_dot_c(FT_Q4K, t, nb, aq, ad, as, out);
}

static void tile_dot_q5k_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                           float *out) {
    kq_asym_dot_c(FT_Q5K, t, nb, aq, ad, as, out);
}

static void tile_dot_q6k_c(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,
                           float *out) {
    (void)as;
    float acc[TR] = {0}, dsc[16];
    int8_t codes[QKK];
    for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q6K)
        for (int r = 0; r < TR; r++) {
            q6k_row(t, r, codes, dsc);
            for (int i = 0; i < 16; i++) {
                const int64_t b = 8 * s + i / 2;
                const int8_t *a = aq + 8 * s * QK + 16 * i;
                int32_t sum = 0;
                for (int v = 0; v < 16; v++) sum += codes[16 * i + v] * a[v];
                acc[r] += dsc[i] * (ad[b] * (float)sum);
            }
        }
    for (int r = 0; r < TR; r++) out[r] = acc[r];
}

/* Rows [0, rows) of one tile's ns super-blocks to fp32: y[r * k + v] (the prefill path's dequantize). The values
 * are the plain-torch dequantizers' (quant/q4k.py, q5k.py, q6k.py) bit for bit: the same products in the same order. */
static void kq_dequant_tile(int fmt, const uint8_t *t, int64_t ns, int rows, float *y, int64_t k) {
    float dsc[16], dm[8];
    uint8_t c4[QKK];
    int8_t c6[QKK];
    for (int64_t s = 0; s < ns; s++, t += tile_block_bytes(fmt) * 8)
        for (int r = 0; r < rows; r++) {
            float *o = y + r * k + s * QKK;
            if (fmt == FT_Q6K) {
                q6k_row(t, r, c6, dsc);
                for (int v = 0; v < QKK; v++) o[v] = dsc[v / 16] * (float)c6[v];
                continue;
            }
            if (fmt == FT_Q4K) q4k_row(t, r, c4, dsc, dm);
            else q5k_row(t, r, c4, dsc, dm);
            for (int v = 0; v < QKK; v++) o[v] = dsc[v / 32] * (float)c4[v] - dm[v / 32];
        }
}

#ifdef FT_X86
/* The 8 rows' byte i of a tile field laid out as 8 x bytes (scales): zero- or sign-extended to int32 lanes. */
#define KQ_U8X8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define KQ_I8X8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))

/* q4_k sub-block j's 6-bit scale and min for the 8 rows, times d and dmin. */
FT_AVX2 static inline void q4k_scales8(const uint8_t *t, int j, __m256 d, __m256 dmin, __m256 *dsc, __m256 *dm) {
    const uint8_t *s = t + 4 * TR;
    const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15);
    __m256i sc, m;
    if (j < 4) {
        sc = _mm256_and_si256(KQ_U8X8(s + TR * j), m6);
        m = _mm256_and_si256(KQ_U8X8(s + TR * (j + 4)), m6);
    } else {
        const __m256i b = KQ_U8X8(s + TR * (j + 4));
        sc = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi32(_mm256_srli_epi32(KQ_U8X8(s + TR * (j - 4)), 6), 4));
        m = _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_slli_epi32(_mm256_srli_epi32(KQ_U8X8(s + TR * j), 6), 4));
    }
    *dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    *dm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
}

/* sum of the 16 int8 activations of each half of the super-block's eight 32-blocks: h[2b + half] */
FT_AVX2 static inline void kq_half_sums(const int8_t *a, int32_t *h) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    for (int b = 0; b < 8; b++) { /* (a + 128) summed as unsigned bytes 8 at a time, then 16 * 128 off */
        const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + 32 * b)), flip),
                                            zero);
        const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
        h[2 * b] = _mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 2) - 2048;
        h[2 * b + 1] = _mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 2) - 2048;
    }
}

/* The four q6_k codes vectors (k = 0..3: values 128n + 32k + 4q + p) of chunk q in half n: 0..63 unsigned. */
#define KQ_Q6_CODES(T, N, Q, C)                                                                                   \
    do {                                                                                                          \
        const uint8_t *g_ = (T) + KQ_Q6K_BODY + (8 * (N) + (Q)) * KQ_Q6K_GROUP;                                  \
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)g_);                                              \
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(g_ + 32));                                       \
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(g_ + 64));                                        \
        C[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));      \
        C[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));      \
        C[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));      \
        C[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),                                   \
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));                                   \
    } while (0)

FT_AVX2 static void tile_dot_q4k_avx2(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                      const float *as, float *out) {
    __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q4K) {
        const int8_t *a = aq + s * QKK;
        const float *da = ad + 8 * s, *sa = as + 8 * s;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR)));
        for (int c = 0; c < 4; c++) {
            __m256i lo16 = _mm256_setzero_si256(), hi16 = _mm256_setzero_si256(); /* <= 8 * 2 * 15 * 127 */
            for (int q = 0; q < 8; q++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 16 * TR + (8 * c + q) * 32));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                lo16 = _mm256_add_epi16(lo16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a + 64 * c + 4 * q))));
                hi16 = _mm256_add_epi16(hi16,
                                        _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 64 * c + 32 + 4 * q))));
            }
            __m256 dsc, dm;
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                q4k_scales8(t, j, d, dmin, &dsc, &dm);
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(h ? hi16 : lo16, ones));
                acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(dsc, _mm256_set1_ps(da[j])), acc);
                corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(sa[j]), corr);
            }
        }
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, corr));
}

FT_VNNI static void tile_dot_q4k_vnni(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                      const float *as, float *out) {
    __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q4K) {
        const int8_t *a = aq + s * QKK;
        const float *da = ad + 8 * s, *sa = as + 8 * s;
        FT_PREFETCH_AHEAD(t, KQ_TILE_Q4K);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR)));
        for (int c = 0; c < 4; c++) {
            __m256i sm[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                             _mm256_setzero_si256()}; /* low/high nibbles, even/odd chunks: four short chains */
            for (int q = 0; q < 8; q++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 16 * TR + (8 * c + q) * 32));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                sm[q & 1] = _mm256_dpbusd_epi32(sm[q & 1], lo, _mm256_set1_epi32(load_i32(a + 64 * c + 4 * q)));
                sm[2 + (q & 1)] =
                    _mm256_dpbusd_epi32(sm[2 + (q & 1)], hi, _mm256_set1_epi32(load_i32(a + 64 * c + 32 + 4 * q)));
            }
            __m256 dsc, dm;
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                q4k_scales8(t, j, d, dmin, &dsc, &dm);
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(sm[2 * h], sm[2 * h + 1]));
                acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(dsc, _mm256_set1_ps(da[j])), acc);
                corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(sa[j]), corr);
            }
        }
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, corr));
}

/* acc += (isum - 32 * half_sum) * d * sc_i * d_a for the four 32-blocks of half n, 16-value half h */
#define KQ_Q6_FINISH(S)                                                                                           \
    for (int k = 0; k < 4; k++) {                                                                                 \
        const int blk = 4 * n + k, i = 2 * blk + h;                                                               \
        const __m256i isum = _mm256_sub_epi32(S[k], _mm256_set1_epi32(32 * hs[i]));                              \
        const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(KQ_I8X8(t + 2 * TR + TR * i)), d);                    \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(da[blk])), acc);         \
    }

FT_AVX2 static void tile_dot_q6k_avx2(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                      const float *as, float *out) {
    (void)as;
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    int32_t hs[16];
    for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q6K) {
        const int8_t *a = aq + s * QKK;
        const float *da = ad + 8 * s;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        kq_half_sums(a, hs);
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                __m256i s32[4];
                for (int k = 0; k < 4; k++) s32[k] = _mm256_setzero_si256();
                for (int qq = 0; qq < 4; qq += 2) { /* two chunks per int16 sum: <= 2 * 2 * 63 * 127 */
                    __m256i c0[4], c1[4];
                    KQ_Q6_CODES(t, n, 4 * h + qq, c0);
                    KQ_Q6_CODES(t, n, 4 * h + qq + 1, c1);
                    for (int k = 0; k < 4; k++) {
                        const int8_t *x = a + 128 * n + 32 * k + 4 * (4 * h + qq);
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(c0[k], _mm256_set1_epi32(load_i32(x))),
                                                           _mm256_maddubs_epi16(c1[k], _mm256_set1_epi32(load_i32(x + 4))));
                        s32[k] = _mm256_add_epi32(s32[k], _mm256_madd_epi16(p, ones));
                    }
                }
                KQ_Q6_FINISH(s32)
            }
    }
    _mm256_storeu_ps(out, acc);
}

FT_VNNI static void tile_dot_q6k_vnni(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad,
                                      const float *as, float *out) {
    (void)as;
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    int32_t hs[16];
    for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q6K) {
        const int8_t *a = aq + s * QKK;
        const float *da = ad + 8 * s;
        FT_PREFETCH_AHEAD(t, KQ_TILE_Q6K);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        kq_half_sums(a, hs);
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                __m256i s32[4];
                for (int k = 0; k < 4; k++) s32[k] = _mm256_setzero_si256();
                for (int qq = 0; qq < 4; qq++) {
                    __m256i c[4];
                    KQ_Q6_CODES(t, n, 4 * h + qq, c);
                    for (int k = 0; k < 4; k++)
                        s32[k] = _mm256_dpbusd_epi32(
                            s32[k], c[k], _mm256_set1_epi32(load_i32(a + 128 * n + 32 * k + 4 * (4 * h + qq))));
                }
                KQ_Q6_FINISH(s32)
            }
    }
    _mm256_storeu_ps(out, acc);
}
/* Four tokens against one tile (tile_dot4_fn): the weight chunks are unpacked once and meet four activation rows. */
#define KQ_DOT4_Q4K(NAME, ATTR, VNNI)                                                                             \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *const *aq, const float *const *ad,          \
                          const float *const *as, float *const *out) {                                            \
        __m256 acc[4], corr[4];                                                                                   \
        for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();                                       \
        const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                  \
        (void)ones;                                                                                               \
        for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q4K) {                                                  \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));                                \
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR)));                  \
            for (int c = 0; c < 4; c++) {                                                                         \
                __m256i sm[4][2]; /* VNNI: int32 sums; AVX2: int16 sums (<= 8 * 2 * 15 * 127) */                 \
                for (int i = 0; i < 4; i++) sm[i][0] = sm[i][1] = _mm256_setzero_si256();                        \
                for (int q = 0; q < 8; q++) {                                                                     \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(t + 16 * TR + (8 * c + q) * 32));      \
                    const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4); \
                    for (int i = 0; i < 4; i++) {                                                                 \
                        const int8_t *a = aq[i] + s * QKK + 64 * c + 4 * q;                                       \
                        const __m256i xl = _mm256_set1_epi32(load_i32(a)), xh = _mm256_set1_epi32(load_i32(a + 32)); \
                        sm[i][0] = VNNI ? _mm256_dpbusd_epi32(sm[i][0], lo, xl)                                   \
                                        : _mm256_add_epi16(sm[i][0], _mm256_maddubs_epi16(lo, xl));              \
                        sm[i][1] = VNNI ? _mm256_dpbusd_epi32(sm[i][1], hi, xh)                                   \
                                        : _mm256_add_epi16(sm[i][1], _mm256_maddubs_epi16(hi, xh));              \
                    }                                                                                             \
                }                                                                                                 \
                for (int h = 0; h < 2; h++) {                                                                     \
                    const int j = 2 * c + h;                                                                      \
                    __m256 dsc, dm;                                                                               \
                    q4k_scales8(t, j, d, dmin, &dsc, &dm);                                                        \
                    for (int i = 0; i < 4; i++) {                                                                 \
                        const __m256i si = VNNI ? sm[i][h] : _mm256_madd_epi16(sm[i][h], ones);                   \
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si),                                          \
                                                 _mm256_mul_ps(dsc, _mm256_set1_ps(ad[i][8 * s + j])), acc[i]);   \
                        corr[i] = _mm256_fmadd_ps(dm, _mm256_set1_ps(as[i][8 * s + j]), corr[i]);                 \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[i], _mm256_sub_ps(acc[i], corr[i]));                    \
    }

#define KQ_DOT4_Q6K(NAME, ATTR, VNNI)                                                                             \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *const *aq, const float *const *ad,          \
                          const float *const *as, float *const *out) {                                            \
        (void)as;                                                                                                 \
        __m256 acc[4];                                                                                            \
        for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();                                                 \
        const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);     \
        (void)ones;                                                                                               \
        int32_t hs[4][16];                                                                                        \
        for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q6K) {                                                  \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));                                \
            for (int i = 0; i < 4; i++) kq_half_sums(aq[i] + s * QKK, hs[i]);                                     \
            for (int n = 0; n < 2; n++)                                                                           \
                for (int h = 0; h < 2; h++) {                                                                     \
                    __m256i s32[4][4];                                                                            \
                    for (int i = 0; i < 4; i++)                                                                   \
                        for (int k = 0; k < 4; k++) s32[i][k] = _mm256_setzero_si256();                          \
                    for (int qq = 0; qq < 4; qq++) {                                                              \
                        __m256i cd[4];                                                                            \
                        KQ_Q6_CODES(t, n, 4 * h + qq, cd);                                                        \
                        for (int i = 0; i < 4; i++)                                                               \
                            for (int k = 0; k < 4; k++) {                                                         \
                                const __m256i x = _mm256_set1_epi32(                                              \
                                    load_i32(aq[i] + s * QKK + 128 * n + 32 * k + 4 * (4 * h + qq)));            \
                                s32[i][k] = VNNI ? _mm256_dpbusd_epi32(s32[i][k], cd[k], x)                       \
                                                 : _mm256_add_epi32(s32[i][k], _mm256_madd_epi16(                 \
                                                                                   _mm256_maddubs_epi16(cd[k], x), ones)); \
                            }                                                                                     \
                    }                                                                                             \
                    for (int k = 0; k < 4; k++) {                                                                 \
                        const int blk = 4 * n + k, sc_i = 2 * blk + h;                                            \
                        const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(KQ_I8X8(t + 2 * TR + TR * sc_i)), d);  \
                        for (int i = 0; i < 4; i++) {                                                             \
                            const __m256i isum = _mm256_sub_epi32(s32[i][k], _mm256_set1_epi32(32 * hs[i][sc_i])); \
                            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),                                    \
                                                     _mm256_mul_ps(sc, _mm256_set1_ps(ad[i][8 * s + blk])), acc[i]); \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
        }                                                                                                         \
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[i], acc[i]);                                             \
    }

KQ_DOT4_Q4K(tile_dot4_q4k_avx2, FT_AVX2, 0)
KQ_DOT4_Q4K(tile_dot4_q4k_vnni, FT_VNNI, 1)
KQ_DOT4_Q6K(tile_dot4_q6k_avx2, FT_AVX2, 0)
KQ_DOT4_Q6K(tile_dot4_q6k_vnni, FT_VNNI, 1)

/* Bit j of every byte of qh moved to bit 4: the fifth bit of the q5_k codes of sub-block j (16-bit shifts: the bits
 * that cross into the neighbouring byte land outside bit 4 and are masked off). */
FT_AVX2 static inline __m256i q5k_hbit(__m256i qh, int j) {
    const __m256i m16 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4), m16);
}

/* Group q's codes of sub-blocks 2c (LO: values 64c + 4q + p) and 2c + 1 (HI: values 64c + 32 + 4q + p), 0..31 */
#define KQ_Q5_CODES(G, QH, C, LO, HI)                                                                             \
    do {                                                                                                          \
        const __m256i w_ = _mm256_loadu_si256((const __m256i *)((G) + 32 + 32 * (C)));                            \
        LO = _mm256_or_si256(_mm256_and_si256(w_, m4), q5k_hbit(QH, 2 * (C)));                                    \
        HI = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w_, 4), m4), q5k_hbit(QH, 2 * (C) + 1));          \
    } while (0)

/* One token: the groups in order, each meeting the four 64-value halves of the activation; the eight sub-blocks'
 * sums part[j] run over four groups at a time (AVX2: int16, <= 4 * 2 * 31 * 127), then go to int32 sums sm[j]. */
#define KQ_DOT_Q5K(NAME, ATTR, VNNI)                                                                              \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *aq, const float *ad, const float *as,       \
                          float *out) {                                                                           \
        __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();                                             \
        const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                  \
        (void)ones;                                                                                               \
        for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q5K) {                                                  \
            const int8_t *a = aq + s * QKK;                                                                       \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));                                \
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR)));                  \
            __m256i sm[8];                                                                                        \
            for (int j = 0; j < 8; j++) sm[j] = _mm256_setzero_si256();                                           \
            for (int q0 = 0; q0 < 8; q0 += 4) {                                                                   \
                __m256i part[8];                                                                                  \
                for (int j = 0; j < 8; j++) part[j] = _mm256_setzero_si256();                                     \
                for (int q = q0; q < q0 + 4; q++) {                                                               \
                    const uint8_t *g = t + KQ_Q5K_BODY + q * KQ_Q5K_GROUP;                                        \
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)g);                                    \
                    for (int c = 0; c < 4; c++) {                                                                 \
                        __m256i lo, hi;                                                                           \
                        KQ_Q5_CODES(g, qh, c, lo, hi);                                                            \
                        const __m256i xl = _mm256_set1_epi32(load_i32(a + 64 * c + 4 * q));                       \
                        const __m256i xh = _mm256_set1_epi32(load_i32(a + 64 * c + 32 + 4 * q));                  \
                        part[2 * c] = VNNI ? _mm256_dpbusd_epi32(part[2 * c], lo, xl)                             \
                                           : _mm256_add_epi16(part[2 * c], _mm256_maddubs_epi16(lo, xl));         \
                        part[2 * c + 1] = VNNI ? _mm256_dpbusd_epi32(part[2 * c + 1], hi, xh)                     \
                                               : _mm256_add_epi16(part[2 * c + 1], _mm256_maddubs_epi16(hi, xh)); \
                    }                                                                                             \
                }                                                                                                 \
                for (int j = 0; j < 8; j++)                                                                       \
                    sm[j] = _mm256_add_epi32(sm[j], VNNI ? part[j] : _mm256_madd_epi16(part[j], ones));           \
            }                                                                                                     \
            for (int j = 0; j < 8; j++) {                                                                         \
                __m256 dsc, dm;                                                                                   \
                q4k_scales8(t, j, d, dmin, &dsc, &dm);                                                            \
                const __m256 scale = _mm256_mul_ps(dsc, _mm256_set1_ps(ad[8 * s + j]));                          \
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sm[j]), scale, acc);                                     \
                corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(as[8 * s + j]), corr);                                  \
            }                                                                                                     \
        }                                                                                                         \
        _mm256_storeu_ps(out, _mm256_sub_ps(acc, corr));                                                          \
    }

/* Four tokens: one pass over the groups per pair of sub-blocks (2c, 2c + 1), each group's codes unpacked once and
 * met by the four activation rows (the super-block stays in L1 between passes). */
#define KQ_DOT4_Q5K(NAME, ATTR, VNNI)                                                                             \
    ATTR static void NAME(const uint8_t *t, int64_t nb, const int8_t *const *aq, const float *const *ad,          \
                          const float *const *as, float *const *out) {                                            \
        __m256 acc[4], corr[4];                                                                                   \
        for (int i = 0; i < 4; i++) acc[i] = corr[i] = _mm256_setzero_ps();                                       \
        const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                  \
        (void)ones;                                                                                               \
        for (int64_t s = 0; s < nb / 8; s++, t += KQ_TILE_Q5K) {                                                  \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));                                \
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 2 * TR)));                  \
            for (int c = 0; c < 4; c++) {                                                                         \
                __m256i sm[4][2];                                                                                 \
                for (int i = 0; i < 4; i++) sm[i][0] = sm[i][1] = _mm256_setzero_si256();                        \
                for (int q = 0; q < 8; q++) {                                                                     \
                    const uint8_t *g = t + KQ_Q5K_BODY + q * KQ_Q5K_GROUP;                                        \
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)g);                                    \
                    __m256i lo, hi;                                                                               \
                    KQ_Q5_CODES(g, qh, c, lo, hi);                                                                \
                    for (int i = 0; i < 4; i++) {                                                                 \
                        const int8_t *a = aq[i] + s * QKK + 64 * c + 4 * q;                                       \
                        const __m256i xl = _mm256_set1_epi32(load_i32(a)), xh = _mm256_set1_epi32(load_i32(a + 32)); \
                        sm[i][0] = VNNI ? _mm256_dpbusd_epi32(sm[i][0], lo, xl)                                   \
                                        : _mm256_add_epi32(sm[i][0],                                              \
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones)); \
                        sm[i][1] = VNNI ? _mm256_dpbusd_epi32(sm[i][1], hi, xh)                                   \
                                        : _mm256_add_epi32(sm[i][1],                                              \
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones)); \
                    }                                                                                             \
                }                                                                                                 \
                for (int h = 0; h < 2; h++) {                                                                     \
                    const int j = 2 * c + h;                                                                      \
                    __m256 dsc, dm;                                                                               \
                    q4k_scales8(t, j, d, dmin, &dsc, &dm);                                                        \
                    for (int i = 0; i < 4; i++) {                                                                 \
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sm[i][h]),                                    \
                                                 _mm256_mul_ps(dsc, _mm256_set1_ps(ad[i][8 * s + j])), acc[i]);   \
                        corr[i] = _mm256_fmadd_ps(dm, _mm256_set1_ps(as[i][8 * s + j]), corr[i]);                 \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[i], _mm256_sub_ps(acc[i], corr[i]));                    \
    }

KQ_DOT_Q5K(tile_dot_q5k_avx2, FT_AVX2, 0)
KQ_DOT_Q5K(tile_dot_q5k_vnni, FT_VNNI, 1)
KQ_DOT4_Q5K(tile_dot4_q5k_avx2, FT_AVX2, 0)
KQ_DOT4_Q5K(tile_dot4_q5k_vnni, FT_VNNI, 1)
#endif

#endif
