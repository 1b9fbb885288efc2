/* AMX (Intel Advanced Matrix Extensions) for many tokens against the same weight rows: a prefill step's experts,
 * a quantized linear at M > 1. Included once, by ft_kernels.c, after the tile kernels and `qact`.
 *
 * A work item is 32 weight rows (four 8-row tiles of the repacked layout, ft_tiles.h) against every token of the call
 * (of one expert, for the fused MoE step), 16 tokens at a time: the tokens' activations are gathered once per call
 * (per MoE pass) into 16-token panels (amx_panel), the item's weights are unpacked once into B tiles.
 *
 * Exact mode (decode tokens and verify rows by default; every call in deterministic mode), per 16 weight rows and
 * 32-value block b (Q6_K: per 16-value half):
 *   A (16 tokens x 32 int8): the block's quantized activations, straight from the panel (row stride nb * 32);
 *   B (8 rows x 64 bytes: 4 bytes of K for each of the 16 weight rows, the layout AMX multiplies): q8 codes as
 *     stored; q4 codes unpacked to one byte each (low nibbles of the 4 chunks, then high nibbles; the panel's
 *     activation groups permuted to match); q4_k one nibble half of eight chunks; q6_k codes of one half;
 *   C (16 tokens x 16 rows int32) = A . B (TDPBSSD for signed q8 codes, TDPBSUD for unsigned ones).
 * The int32 sums are the ones the 1-token AVX-512 VNNI kernels compute (q8: + 128 * sum(a), their flipped codes;
 * q6_k: - 32 * the half's sum(a)), and the fp32 epilogue applies the scales in the same order (acc = fma(s, dw *
 * da, acc); corr = fma(dw, sa, corr) over blocks; out = acc - zero * corr), so every output is bit-identical to that
 * path: the batch invariance of the quantized kernels (invariant.py) holds with AMX on. C tiles rotate through four
 * registers so a block's product, the previous block's store and the one before's read-back overlap.
 *
 * bf16 mode (prompt-only steps by default, every call on request): the weights dequantized to bf16, the
 * activations rounded to bf16, TDPBF16PS summing all of K in fp32 with no per-block epilogue; two token chunks x two
 * 16-row halves per block (amx_rows_bf16). See amx_mode.
 *
 * Linux gives a process AMX's 8 KB of tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM): detection asks
 * once; where the kernel refuses (old kernel, a VM without it), the ISA stays AVX-512 VNNI.
 */
#ifndef FT_AMX_H
#define FT_AMX_H

#define AMX_TOKENS 16
#define AMX_ROWS 32 /* weight rows per work item on the AMX path (4 tiles) */

/* Activations gathered for AMX, 16 tokens per chunk, built once per call (or per MoE pass), read by every 16-row
 * item. Exact mode (int8): chunk k's int8 rows at a + k * 16 * nb * 32 (row stride nb * 32, rows past the chunk's
 * tokens zero), its scales transposed per block (da[k * 16 * nb + b * 16 + m], sa and q128 likewise) so a block's
 * 16 values are one vector. bf16 mode: block-major, one 1 KB tile per (chunk, block): block b of chunk k's row m
 * at bf + ((k * nb + b) * 16 + m) * 32 (a tile load reads 1 KB in a row). */
typedef struct {
    int8_t *a;
    float *da, *sa;
    int32_t *q128;
    uint16_t *bf;
    int64_t nb;
    int bf16;
} amx_panel;

/* Bytes of one chunk of a panel of `nb` blocks (either mode). */
static inline size_t amx_chunk_bytes(int64_t nb) { return (size_t)(AMX_TOKENS * nb * 2 * QK); } /* >= 32 + 16 */



/* Carve a panel of `chunks` chunks out of `mem` (amx_chunk_bytes(nb) * chunks bytes, 64-byte aligned). */
static inline void amx_panel_at(amx_panel *p, uint8_t *mem, int64_t chunks, int64_t nb) {
    const int64_t rows = chunks * AMX_TOKENS;
    p->nb = nb;
    p->a = (int8_t *)mem;
    p->da = (float *)(mem + rows * nb * QK);
    p->sa = p->da + rows * nb;
    p->q128 = (int32_t *)(p->sa + rows * nb);
    p->bf = (uint16_t *)mem;
    p->bf16 = 0;
}

#ifdef FT_HAVE_AMX
#define FT_AMX __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512vl,avx512bw,avx512vnni,avx512bf16,avx2,fma,f16c")))
#define AMX_MIN_DEFAULT 10

/* Tokens per call below which the tile kernels run instead (AMX pads a 16-token block). */
static int64_t amx_min_tokens = AMX_MIN_DEFAULT;

/* Tokens on one weight from which a bf16-mode call runs the bf16 tiles; between amx_min_tokens and this, the exact
 * int8 tiles (faster there: the bf16 B fill, 4x the bytes of the int8 one, is paid per weight whatever the tokens).
 * Measured on a Sapphire Rapids class Xeon, 2 threads, one MoE call of 64 experts (D 2048, I 768, q4) at an even
 * number of tokens per expert: bf16 / exact time 1.10 at 12, 1.16 at 16, 0.90 at 24, 0.84 at 48, 0.72 at 64. */
#define AMX_BF16_MIN_DEFAULT 20
static int64_t amx_bf16_min_tokens = AMX_BF16_MIN_DEFAULT;
static _Atomic int64_t amx_calls; /* pieces of work run through AMX since load (tests: proof the path ran) */

/* Which AMX numerics run (ft_amx_set_mode; $FREETOKEN_AMX_BF16 at load: 1 bf16, 0 exact, unset prompts):
 * - exact: int8 tiles, every output bit-identical to the VNNI kernels (a token's bits never depend on how many tokens
 *   share its expert); set_deterministic(True) holds this mode while it is on;
 * - bf16: weights dequantized to bf16 once per 16-row item, activations rounded to bf16 (not int8), TDPBF16PS
 *   accumulating fp32 over all of K in the tile, no per-block epilogue: closer to the fp32 product, faster at many
 *   tokens per weight, not bit-identical to the VNNI kernels;
 * - prompts (the default): bf16 in calls made while the calling thread is inside a prompt step
 *   (ft_amx_prompt_step: the runner's steps that hold only prompt chunks), exact everywhere else: a decode token and a
 *   speculative verify row keep the bits of the VNNI kernels, a prompt gets the faster (and closer) bf16 product.
 * bf16 needs AMX-BF16 and AVX512-BF16 (else exact whatever the mode). -1: not yet decided. */
