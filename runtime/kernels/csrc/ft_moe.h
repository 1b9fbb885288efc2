/* One fused MoE layer step (included once, by ft_kernels.c): route slots to experts, gate|up for every routed
 * (token, expert) slot, SiLU(gate) * up quantized to int8, down per slot, weighted sum per token. Each phase is one
 * parallel-for whose items stream one expert's rows (the hardware prefetcher sees a few long streams). */
#ifndef FT_MOE_H
#define FT_MOE_H

/* ---------------------------------------------------------------- public: one fused MoE layer step */

typedef struct {
    int fmt, fmt2; /* gate|up's format, down's (a Q4_K_M file: Q4_K gate/up, Q6_K down) */
    tile_dot_fn dot, dot2;
    tile_dot4_fn dot4, dot4_2;
    const uint8_t *w13, *w2;
    int64_t w13_stride, w2_stride, D, I, nbD, nbI, n13, chunks13;
    int64_t n_groups;
    const int64_t *g_expert, *g_start; /* group g = one active expert: slots [g_start[g], g_start[g+1]) */
    const int64_t *s_token;
    const float *s_weight;
    qact qx, qa; /* qa: rows of the current pass's slots (slot s at row s - s_base) */
    const float *x; /* [T, D] the tokens' activations */
    uint8_t *x_int8; /* per token: its int8 row of x is made (some slot of it runs off the bf16 tiles) */
    float *h;   /* [pass slots, n13] gate|up outputs (n13 = 2I padded to tiles) */
    float *y;   /* [pass slots, nD] down outputs per slot (nD = D padded to tiles) */
    int64_t nD, chunks2, n_slots;
    int64_t *t_start, *t_slots; /* token t's slots, ascending: t_slots[t_start[t] .. t_start[t+1]) */
    int64_t *t_next;            /* token t's first slot not yet added to out (advances pass by pass) */
    int64_t g_base, s_base, s_end; /* the current pass: groups from g_base, slots [s_base, s_end) */
    float *out; /* [T, D] */
    int64_t *g_chunk;    /* AMX: group g's first chunk in its gate|up panel, -1 where the tile kernels run it */
    int64_t *g_chunk2;   /* the same for down */
    uint8_t *g_wide;     /* bit 0: group g's gate|up panel is px16 (bf16 tiles), bit 1: its down panel is pa16 */
    amx_panel px, pa;    /* the pass's activations gathered for AMX: gate|up's (x), down's (SiLU(gate) * up) */
    amx_panel px16, pa16; /* the same for the groups on bf16 tiles (bf16 mode, enough tokens: amx_takes_bf16) */
    uint8_t *s_wide;     /* per slot of the pass: its down matmul runs on the bf16 tiles (SiLU(gate) * up stays in h) */
    int64_t rows_item;   /* weight rows per gate|up / down work item: ROWS_PER_ITEM, AMX_ROWS where AMX may run */
} moe_ctx;

static void moe_gate_up_item(void *p, int64_t item) {
    const moe_ctx *c = (const moe_ctx *)p;
    int64_t g = c->g_base + item / c->chunks13, chunk = item % c->chunks13;
    const uint8_t *base = c->w13 + c->g_expert[g] * c->w13_stride;
    int64_t tile_stride = c->nbD * tile_block_bytes(c->fmt), ntiles = c->n13 / TR;
    int64_t t0 = chunk * (c->rows_item / TR), t1 = t0 + c->rows_item / TR;
    if (t1 > ntiles) t1 = ntiles;
    const int64_t s0 = c->g_start[g], n = c->g_start[g + 1] - s0;
    if (c->g_chunk[g] >= 0 &&
        amx_rows(c->fmt, base + t0 * tile_stride, tile_stride, (int)(t1 - t0), (int)(TR * (t1 - t0)),
                 c->g_wide[g] & 1 ? &c->px16 : &c->px, c->g_chunk[g], n, c->h + (s0 - c->s_base) * c->n13 + t0 * TR,
                 c->n13))
        return;
    for (int64_t t = t0; t < t1; t++)
        dot_rows(c->dot, c->dot4, base + t * tile_stride, c->nbD, &c->qx, c->s_token + s0, 0, n,
                 c->h + (s0 - c->s_base) * c->n13 + t * TR, c->n13);
}