enum { AMX_EXACT = 0, AMX_BF16 = 1, AMX_PROMPTS = 2 };
static int amx_mode = -1;
static _Thread_local int amx_prompt_step; /* this thread is running a prompt-only step (ft_amx_prompt_step) */

static int amx_bf16_cpu = -1; /* cpuid's answer, asked once (in a VM cpuid exits to the hypervisor); -1: not yet */

static int amx_bf16_supported(void) {
    if (amx_bf16_cpu < 0) {
        unsigned a, b, c, d;
        amx_bf16_cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && /* AMX-BF16 */
                       __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);     /* AVX512_BF16 */
    }
    return amx_bf16_cpu;
}

static int amx_mode_now(void) {
    if (amx_mode < 0) {
        const char *env = getenv("FREETOKEN_AMX_BF16");
        amx_mode = env && env[0] == '1' ? AMX_BF16 : env && env[0] == '0' ? AMX_EXACT : AMX_PROMPTS;
    }
    return amx_mode;
}

/* Whether a call made now on this thread gathers bf16 panels (for the weights with enough tokens: amx_takes_bf16). */
static inline int amx_bf16_on(void) {
    const int mode = amx_mode_now();
    return (mode == AMX_BF16 || (mode == AMX_PROMPTS && amx_prompt_step)) && amx_bf16_supported();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* Every one of the 8 tiles 16 rows x 64 bytes (the bf16 kernels: fp32 C, bf16 A and B) */
FT_AMX static inline void amx_load_full_tiles(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* [a | b]: two tiles' 8 row values as one vector (AVX-512F only) */
FT_AMX static inline __m512 amx_join8(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}

/* C tile (e & 3) of the 4-tile ring to cb (16 x 16 int32): product e, issued an iteration ago, to memory (tile
 * numbers are immediates) */
FT_AMX static inline void amx_store_ring(int64_t e, int32_t *cb) {
    switch (e & 3) {
    case 0: _tile_stored(0, cb, 64); break;
    case 1: _tile_stored(1, cb, 64); break;
    case 2: _tile_stored(2, cb, 64); break;
    default: _tile_stored(3, cb, 64); break;
    }
}

/* Per-thread buffers of the weight side: dw per block, unpacked q4 codes. */
static _Thread_local struct {
    float *dw;
    uint8_t *b;
    int64_t cap_nb;
} tl_amx;

static int amx_scratch(int64_t nb) {
    if (nb <= tl_amx.cap_nb) return 1;
    free(tl_amx.dw);
    free(tl_amx.b);
    tl_amx.dw = (float *)aligned_alloc(64, (size_t)(4 * 32 * nb)); /* dw, and q4_k's dmin * m */
    tl_amx.b = (uint8_t *)aligned_alloc(64, (size_t)(2048 * nb)); /* int8 mode: 512 per block, bf16: 2048 */
    tl_amx.cap_nb = tl_amx.dw && tl_amx.b ? nb : 0;
    return tl_amx.cap_nb > 0;
}

/* Whether `fmt` with `count` tokens runs here through AMX. */
static inline int amx_takes(int fmt, int64_t count) {
    return g_isa >= FT_ISA_AMX && (fmt == FT_Q8 || fmt == FT_Q4 || fmt == FT_Q4K || fmt == FT_Q6K) &&
           count >= amx_min_tokens;
}

/* Whether `fmt` with `count` tokens runs on the bf16 tiles in a call whose calling thread found amx_bf16_on()
 * (`wide`): the formats with a bf16 B fill (all that AMX runs), and enough tokens to pay for that fill. */
static inline int amx_takes_bf16(int wide, int fmt, int64_t count) {
    return wide && (fmt == FT_Q8 || fmt == FT_Q4 || fmt == FT_Q4K || fmt == FT_Q6K) && amx_takes(fmt, count) &&
           count >= amx_bf16_min_tokens;
}

/* Chunk `k` of panel p: the activation rows of tokens [i0, i0 + n) (row = tok ? tok[i] : first + i), n <= 16;
 * q4: each block's 4-byte groups in the unpacked codes' order (0, 2, 4, 6, 1, 3, 5, 7). */
FT_AMX static void amx_gather(int fmt, const qact *a, const int64_t *tok, int64_t first, int64_t i0, int64_t n,
                              const amx_panel *p, int64_t k) {
    const int64_t nb = p->nb;
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    int8_t *rows = p->a + k * AMX_TOKENS * nb * QK;
    float *da = p->da + k * AMX_TOKENS * nb, *sa = p->sa + k * AMX_TOKENS * nb;
    int32_t *q128 = p->q128 + k * AMX_TOKENS * nb * 2;
    for (int64_t m = 0; m < AMX_TOKENS; m++) {
        int8_t *dst = rows + m * nb * QK;
        if (m >= n) {
            memset(dst, 0, (size_t)(nb * QK));
            for (int64_t b = 0; b < nb; b++) da[b * AMX_TOKENS + m] = sa[b * AMX_TOKENS + m] = 0.f;
            for (int64_t b = 0; b < 2 * nb; b++) q128[b * AMX_TOKENS + m] = 0;
            continue;
        }
        const int64_t r = tok ? tok[i0 + m] : first + i0 + m;
        const int8_t *src = a->q + r * nb * QK;
        for (int64_t b = 0; b < nb; b++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(src + b * QK));
            if (fmt == FT_Q4) v = _mm256_permutevar8x32_epi32(v, perm);
            _mm256_storeu_si256((__m256i *)(dst + b * QK), v);
            da[b * AMX_TOKENS + m] = a->d[r * nb + b];
            sa[b * AMX_TOKENS + m] = a->s[r * nb + b];
            int32_t sum = 0;
            if (fmt == FT_Q6K) { /* 32 * each 16-value half's sum (the codes' offset of 32), two per block */
                int32_t hsum[2] = {0, 0};
                for (int j = 0; j < QK; j++) hsum[j / 16] += src[b * QK + j];
                q128[b * AMX_TOKENS + m] = 32 * hsum[0];
                q128[(nb + b) * AMX_TOKENS + m] = 32 * hsum[1];
                continue;
            }
            if (fmt == FT_Q8) { /* 128 * sum(a): the VNNI kernel's flipped codes (c + 128) add it to each sum */
                const __m256i w32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, v), ones16); /* |a| <= 127 */
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(w32), _mm256_extracti128_si256(w32, 1));
                s4 = _mm_hadd_epi32(s4, s4);
                s4 = _mm_hadd_epi32(s4, s4);
                sum = 128 * _mm_cvtsi128_si32(s4);
            }
            q128[b * AMX_TOKENS + m] = sum;
        }
    }
}