static void moe_quant_x_item(void *p, int64_t t) { /* token t's int8 row of x, where a tile kernel reads it */
    const moe_ctx *c = (const moe_ctx *)p;
    if (c->x_int8[t])
        quantize_row(c->x + t * c->D, c->D, c->nbD, c->qx.q + t * c->nbD * QK, c->qx.d + t * c->nbD,
                     c->qx.s + t * c->nbD);
}

static void moe_act_item(void *p, int64_t s) { /* s: a row of the pass (slot s_base + s) */
    const moe_ctx *c = (const moe_ctx *)p;
    float *h = c->h + s * c->n13;
    if (c->s_wide[s]) { /* read by the bf16 tiles' gather, in fp32: no int8 activations */
        amx_silu_mul(h, c->I);
        return;
    }
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

/* item = (group, chunk of output rows): y[s, rows] for the group's slots, streaming one expert's rows like
 * gate_up does (a row-chunk loop over all experts would jump between E short streams and starve the prefetcher) */
static void moe_down_item(void *p, int64_t item) {
    const moe_ctx *c = (const moe_ctx *)p;
    int64_t g = c->g_base + item / c->chunks2, chunk = item % c->chunks2;
    const uint8_t *base = c->w2 + c->g_expert[g] * c->w2_stride;
    int64_t tile_stride = c->nbI * tile_block_bytes(c->fmt2), ntiles = c->nD / TR;
    int64_t t0 = chunk * (c->rows_item / TR), t1 = t0 + c->rows_item / TR;
    if (t1 > ntiles) t1 = ntiles;
    const int64_t s0 = c->g_start[g], n = c->g_start[g + 1] - s0;
    if (c->g_chunk2[g] >= 0 &&
        amx_rows(c->fmt2, base + t0 * tile_stride, tile_stride, (int)(t1 - t0), (int)(TR * (t1 - t0)),
                 c->g_wide[g] & 2 ? &c->pa16 : &c->pa, c->g_chunk2[g], n, c->y + (s0 - c->s_base) * c->nD + t0 * TR,
                 c->nD))
        return;
    for (int64_t t = t0; t < t1; t++)
        dot_rows(c->dot2, c->dot4_2, base + t * tile_stride, c->nbI, &c->qa, NULL, s0 - c->s_base, n,
                 c->y + (s0 - c->s_base) * c->nD + t * TR, c->nD);
}

/* out[t, :] += weight * y[s, :] over t's slots in the current pass, in slot order; item = one token. Passes run in
 * ascending slot order, so each token's sum is added up in the same order as in one pass over all slots. */
static void moe_combine_item(void *p, int64_t t) {
    const moe_ctx *c = (const moe_ctx *)p;
    float *o = c->out + t * c->D;
    int64_t k = c->t_next[t];
    for (; k < c->t_start[t + 1] && c->t_slots[k] < c->s_end; k++) {
        const int64_t s = c->t_slots[k];
        const float w = c->s_weight[s], *y = c->y + (s - c->s_base) * c->nD;
        for (int64_t j = 0; j < c->D; j++) o[j] += w * y[j];
    }
    c->t_next[t] = k;
}

/* Scratch of the calling thread, kept between calls (a decode step makes one ft_moe call per layer, and its routing
 * tables and activations are a few KB): grown when a call needs more, up to FT_MOE_KEEP bytes; a bigger need (a long
 * prefill) is allocated for that call and freed. Two arenas: the routing tables are sized before the slot count S
 * is known, the work buffers after. */
#define FT_MOE_KEEP ((size_t)16 << 20)

/* Bytes of per-slot work buffers (gate|up outputs, down outputs, int8 activations) one pass may hold: a long prefill
 * chunk's slots (T x top-k: 4,096 for 512 tokens of top-8, ~60 MiB at hidden 2048) run in passes of whole experts,
 * so a step's working memory stays bounded (the memory budget's step reserve counts on it). */
#define FT_MOE_PASS_BYTES ((size_t)12 << 20)
static size_t moe_pass_bytes = FT_MOE_PASS_BYTES;

/* Set the per-pass work-buffer bytes (0: the default); returns the previous value. For tests: any value gives the
 * same results bit for bit. */
size_t ft_moe_set_pass_bytes(size_t bytes) {
    size_t old = moe_pass_bytes;
    moe_pass_bytes = bytes ? bytes : FT_MOE_PASS_BYTES;
    return old;
}

typedef struct {
    uint8_t *buf;
    size_t cap;
} moe_arena;

static _Thread_local moe_arena tl_moe_index, tl_moe_work;

static size_t moe_lines(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* `bytes` of 64-byte aligned scratch; *owned is set when the caller must free it. NULL when out of memory. */
static uint8_t *moe_scratch(moe_arena *a, size_t bytes, uint8_t **owned) {
    *owned = NULL;
    bytes = moe_lines(bytes ? bytes : 64);
    if (bytes > FT_MOE_KEEP) return *owned = (uint8_t *)aligned_alloc(64, bytes);
    if (bytes > a->cap) {
        free(a->buf);
        a->buf = (uint8_t *)aligned_alloc(64, bytes);
        a->cap = a->buf ? bytes : 0;
    }
    return a->buf;
}

/* the next `bytes` of a scratch buffer, in whole cache lines (no two buffers share a line workers write) */
static void *moe_carve(uint8_t **at, size_t bytes) {
    void *p = *at;
    *at += moe_lines(bytes);
    return p;
}

/* One matmul's AMX chunks over groups [g0, g1) on one kind of panel (on_bf16: the bf16 tiles, else the int8 ones):
 * each such group's first chunk index into chunk[g] (-1 for a group the tile kernels run; groups of the other
 * kind are left as they are), its panel's kind into bit `bit` of kind[g], and its 16-token chunks (first slot, count)
 * appended to i0 / cn. Returns the chunks planned. */
static int64_t moe_plan_chunks(int fmt, int bf16_call, const int64_t *g_start, int64_t g0, int64_t g1, int on_bf16,
                               int64_t *chunk, uint8_t *kind, int bit, int64_t *i0, int64_t *cn) {
    int64_t k = 0;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n = g_start[g + 1] - g_start[g];
        const int on16 = amx_takes_bf16(bf16_call, fmt, n);
        if (!on_bf16) {
            chunk[g] = -1;
            kind[g] = (uint8_t)(on16 ? kind[g] | bit : kind[g] & ~bit);
        }
        if (!amx_takes(fmt, n) || on16 != on_bf16) continue;
        chunk[g] = k;
        for (int64_t i = 0; i < n; i += AMX_TOKENS, k++) {
            i0[k] = g_start[g] + i;
            cn[k] = n - i < AMX_TOKENS ? n - i : AMX_TOKENS;
        }
    }
    return k;
}

/* out[T, D] = sum_k wts[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; ids < 0 are skipped.
 * Expert e's repacked gate|up weight [2I, D] (format fmt) starts at w13 + e * w13_stride, its down weight [D, I]
 * (format fmt2) at w2 + e * w2_stride. Returns 0, -1 on allocation failure, -2 on an expert id >= E. */
int ft_moe(int fmt, int fmt2, const uint8_t *w13, int64_t w13_stride, const uint8_t *w2, int64_t w2_stride, int64_t E,
           int64_t D, int64_t I, const float *x, int64_t T, const int64_t *ids, const float *wts, int64_t KT,
           float *out) {
    moe_ctx c;
    memset(&c, 0, sizeof c);
    memset(out, 0, sizeof(float) * (size_t)(T * D));
    const size_t TK = (size_t)(T * KT + 1);
    uint8_t *own_index = NULL, *own_work = NULL;
    uint8_t *at = moe_scratch(&tl_moe_index, moe_lines(8 * ((size_t)E + 1)) * 4 + moe_lines(8 * ((size_t)E + 2)) +
                              moe_lines((size_t)E + 1) + moe_lines(8 * TK) + moe_lines(4 * TK), &own_index);
    int rc = 0;
    if (!at) return -1;
    int64_t *count = (int64_t *)moe_carve(&at, 8 * ((size_t)E + 1));
    int64_t *g_expert = (int64_t *)moe_carve(&at, 8 * ((size_t)E + 1));
    int64_t *g_chunk = (int64_t *)moe_carve(&at, 8 * ((size_t)E + 1));
    int64_t *g_chunk2 = (int64_t *)moe_carve(&at, 8 * ((size_t)E + 1));
    uint8_t *g_wide = (uint8_t *)moe_carve(&at, (size_t)E + 1);
    int64_t *g_start = (int64_t *)moe_carve(&at, 8 * ((size_t)E + 2));
    int64_t *s_token = (int64_t *)moe_carve(&at, 8 * TK);
    float *s_weight = (float *)moe_carve(&at, 4 * TK);
    memset(count, 0, 8 * ((size_t)E + 1));
    for (int64_t i = 0; i < T * KT; i++) {
        if (ids[i] < 0) continue;
        if (ids[i] >= E) { rc = -2; goto done; }
        count[ids[i]]++;
    }
    int64_t G = 0, S = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!count[e]) continue;
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
    c.fmt2 = fmt2;
    c.dot = pick_tile_dot(fmt);
    c.dot4 = pick_tile_dot4(fmt);
    c.dot2 = pick_tile_dot(fmt2);
    c.dot4_2 = pick_tile_dot4(fmt2);
    c.w13 = w13; c.w2 = w2; c.w13_stride = w13_stride; c.w2_stride = w2_stride;
    c.D = D; c.I = I; c.nbD = (D + QK - 1) / QK; c.nbI = (I + QK - 1) / QK;
    c.n13 = (2 * I + TR - 1) / TR * TR;
    const int amx13 = amx_takes(fmt, 1 << 30), amx2 = amx_takes(fmt2, 1 << 30); /* formats AMX may run here */
    c.rows_item = amx13 || amx2 ? AMX_ROWS : ROWS_PER_ITEM;
    c.chunks13 = (c.n13 + c.rows_item - 1) / c.rows_item;
    c.n_groups = G; c.g_expert = g_expert; c.g_start = g_start; c.s_token = s_token; c.s_weight = s_weight;
    c.out = out;
    c.nD = (D + TR - 1) / TR * TR;
    c.chunks2 = (c.nD + c.rows_item - 1) / c.rows_item;
    c.n_slots = S;
    c.g_chunk = g_chunk;
    c.g_chunk2 = g_chunk2;
    c.g_wide = g_wide;
    {
        /* AMX groups (enough tokens on one expert) also hold their tokens' activations gathered, 16 rows per chunk
         * (amx_panel): padded rows of either matmul's panel, sharing one buffer */
        const int64_t nbP = c.nbD > c.nbI ? c.nbD : c.nbI;
        const size_t per_pad = amx13 || amx2 ? amx_chunk_bytes(nbP) / AMX_TOKENS : 0;
#define MOE_PADDED(n) ((amx_takes(fmt, (n)) || amx_takes(fmt2, (n))) ? ((n) + AMX_TOKENS - 1) / AMX_TOKENS * AMX_TOKENS : 0)
        /* slots per pass: whole experts, up to moe_pass_bytes of work buffers (at least the biggest expert) */
        const size_t per_slot = 4 * (size_t)c.n13 + 4 * (size_t)c.nD + (size_t)(c.nbI * QK) + 8 * (size_t)c.nbI;
        int64_t cap = (int64_t)(moe_pass_bytes / (per_slot + per_pad)), pass_slots = 0, cap_pad = cap, all_pad = 0;
        for (int64_t g = 0; g < G; g++) {
            int64_t n = g_start[g + 1] - g_start[g];
            if (n > cap) cap = n;
            if (MOE_PADDED(n) > cap_pad) cap_pad = MOE_PADDED(n);
            all_pad += MOE_PADDED(n);
        }
        if (cap > S) cap = S;
        if (cap_pad > all_pad) cap_pad = all_pad;
        const int64_t max_chunks = cap_pad / AMX_TOKENS + 1;
        const size_t t1 = 8 * ((size_t)T + 1), s1 = 8 * ((size_t)S + 1);
        const size_t hq = 4 * (size_t)(cap * c.n13), yq = 4 * (size_t)(cap * c.nD);
        const size_t xq = (size_t)(T * c.nbD * QK), xb = 4 * (size_t)(T * c.nbD + 1);
        const size_t aq = (size_t)(cap * c.nbI * QK), ab = 4 * (size_t)(cap * c.nbI + 1);
        const size_t pq = per_pad ? amx_chunk_bytes(nbP) * (size_t)max_chunks : 0, cq = 8 * (size_t)max_chunks;
        uint8_t *w = moe_scratch(&tl_moe_work, 3 * moe_lines(t1) + moe_lines(s1) + moe_lines(hq) + moe_lines(yq) +
                                 moe_lines(xq) + 2 * moe_lines(xb) + moe_lines(aq) + 2 * moe_lines(ab) +
                                 moe_lines(pq) + 4 * moe_lines(cq) + moe_lines((size_t)cap), &own_work);
        if (!w) { rc = -1; goto done; }
        c.t_start = (int64_t *)moe_carve(&w, t1);
        int64_t *cursor = (int64_t *)moe_carve(&w, t1);
        c.t_next = (int64_t *)moe_carve(&w, t1);
        c.t_slots = (int64_t *)moe_carve(&w, s1);
        c.h = (float *)moe_carve(&w, hq);
        c.y = (float *)moe_carve(&w, yq);
        c.qx.nb = c.nbD;
        c.qx.q = (int8_t *)moe_carve(&w, xq);
        c.qx.d = (float *)moe_carve(&w, xb);
        c.qx.s = (float *)moe_carve(&w, xb);
        c.qa.nb = c.nbI;
        c.qa.q = (int8_t *)moe_carve(&w, aq);
        c.qa.d = (float *)moe_carve(&w, ab);
        c.qa.s = (float *)moe_carve(&w, ab);
        uint8_t *panel = (uint8_t *)moe_carve(&w, pq);
        /* chunk lists of a pass, per matmul: its int8 panel's chunks, then its bf16 panel's */
        int64_t *c_i0 = (int64_t *)moe_carve(&w, cq), *c_n = (int64_t *)moe_carve(&w, cq);
        int64_t *d_i0 = (int64_t *)moe_carve(&w, cq), *d_n = (int64_t *)moe_carve(&w, cq);
        c.s_wide = (uint8_t *)moe_carve(&w, (size_t)cap);
        /* bf16 mode (asked here, on the calling thread: a prompt step's mark is the caller's) for the groups with
         * enough tokens whose format has a dequantizing B fill (q4, q8); the rest run exact (amx_takes_bf16) */
        const int wide = per_pad && amx_bf16_on();
        memset(c.t_start, 0, t1);
        for (int64_t s = 0; s < S; s++) c.t_start[s_token[s] + 1]++;
        for (int64_t t = 0; t < T; t++) c.t_start[t + 1] += c.t_start[t];
        memcpy(cursor, c.t_start, t1);
        memcpy(c.t_next, c.t_start, t1);
        for (int64_t s = 0; s < S; s++) c.t_slots[cursor[s_token[s]]++] = s;
        /* x's int8 rows, for the tokens with a slot off the bf16 tiles (those read x in fp32), on the pool */
        c.x = x;
        c.x_int8 = (uint8_t *)cursor; /* cursor's bytes are free again: a flag per token */
        memset(c.x_int8, 0, (size_t)T);
        for (int64_t g = 0; g < G; g++)
            if (!amx_takes_bf16(wide, fmt, g_start[g + 1] - g_start[g]))
                for (int64_t s = g_start[g]; s < g_start[g + 1]; s++) c.x_int8[s_token[s]] = 1;
        if (T >= 64) ft_parallel_for(moe_quant_x_item, &c, T); /* a prefill chunk: ~1 us a token */
        else for (int64_t t = 0; t < T; t++) moe_quant_x_item(&c, t);
        for (int64_t g0 = 0; g0 < G;) { /* one pass: groups [g0, g1), slots [s_base, s_end) */
            int64_t g1 = g0 + 1, padded = MOE_PADDED(g_start[g0 + 1] - g_start[g0]);
            while (g1 < G && g_start[g1 + 1] - g_start[g0] <= cap &&
                   padded + MOE_PADDED(g_start[g1 + 1] - g_start[g1]) <= cap_pad)
                padded += MOE_PADDED(g_start[g1 + 1] - g_start[g1]), g1++;
            c.g_base = g0;
            c.s_base = g_start[g0];
            c.s_end = g_start[g1];
            pass_slots = c.s_end - c.s_base;
            /* chunks of the AMX groups: gate|up's panels hold x's rows of their tokens, down's their slot rows;
             * each matmul's int8 panel, then its bf16 panel, in the one panel buffer (down's after gate|up's ran) */
            const int64_t n8 = moe_plan_chunks(fmt, wide, g_start, g0, g1, 0, g_chunk, g_wide, 1, c_i0, c_n);
            const int64_t n16 = moe_plan_chunks(fmt, wide, g_start, g0, g1, 1, g_chunk, g_wide, 1, c_i0 + n8,
                                                c_n + n8);
            const int64_t m8 = moe_plan_chunks(fmt2, wide, g_start, g0, g1, 0, g_chunk2, g_wide, 2, d_i0, d_n);
            const int64_t m16 = moe_plan_chunks(fmt2, wide, g_start, g0, g1, 1, g_chunk2, g_wide, 2, d_i0 + m8,
                                                d_n + m8);
            for (int64_t g = g0; g < g1; g++) /* the slots whose down runs on the bf16 tiles */
                memset(c.s_wide + g_start[g] - c.s_base, (g_wide[g] & 2) && g_chunk2[g] >= 0,
                       (size_t)(g_start[g + 1] - g_start[g]));
            amx_panel_at(&c.px, panel, n8, c.nbD);
            amx_panel_at(&c.px16, panel + amx_chunk_bytes(nbP) * (size_t)n8, n16, c.nbD);
            c.px16.bf16 = 1;
            if (n8 + n16) {
                amx_fill_ctx f = {fmt, &c.qx, s_token, c_i0, c_n, 0, &c.px, x, D, D, &c.px16, n8};
                ft_parallel_for(amx_fill_item, &f, n8 + n16);
            }
            ft_parallel_for(moe_gate_up_item, &c, (g1 - g0) * c.chunks13);
            if (pass_slots >= 8) ft_parallel_for(moe_act_item, &c, pass_slots);
            else for (int64_t s = 0; s < pass_slots; s++) moe_act_item(&c, s);
            amx_panel_at(&c.pa, panel, m8, c.nbI);
            amx_panel_at(&c.pa16, panel + amx_chunk_bytes(nbP) * (size_t)m8, m16, c.nbI);
            c.pa16.bf16 = 1;
            if (m8 + m16) {
                for (int64_t k = 0; k < m8 + m16; k++) d_i0[k] -= c.s_base; /* down's rows: slots of the pass */
                amx_fill_ctx f = {fmt2, &c.qa, NULL, d_i0, d_n, 0, &c.pa, c.h, c.n13, I, &c.pa16, m8};
                ft_parallel_for(amx_fill_item, &f, m8 + m16);
            }
            ft_parallel_for(moe_down_item, &c, (g1 - g0) * c.chunks2);
            if (T >= 4) ft_parallel_for(moe_combine_item, &c, T);
            else for (int64_t t = 0; t < T; t++) moe_combine_item(&c, t);
            g0 = g1;
        }
#undef MOE_PADDED
    }
done:
    free(own_index);
    free(own_work);
    return rc;
}

#endif