/* Q4_K sub-block j's d * sc_j and dmin * m_j (q4k_scales8, the VNNI kernel's products) for the 16 weight rows of the
 * super-blocks at g0 and g1 (NULL: zeros), one vector each. */
FT_AMX static inline void amx_q4k_scales16(const uint8_t *g0, const uint8_t *g1, int j, __m512 *dsc, __m512 *dm) {
    __m256 dsc0, dm0, dsc1 = _mm256_setzero_ps(), dm1 = _mm256_setzero_ps();
    q4k_scales8(g0, j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g0)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g0 + 2 * TR))), &dsc0, &dm0);
    if (g1)
        q4k_scales8(g1, j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g1)),
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g1 + 2 * TR))), &dsc1, &dm1);
    *dsc = amx_join8(dsc0, dsc1);
    *dm = amx_join8(dm0, dm1);
}

/* Q6_K: sc_i * d for the 16 halves i of the super-blocks at g0 and g1 (NULL: zeros), the VNNI kernel's product. */
FT_AMX static inline void amx_q6k_scales16(const uint8_t *g0, const uint8_t *g1, __m512 scd[16]) {
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g0));
    const __m256 d1 = g1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g1)) : _mm256_setzero_ps();
    for (int i = 0; i < 16; i++) {
        const __m256 c0 = _mm256_mul_ps(_mm256_cvtepi32_ps(KQ_I8X8(g0 + 2 * TR + TR * i)), d0);
        const __m256 c1 = g1 ? _mm256_mul_ps(_mm256_cvtepi32_ps(KQ_I8X8(g1 + 2 * TR + TR * i)), d1) : _mm256_setzero_ps();
        scd[i] = amx_join8(c0, c1);
    }
}

/* Exact mode, 16 weight rows: out[i * out_stride + j] = row j of the rows starting at tile `tile` (tiles
 * `tile_stride` bytes apart; `ntiles` 1 or 2 of them) . token i's activations (panel chunks from `chunk` on), for
 * i < count and j < ncols (<= 8 * ntiles). Returns 0 (nothing written) when its scratch cannot be allocated. */
FT_AMX static int amx_rows16_int8(int fmt, const uint8_t *tile, int64_t tile_stride, int ntiles, int ncols,
                                  const amx_panel *p, int64_t chunk, int64_t count, float *out, int64_t out_stride) {
    const int64_t nb = p->nb;
    if (!amx_scratch(nb)) return 0;
    const int64_t tbb = tile_block_bytes(fmt);
    const uint8_t *t1 = ntiles > 1 ? tile + tile_stride : NULL;
    float *const dws = tl_amx.dw; /* thread-locals read once: in a shared library each access is a call */
    uint8_t *const bs = tl_amx.b;
    /* Once per call, for every block: dw[b][16], both tiles' scales as fp32, and B[b]: 8 rows of 64 bytes, row j
     * = 4 bytes of each of the 16 weight rows (the first tile's 8, then the second's; a missing second tile:
     * zeros). q8: row j = chunk j of each tile; q4: codes one byte each, rows 0-3 the 4 chunks' low nibbles, rows
     * 4-7 their high nibbles (the panel's activations are permuted to match). */
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    float *const dms = dws + 16 * nb; /* q4_k: dmin * m per block, what the correction sums (q4 / q8: dw) */
    if (fmt == FT_Q4K) /* per 32-value sub-block j of super-block sb: d * sc_j and dmin * m_j of each row (the
                        * VNNI kernel's products), and B rows q = 0..7 = chunk 8 (j / 2) + q's low (j even) or
                        * high (j odd) nibbles: K in natural order */
        for (int64_t b = 0; b < nb; b++) {
            const int64_t sb = b / 8;
            const int j = (int)(b % 8);
            const uint8_t *g0 = tile + sb * KQ_TILE_Q4K, *g1 = t1 ? t1 + sb * KQ_TILE_Q4K : NULL;
            __m512 dsc, dm;
            amx_q4k_scales16(g0, g1, j, &dsc, &dm);
            _mm512_store_ps(dws + 16 * b, dsc);
            _mm512_store_ps(dms + 16 * b, dm);
            uint8_t *dst = bs + b * 512;
            for (int q = 0; q < 8; q++) {
                const int64_t at = 16 * TR + (8 * (j / 2) + q) * 32;
                __m256i c0 = _mm256_loadu_si256((const __m256i *)(g0 + at));
                __m256i c1 = g1 ? _mm256_loadu_si256((const __m256i *)(g1 + at)) : _mm256_setzero_si256();
                if (j & 1) {
                    c0 = _mm256_srli_epi16(c0, 4);
                    c1 = _mm256_srli_epi16(c1, 4);
                }
                _mm256_store_si256((__m256i *)(dst + 64 * q), _mm256_and_si256(c0, m4));
                _mm256_store_si256((__m256i *)(dst + 64 * q + 32), _mm256_and_si256(c1, m4));
            }
        }
    for (int64_t b = 0; fmt != FT_Q4K && b < nb; b++) {
        const uint8_t *s0 = tile + b * tbb, *s1 = t1 ? t1 + b * tbb : NULL;
        const __m128i h0 = _mm_loadu_si128((const __m128i *)s0);
        const __m128i h1 = s1 ? _mm_loadu_si128((const __m128i *)s1) : _mm_setzero_si128();
        _mm512_store_ps(dws + 16 * b, _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1)));
        uint8_t *dst = bs + b * 512;
        const int chunks = fmt == FT_Q8 ? 8 : 4;
        for (int j = 0; j < chunks; j++) {
            const __m256i c0 = _mm256_loadu_si256((const __m256i *)(s0 + 2 * TR + 32 * j));
            const __m256i c1 = s1 ? _mm256_loadu_si256((const __m256i *)(s1 + 2 * TR + 32 * j)) : _mm256_setzero_si256();
            if (fmt == FT_Q8) {
                _mm256_store_si256((__m256i *)(dst + 64 * j), c0);
                _mm256_store_si256((__m256i *)(dst + 64 * j + 32), c1);
            } else {
                _mm256_store_si256((__m256i *)(dst + 64 * j), _mm256_and_si256(c0, m4));
                _mm256_store_si256((__m256i *)(dst + 64 * j + 32), _mm256_and_si256(c1, m4));
                _mm256_store_si256((__m256i *)(dst + 64 * (j + 4)), _mm256_and_si256(_mm256_srli_epi16(c0, 4), m4));
                _mm256_store_si256((__m256i *)(dst + 64 * (j + 4) + 32), _mm256_and_si256(_mm256_srli_epi16(c1, 4), m4));
            }
        }
    }
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* C, a ring of 4: 16 tokens x 16 rows int32 */
        cfg.rows[t] = AMX_TOKENS;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = cfg.rows[6] = AMX_TOKENS; /* A: 16 tokens x 32 int8 */
    cfg.colsb[4] = cfg.colsb[6] = QK;
    cfg.rows[5] = cfg.rows[7] = QK / 4; /* B: 8 rows of 4 bytes x 16 weight rows */
    cfg.colsb[5] = cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
    int32_t cbuf[4][AMX_TOKENS * 16] __attribute__((aligned(64)));
    float corr[AMX_TOKENS][16] __attribute__((aligned(64)));
    const __m512 zero = _mm512_set1_ps(fmt == FT_Q4 ? 8.f : fmt == FT_Q4K ? 1.f : 128.f);
    const float *const cws = fmt == FT_Q4K ? dms : dws; /* what multiplies sa in the correction */
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
    for (int64_t i0 = 0; i0 < count; i0 += AMX_TOKENS) {
        const int64_t n = count - i0 < AMX_TOKENS ? count - i0 : AMX_TOKENS, k = chunk + i0 / AMX_TOKENS;
        const int8_t *rows = p->a + k * AMX_TOKENS * nb * QK;
        const float *das = p->da + k * AMX_TOKENS * nb, *sas = p->sa + k * AMX_TOKENS * nb;
        const int32_t *q128s = p->q128 + k * AMX_TOKENS * nb * 2;
        /* corr[m] = sum over blocks, in order, of dw * sa[m]: 8 tokens' chains at a time (one chain alone waits on
         * each fma's latency) */
        for (int h = 0; h < 2; h++) {
            __m512 cr[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) cr[u] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m512 dw = _mm512_load_ps(cws + 16 * b);
#pragma GCC unroll 8
                for (int u = 0; u < 8; u++) cr[u] = _mm512_fmadd_ps(dw, _mm512_set1_ps(sas[b * AMX_TOKENS + 8 * h + u]), cr[u]);
            }
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) _mm512_store_ps(corr[8 * h + u], cr[u]);
        }
        __m512 acc[AMX_TOKENS];
#pragma GCC unroll 16
        for (int m = 0; m < AMX_TOKENS; m++) acc[m] = _mm512_setzero_ps();
        /* software-pipelined, three blocks in flight: block b's product is computed while block b - 1's is stored
         * and block b - 2's read back (a tile store waits for its product, and vector loads of a tile store's
         * data wait for it to reach the cache: in sequence each stalls) */
        for (int64_t b = 0; b < nb + 2; b++) {
            if (b < nb) { /* block b's product into C tile b % 4 */
                /* A and B double-buffered (tiles 4, 5 for even blocks, 6, 7 for odd ones): tiles are not renamed,
                 * so a load into the tile the last product reads would wait for that product */
                switch (b & 3) { /* tile numbers are immediates */
#define AMX_STEP(C, A, B)                                                                                      \
    _tile_loadd(A, rows + b * QK, (long)(nb * QK));                                                            \
    _tile_loadd(B, bs + b * 512, 64);                                                                          \
    _tile_zero(C);                                                                                             \
    if (fmt == FT_Q8) _tile_dpbssd(C, A, B);                                                                   \
    else _tile_dpbsud(C, A, B);                                                                                \
    break;
                case 0: AMX_STEP(0, 4, 5)
                case 1: AMX_STEP(1, 6, 7)
                case 2: AMX_STEP(2, 4, 5)
                default: AMX_STEP(3, 6, 7)
#undef AMX_STEP
                }
            }
            if (b >= 1 && b <= nb) amx_store_ring(b - 1, cbuf[(b - 1) & 3]); /* block b - 1's product */
            if (b < 2) continue;
            const int64_t e = b - 2; /* the epilogue of block e, stored an iteration ago */
            const int32_t *cb = cbuf[e & 3];
            const __m512 dw = _mm512_load_ps(dws + 16 * e);
            const float *da = das + e * AMX_TOKENS;
            const int32_t *q128 = q128s + e * AMX_TOKENS;
#pragma GCC unroll 16
            for (int m = 0; m < AMX_TOKENS; m++) { /* all 16 (rows past n are zeros): acc stays in registers */
                __m512i s = _mm512_load_si512(cb + 16 * m);
                if (fmt == FT_Q8) s = _mm512_add_epi32(s, _mm512_set1_epi32(q128[m]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(da[m])), acc[m]);
            }
        }
#pragma GCC unroll 16
        for (int m = 0; m < AMX_TOKENS; m++)
            if (m < n)
                _mm512_mask_storeu_ps(out + (i0 + m) * out_stride, keep,
                                      _mm512_fnmadd_ps(zero, _mm512_load_ps(corr[m]), acc[m]));
    }
    _tile_release();
    atomic_fetch_add_explicit(&amx_calls, 1, memory_order_relaxed);
    return 1;
}

/* Exact mode for Q6_K, 16 weight rows, as amx_rows16_int8: each 16-value half of a 32-value block has its own
 * int8 scale, so one tile product per half (K = 16: A 16 x 16 bytes, B 4 rows of 64); the epilogue follows the
 * VNNI kernel (tile_dot_q6k_vnni) exactly: per super-block, halves in the order (n, h, k) = 128-value half n,
 * 16-value half h, 32-value block 4n + k; acc = fma(s - 32 * half_sum(a), (sc * d) * da, acc); no correction. */
FT_AMX static int amx_rows16_q6k(const uint8_t *tile, int64_t tile_stride, int ntiles, int ncols, const amx_panel *p,
                                 int64_t chunk, int64_t count, float *out, int64_t out_stride) {
    const int64_t nb = p->nb, ns = nb / 8, nh = 2 * nb;
    if (!amx_scratch(nb)) return 0;
    const uint8_t *t1 = ntiles > 1 ? tile + tile_stride : NULL;
    float *const scd = tl_amx.dw; /* [super-block][16 halves][16 rows]: sc_i * d, the VNNI kernel's product */
    uint8_t *const bs = tl_amx.b; /* [half u in epilogue order]: 4 B rows of 64 bytes */
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int64_t sb = 0; sb < ns; sb++) {
        const uint8_t *g0 = tile + sb * KQ_TILE_Q6K, *g1 = t1 ? t1 + sb * KQ_TILE_Q6K : NULL;
        __m512 sc[16];
        amx_q6k_scales16(g0, g1, sc);
        for (int i = 0; i < 16; i++) _mm512_store_ps(scd + (sb * 16 + i) * 16, sc[i]);
        for (int n = 0; n < 2; n++)
            for (int g = 0; g < 8; g++) { /* group g: values 128n + 32k + 4g + (0..3) of block 4n + k, half g / 4 */
                __m256i c0[4], c1[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                        _mm256_setzero_si256()};
                KQ_Q6_CODES(g0, n, g, c0);
                if (g1) KQ_Q6_CODES(g1, n, g, c1);
                const int h = g / 4;
                for (int k = 0; k < 4; k++) {
                    const int64_t u = sb * 16 + n * 8 + h * 4 + k; /* the half's place in epilogue order */
                    uint8_t *dst = bs + u * 256 + 64 * (g % 4);
                    _mm256_store_si256((__m256i *)dst, c0[k]);
                    _mm256_store_si256((__m256i *)(dst + 32), c1[k]);
                }
            }
    }
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* C ring: 16 tokens x 16 rows int32 */
        cfg.rows[t] = AMX_TOKENS;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = cfg.rows[6] = AMX_TOKENS; /* A: 16 tokens x 16 int8 (one half) */
    cfg.colsb[4] = cfg.colsb[6] = 16;
    cfg.rows[5] = cfg.rows[7] = 4; /* B: 4 rows of 4 bytes x 16 weight rows */
    cfg.colsb[5] = cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
    int32_t cbuf[4][AMX_TOKENS * 16] __attribute__((aligned(64)));
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
    for (int64_t i0 = 0; i0 < count; i0 += AMX_TOKENS) {
        const int64_t n = count - i0 < AMX_TOKENS ? count - i0 : AMX_TOKENS, k = chunk + i0 / AMX_TOKENS;
        const int8_t *rows = p->a + k * AMX_TOKENS * nb * QK;
        const float *das = p->da + k * AMX_TOKENS * nb;
        const int32_t *hss = p->q128 + k * AMX_TOKENS * nb * 2;
        __m512 acc[AMX_TOKENS];
#pragma GCC unroll 16
        for (int m = 0; m < AMX_TOKENS; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t u = 0; u < nh + 2; u++) { /* three halves in flight, as in amx_rows16_int8 */
            if (u < nh) {
                const int64_t r = u % 16, blk = (u / 16) * 8 + 4 * (r / 8) + r % 4, h = (r / 4) % 2;
                const int8_t *a = rows + blk * QK + 16 * h;
                switch (u & 3) {
#define AMX_HALF(C, A, B)                                                                                      \
    _tile_loadd(A, a, (long)(nb * QK));                                                                        \
    _tile_loadd(B, bs + u * 256, 64);                                                                          \
    _tile_zero(C);                                                                                             \
    _tile_dpbsud(C, A, B);                                                                                     \
    break;
                case 0: AMX_HALF(0, 4, 5)
                case 1: AMX_HALF(1, 6, 7)
                case 2: AMX_HALF(2, 4, 5)
                default: AMX_HALF(3, 6, 7)
#undef AMX_HALF
                }
            }
            if (u >= 1 && u <= nh) amx_store_ring(u - 1, cbuf[(u - 1) & 3]);
            if (u < 2) continue;
            const int64_t e = u - 2, r = e % 16, sb = e / 16;
            const int64_t blk = sb * 8 + 4 * (r / 8) + r % 4, h = (r / 4) % 2, i = 2 * (4 * (r / 8) + r % 4) + h;
            const int32_t *cb = cbuf[e & 3];
            const __m512 sc = _mm512_load_ps(scd + (sb * 16 + i) * 16);
            const float *da = das + blk * AMX_TOKENS;
            const int32_t *hs = hss + (h * nb + blk) * AMX_TOKENS;
#pragma GCC unroll 16
            for (int m = 0; m < AMX_TOKENS; m++) {
                const __m512i isum = _mm512_sub_epi32(_mm512_load_si512(cb + 16 * m), _mm512_set1_epi32(hs[m]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(da[m])), acc[m]);
            }
        }
#pragma GCC unroll 16
        for (int m = 0; m < AMX_TOKENS; m++)
            if (m < n) _mm512_mask_storeu_ps(out + (i0 + m) * out_stride, keep, acc[m]);
    }
    _tile_release();
    atomic_fetch_add_explicit(&amx_calls, 1, memory_order_relaxed);
    return 1;
}

/* Row `c` = 0..15 of a block's 16 weight rows as fp32, 4 values of K per 32-bit lane: lane c of the result holds
 * codes for K = 4j..4j+3 (q8: chunk j of the tiles; the caller splits the bytes). */
FT_AMX static inline __m512i amx_chunk16(const uint8_t *s0, const uint8_t *s1, int j) {
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)(s0 + 2 * TR + 32 * j));
    const __m256i c1 = s1 ? _mm256_loadu_si256((const __m256i *)(s1 + 2 * TR + 32 * j)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
}

/* Two fp32 vectors (value 2p and 2p + 1 of K for the 16 weight rows) as one bf16 B row: lane c = the pair. */
FT_AMX static inline void amx_pair_row(__m512 even, __m512 odd, uint8_t *dst) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* 0-15: even, 16-31: odd */
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, both));
}

/* bf16 B rows (16 rows of 64 bytes: K pairs 2p, 2p + 1 in natural order) of Q4_K block b — sub-block b % 8 of
 * super-block b / 8 — for the 16 weight rows of tiles t0 and t1 (NULL: zeros): value d * sc_j * q - dmin * m_j (the
 * scales q4k_scales8 gives the VNNI kernel), one fused rounding to fp32, then bf16. */
FT_AMX static void amx_fill_q4k_bf16(const uint8_t *t0, const uint8_t *t1, int64_t b, uint8_t *dst) {
    const int64_t sb = b / 8;
    const int j = (int)(b % 8), shift = (j & 1) * 4; /* an odd sub-block is its chunks' high nibbles */
    const uint8_t *g0 = t0 + sb * KQ_TILE_Q4K, *g1 = t1 ? t1 + sb * KQ_TILE_Q4K : NULL;
    __m512 dsc, dm;
    amx_q4k_scales16(g0, g1, j, &dsc, &dm);
    const __m512 lut = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    for (int q = 0; q < 8; q++) { /* chunk 8 (j / 2) + q: 4 bytes a row, byte i = K 4q + i of the sub-block */
        const int64_t at = 16 * TR + (8 * (j / 2) + q) * 32;
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(g0 + at));
        const __m256i c1 = g1 ? _mm256_loadu_si256((const __m256i *)(g1 + at)) : _mm256_setzero_si256();
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
        __m512 f[4];
        for (int i = 0; i < 4; i++) /* vpermps reads the low 4 bits: the nibble */
            f[i] = _mm512_fmsub_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i + shift), lut), dsc, dm);
        amx_pair_row(f[0], f[1], dst + 64 * (2 * q));
        amx_pair_row(f[2], f[3], dst + 64 * (2 * q + 1));
    }
}

/* bf16 B rows of Q6_K super-block sb (blocks 8 sb .. 8 sb + 7) for the 16 weight rows of tiles t0 and t1 (NULL:
 * zeros), into block b's tile for half h at bs + (2 b + h) * 1024: value d * sc_i * (q - 32), sc_i the scale of the
 * value's 16-value half (as the VNNI kernel multiplies them: d * sc_i first), then bf16. */
FT_AMX static void amx_fill_q6k_bf16(const uint8_t *t0, const uint8_t *t1, int64_t sb, int h, uint8_t *bs) {
    const uint8_t *g0 = t0 + sb * KQ_TILE_Q6K, *g1 = t1 ? t1 + sb * KQ_TILE_Q6K : NULL;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m512 scd[16]; /* half i = 2 * (block within sb) + (which 16 values) */
    amx_q6k_scales16(g0, g1, scd);
    const __m512i m255 = _mm512_set1_epi32(0xff);
    const __m512 off = _mm512_set1_ps(32.f);
    for (int n = 0; n < 2; n++)
        for (int g = 0; g < 8; g++) { /* group g: values 128n + 32k + 4g + (0..3), i.e. K 4g.. of block 4n + k */
            __m256i c0[4], c1[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                    _mm256_setzero_si256()};
            KQ_Q6_CODES(g0, n, g, c0);
            if (g1) KQ_Q6_CODES(g1, n, g, c1);
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(c0[k]), c1[k], 1);
                const __m512 sc = scd[2 * (4 * n + k) + g / 4];
                __m512 f[4];
                for (int i = 0; i < 4; i++)
                    f[i] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i),
                                                                                           m255)), off), sc);
                uint8_t *dst = bs + ((sb * 8 + 4 * n + k) * 2 + h) * 1024 + 64 * (2 * g);
                amx_pair_row(f[0], f[1], dst);
                amx_pair_row(f[2], f[3], dst + 64);
            }
        }
}

/* bf16 mode, up to 32 weight rows (`ntiles` <= 4) as in amx_rows: weights dequantized to bf16 (value d * (c - 8) for
 * q4, d * c for q8, rounded once; q4_k / q6_k: amx_fill_q4k_bf16 / amx_fill_q6k_bf16), activations the panel's
 * bf16 tiles; fp32 sums over all of K in the C tiles. Two
 * chunks of tokens x two 16-row halves at a time (4 C tiles): every A and B tile loaded feeds two products, which
 * halves what streams from L2 per product. */
FT_AMX static int amx_rows_bf16(int fmt, const uint8_t *tile, int64_t tile_stride, int ntiles, int ncols,
                                const amx_panel *p, int64_t chunk, int64_t count, float *out, int64_t out_stride) {
    const int64_t nb = p->nb;
    if (!amx_scratch(nb)) return 0;
    const int64_t tbb = tile_block_bytes(fmt);
    const int halves = (ntiles + 1) / 2;
    uint8_t *const bs = tl_amx.b; /* block b, half h: 16 B rows of 64 bytes (pairs of K for 16 weight rows) */
    const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    for (int h = 0; h < halves; h++) {
        const uint8_t *t0 = tile + 2 * h * tile_stride, *t1 = 2 * h + 1 < ntiles ? t0 + tile_stride : NULL;
        if (fmt == FT_Q6K) { /* a super-block of 8 blocks at a time */
            for (int64_t sb = 0; sb < nb / 8; sb++) amx_fill_q6k_bf16(t0, t1, sb, h, bs);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = bs + (b * 2 + h) * 1024;
            if (fmt == FT_Q4K) {
                amx_fill_q4k_bf16(t0, t1, b, dst);
                continue;
            }
            const uint8_t *s0 = t0 + b * tbb, *s1 = t1 ? t1 + b * tbb : NULL;
            const __m128i h0 = _mm_loadu_si128((const __m128i *)s0);
            const __m128i h1 = s1 ? _mm_loadu_si128((const __m128i *)s1) : _mm_setzero_si128();
            const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
            if (fmt == FT_Q8) {
                for (int j = 0; j < 8; j++) { /* K = 4j..4j+3: B rows 2j, 2j + 1 */
                    const __m512i v = amx_chunk16(s0, s1, j);
                    __m512 f[4];
                    for (int q = 0; q < 4; q++)
                        f[q] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * q), 24)), d);
                    amx_pair_row(f[0], f[1], dst + 64 * (2 * j));
                    amx_pair_row(f[2], f[3], dst + 64 * (2 * j + 1));
                }
            } else {
                for (int j = 0; j < 4; j++) { /* low nibbles: K = 8j..8j+3, high: 8j+4..8j+7 → B rows 4j..4j+3 */
                    const __m512i v = amx_chunk16(s0, s1, j);
                    __m512 f[8];
                    for (int q = 0; q < 4; q++) { /* a code c picks c - 8 from the table (vpermps reads 4 bits) */
                        f[q] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * q), lut), d);
                        f[4 + q] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * q + 4), lut), d);
                    }
                    amx_pair_row(f[0], f[1], dst + 64 * (4 * j));
                    amx_pair_row(f[2], f[3], dst + 64 * (4 * j + 1));
                    amx_pair_row(f[4], f[5], dst + 64 * (4 * j + 2));
                    amx_pair_row(f[6], f[7], dst + 64 * (4 * j + 3));
                }
            }
        }
    }
    amx_load_full_tiles(); /* 0-3: C (chunk c / c + 1 x half 0 / 1: 16 tokens x 16 rows fp32); 4, 5: A; 6, 7: B */
    float cbuf[AMX_TOKENS * 16] __attribute__((aligned(64)));
    const int64_t nchunks = (count + AMX_TOKENS - 1) / AMX_TOKENS, cstride = nb * AMX_TOKENS * QK;
    for (int64_t c0 = 0; c0 < nchunks; c0 += 2) {
        const int two = c0 + 1 < nchunks;
        const uint16_t *base = p->bf + (chunk + c0) * cstride; /* block-major: 1 KB tiles */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *at = base + b * AMX_TOKENS * QK;
            _tile_loadd(6, bs + b * 2048, 64);
            _tile_loadd(4, at, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (halves > 1) {
                _tile_loadd(7, bs + b * 2048 + 1024, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two) {
                _tile_loadd(5, at + cstride, 64);
                _tile_dpbf16ps(2, 5, 6);
                if (halves > 1) _tile_dpbf16ps(3, 5, 7);
            }
        }
        for (int q = 0; q < 4; q++) {
            const int c = q >> 1, h = q & 1;
            if ((c && !two) || h >= halves) continue;
            switch (q) {
            case 0: _tile_stored(0, cbuf, 64); break;
            case 1: _tile_stored(1, cbuf, 64); break;
            case 2: _tile_stored(2, cbuf, 64); break;
            default: _tile_stored(3, cbuf, 64); break;
            }
            const int cols = ncols - 16 * h < 16 ? ncols - 16 * h : 16;
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            const int64_t i0 = (c0 + c) * AMX_TOKENS, n = count - i0 < AMX_TOKENS ? count - i0 : AMX_TOKENS;
            for (int m = 0; m < n; m++)
                _mm512_mask_storeu_ps(out + (i0 + m) * out_stride + 16 * h, keep, _mm512_load_ps(cbuf + 16 * m));
        }
    }
    _tile_release();
    atomic_fetch_add_explicit(&amx_calls, 1, memory_order_relaxed);
    return 1;
}

/* out[i * out_stride + j] = row j of the rows starting at tile `tile` (tiles `tile_stride` bytes apart; `ntiles`
 * <= 4 of them, AMX_ROWS rows) . token i's activations (panel chunks from `chunk` on), for i < count and j < ncols
 * (<= 8 * ntiles). Returns 0 (nothing written) when its scratch cannot be allocated: the caller runs the tile
 * kernels. */
FT_AMX static int amx_rows(int fmt, const uint8_t *tile, int64_t tile_stride, int ntiles, int ncols,
                           const amx_panel *p, int64_t chunk, int64_t count, float *out, int64_t out_stride) {
    if (p->bf16) return amx_rows_bf16(fmt, tile, tile_stride, ntiles, ncols, p, chunk, count, out, out_stride);
    for (int h = 0; 2 * h < ntiles; h++) { /* exact mode: 16 rows at a time (its epilogue holds 16 accumulators) */
        const int nt = ntiles - 2 * h < 2 ? ntiles - 2 * h : 2, cols = ncols - 16 * h < 16 ? ncols - 16 * h : 16;
        if (!(fmt == FT_Q6K ? amx_rows16_q6k(tile + 2 * h * tile_stride, tile_stride, nt, cols, p, chunk, count,
                                             out + 16 * h, out_stride)
                            : amx_rows16_int8(fmt, tile + 2 * h * tile_stride, tile_stride, nt, cols, p, chunk, count,
                                              out + 16 * h, out_stride)))
            return 0; /* the caller computes every row again with the tile kernels */
    }
    return 1;
}

/* A slot whose down matmul runs on the bf16 tiles: h[j] = SiLU(h[j]) * h[I + j] for j < I, kept in fp32 for the bf16
 * panel's gather (no int8 tile reads the slot, so its int8 activations are not made); 16 lanes at a time with the
 * polynomial exp512 (each value's bits depend on its place in the row only, as batch invariance needs). */
FT_AMX static void amx_silu_mul(float *h, int64_t I) {
    int64_t j = 0;
    for (; j + 16 <= I; j += 16) {
        const __m512 g = _mm512_loadu_ps(h + j), e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(h + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(h + I + j)));
    }
    for (; j < I; j++) h[j] = h[j] / (1.f + expf(-h[j])) * h[I + j];
}

/* Chunk `k` of a bf16 panel: fp32 rows (src + row * ld, K = k_valid values, zero past it up to nb * 32) of tokens
 * [i0, i0 + n), row = tok ? tok[i] : i; rows n..15 zero. */
FT_AMX static void amx_gather_bf16(const float *src, int64_t ld, int64_t k_valid, const int64_t *tok, int64_t i0,
                                   int64_t n, const amx_panel *p, int64_t k) {
    const int64_t nb = p->nb;
    uint16_t *tiles = p->bf + k * nb * AMX_TOKENS * QK; /* block b of row m at tiles + (b * 16 + m) * 32 */
    for (int64_t m = 0; m < AMX_TOKENS; m++) {
        const float *x = m < n ? src + (tok ? tok[i0 + m] : i0 + m) * ld : NULL;
        for (int64_t b = 0; b < nb; b++) {
            uint16_t *dst = tiles + (b * AMX_TOKENS + m) * QK;
            for (int h = 0; h < 2; h++) {
                const int64_t j = b * QK + 16 * h;
                const __mmask16 mk = !x || j >= k_valid ? 0 : (k_valid - j >= 16 ? 0xffff : (__mmask16)((1u << (k_valid - j)) - 1));
                _mm256_storeu_si256((__m256i *)(dst + 16 * h),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, x ? x + j : NULL)));
            }
        }
    }
}

/* 16-row items computed through AMX since the library loaded. */
int64_t ft_amx_calls(void) { return atomic_load(&amx_calls); }

/* Set the AMX mode (AMX_EXACT, AMX_BF16, AMX_PROMPTS; anything else leaves it) and return the previous one. */
int ft_amx_set_mode(int mode) {
    const int was = amx_mode_now();
    if (mode == AMX_EXACT || mode == AMX_BF16 || mode == AMX_PROMPTS) amx_mode = mode;
    return was;
}

/* Mark the calling thread as running a prompt-only step (1) or not (0); returns the previous mark. */
int ft_amx_prompt_step(int on) {
    const int was = amx_prompt_step;
    amx_prompt_step = on != 0;
    return was;
}

/* Whether this CPU runs the bf16 mode (AMX-BF16 and AVX512-BF16). */
int ft_amx_bf16_supported(void) { return amx_bf16_supported(); }

/* Tokens on one weight from which a bf16-mode call runs the bf16 tiles (<= 0: the default); returns the previous
 * value. */
int64_t ft_amx_set_bf16_min_tokens(int64_t n) {
    int64_t old = amx_bf16_min_tokens;
    amx_bf16_min_tokens = n > 0 ? n : AMX_BF16_MIN_DEFAULT;
    return old;
}

/* Tokens per call from which AMX runs (<= 0: the default); returns the previous value. */
int64_t ft_amx_set_min_tokens(int64_t n) {
    int64_t old = amx_min_tokens;
    amx_min_tokens = n > 0 ? n : AMX_MIN_DEFAULT;
    return old;
}
#else
static inline int amx_takes(int fmt, int64_t count) { (void)fmt; (void)count; return 0; }
static inline void amx_gather(int fmt, const qact *a, const int64_t *tok, int64_t first, int64_t i0, int64_t n,
                              const amx_panel *p, int64_t k) {
    (void)fmt; (void)a; (void)tok; (void)first; (void)i0; (void)n; (void)p; (void)k;
}
static inline int amx_rows(int fmt, const uint8_t *tile, int64_t tile_stride, int ntiles, int ncols,
                           const amx_panel *p, int64_t chunk, int64_t count, float *out, int64_t out_stride) {
    (void)fmt; (void)tile; (void)tile_stride; (void)ntiles; (void)ncols; (void)p; (void)chunk; (void)count;
    (void)out; (void)out_stride;
    return 0;
}
static inline int amx_takes_bf16(int wide, int fmt, int64_t count) { (void)wide; (void)fmt; (void)count; return 0; }
static inline void amx_silu_mul(float *h, int64_t I) { (void)h; (void)I; }
int64_t ft_amx_set_min_tokens(int64_t n) { (void)n; return 0; }
int64_t ft_amx_set_bf16_min_tokens(int64_t n) { (void)n; return 0; }
int64_t ft_amx_calls(void) { return 0; }
static int amx_mode = 2; /* prompts: the default, answered where AMX is not built */
int ft_amx_set_mode(int mode) {
    const int was = amx_mode;
    if (mode >= 0 && mode <= 2) amx_mode = mode;
    return was;
}
int ft_amx_prompt_step(int on) { (void)on; return 0; }
int ft_amx_bf16_supported(void) { return 0; }
static inline int amx_bf16_on(void) { return 0; }
static inline void amx_gather_bf16(const float *src, int64_t ld, int64_t k_valid, const int64_t *tok, int64_t i0,
                                   int64_t n, const amx_panel *p, int64_t k) {
    (void)src; (void)ld; (void)k_valid; (void)tok; (void)i0; (void)n; (void)p; (void)k;
}
#endif

/* Fill panels, one chunk per item: chunk k holds tokens [c_i0[k], c_i0[k] + c_n[k]) (without the arrays:
 * [16k, min(16k + 16, m))) of `a` (row = tok ? tok[i] : i); chunks [0, n_first) go to panel p, the rest (k - n_first)
 * to p2 (a MoE pass's bf16 groups beside its int8 ones). */
typedef struct {
    int fmt;
    const qact *a;
    const int64_t *tok, *c_i0, *c_n;
    int64_t m;
    const amx_panel *p;
    const float *src; /* bf16 panels: the fp32 rows (row stride ld, k values) */
    int64_t ld, k;
    const amx_panel *p2;
    int64_t n_first;
} amx_fill_ctx;

static void amx_fill_item(void *ctx, int64_t k) {
    const amx_fill_ctx *f = (const amx_fill_ctx *)ctx;
    const int64_t i0 = f->c_i0 ? f->c_i0[k] : k * AMX_TOKENS;
    const int64_t n = f->c_n ? f->c_n[k] : (f->m - i0 < AMX_TOKENS ? f->m - i0 : AMX_TOKENS);
    const amx_panel *p = f->p2 && k >= f->n_first ? f->p2 : f->p;
    const int64_t at = f->p2 && k >= f->n_first ? k - f->n_first : k;
    if (p->bf16) amx_gather_bf16(f->src, f->ld, f->k, f->tok, i0, n, p, at);
    else amx_gather(f->fmt, f->a, f->tok, 0, i0, n, p, at);
}

#endif
