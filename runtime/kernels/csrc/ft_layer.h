/* A decoder layer's decode step (one token, or a speculative row of a few) in one call — its attention half, and
 * its MoE half where the experts allow: what the Python decoder does for a plain GQA layer (runtime/model/layers.py:
 * gqa_attention, model/moe.py: route, the experts' one fused ft_moe call) with the same kernels in the same order,
 * so the result is bitwise the one the op-by-op path gives, without ~20 Python-level ops and allocations per layer.
 *
 *   xn = rms_norm(h, norm_in)                              ft_rms_norm
 *   q, k, v = xn @ Wq^T (+bq), xn @ Wk^T (+bk), xn @ Wv^T   ft_gemm_f32_parts (one hand-out to the pool); weights
 *                                                          in the kernels' tiles (dense_quant, a GGUF's blocks):
 *                                                          ft_linear each, or once over q|k|v back to back
 *   q, k = rms_norm per head (qk_norm)                      ft_rms_norm over rows of Dh
 *   q, k = rope(q), rope(k)                                 ft_rope
 *   cache row pos = k, v (narrowed to the cache's type)     fp16: clamped to +-65504, both rounded to nearest even
 *   att = attention over the keys [lo, pos]                 ft_attn_queries_kv (lo: sliding window / chunk)
 *   h += att @ Wo^T (+bo)                                   ft_gemm_f32 (tiles: ft_linear, then + bo)
 *   x = rms_norm(h, norm_out)                               ft_rms_norm (the FFN's input)
 *   logits = x @ Wr^T (+br)   (a MoE layer: the router)     ft_gemm_f32
 *   ids, weights = route(logits)  (experts given)           ft_route (softmax/top-k as model/moe.py's route)
 *   h += moe(x, ids, weights)                               ft_moe
 *
 * Without the experts (they live on other tiers, or the layer has shared experts, biases, ...) the rest of the FFN
 * half stays with the caller, which gets x and the logits. */
#ifndef FT_LAYER_H
#define FT_LAYER_H

typedef struct {
    int64_t d, h, hkv, dh, dv; /* hidden, query heads, kv heads, q/k head width, v head width */
    int64_t rot;               /* rotated channels per head (0: no rotary embedding) */
    int64_t window, chunk;     /* sliding window / attention chunk in keys (0: none) */
    int32_t rope_half;         /* rotate pairs (i, i + R/2) (else (2i, 2i + 1)) */
    int32_t qk_norm;           /* 1: RMSNorm of each q and k head (weights [Dh]) before the rotation */
    float eps, scale;
    const float *norm_in, *wq, *wk, *wv, *bq, *bk, *bv, *q_norm, *k_norm, *wo, *bo, *norm_out, *sinks;
    const float *router, *router_bias; /* [E, D], [E] (router NULL: no router) */
    int64_t experts;
    /* the routed experts in the kernels' formats (w13 NULL: the caller runs the FFN) and the routing (ft_route) */
    const uint8_t *w13, *w2;
    int64_t w13_stride, w2_stride, inter, top_k;
    int32_t fmt13, fmt2, route_mode, route_norm;
    float route_norm_eps, route_scaling;
    /* Dense projections in the kernels' tiles (runtime/kernels/dense.py's QuantLinear): the format code of wq / wk /
     * wv / wo (they then point at packed tiles), or -1 for fp32 rows. q, k and v are all fp32 or all tiles.
     * qkv_joined: their tiles lie back to back in one format (dense.py's FusedRows, no biases): one ft_linear over
     * the nq + nk + nv rows from wq, as the op-by-op path makes. */
    int32_t fmt_q, fmt_k, fmt_v, fmt_o, qkv_joined;
} ft_attn_layer;

/* Top-k routing of rows of router logits [T, E] → ids [T, K], weights [T, K] (what model/moe.py's route computes
 * for these modes; it calls this too, so prefill and decode choose alike):
 *   mode 0: softmax over the E logits, the K best scores (ties: the lower id first), with `norm` divided by their
 *           sum (+ norm_eps);
 *   mode 1: the K best logits, softmax over those K.
 * Then times `scaling`. Softmax in fp32: max, expf(x - max), one sum in id order. Returns 0, -2 bad arguments. */
int ft_route(const float *logits, int64_t t, int64_t e, int64_t k, int mode, int norm, float norm_eps,
             float scaling, int64_t *ids, float *weights) {
    if (t < 0 || e < 1 || k < 1 || k > e || mode < 0 || mode > 1) return -2;
    for (int64_t r = 0; r < t; r++) {
        const float *z = logits + r * e;
        int64_t *id = ids + r * k;
        float *w = weights + r * k;
        float top = z[0];
        for (int64_t j = 1; j < e; j++) top = z[j] > top ? z[j] : top;
        float sum = 0.f;
        if (mode == 0)
            for (int64_t j = 0; j < e; j++) sum += expf(z[j] - top);
        for (int64_t a = 0; a < k; a++) { /* selection: K is small (<= 16 in every model we load) */
            int64_t best = -1;
            for (int64_t j = 0; j < e; j++) {
                int taken = 0;
                for (int64_t b = 0; b < a; b++) taken |= id[b] == j;
                if (!taken && (best < 0 || z[j] > z[best])) best = j;
            }
            id[a] = best;
        }
        if (mode == 0) {
            float picked = 0.f;
            for (int64_t a = 0; a < k; a++) {
                w[a] = expf(z[id[a]] - top) / sum;
                picked += w[a];
            }
            if (norm)
                for (int64_t a = 0; a < k; a++) w[a] = w[a] / (picked + norm_eps);
        } else {
            const float m = z[id[0]];
            float s2 = 0.f;
            for (int64_t a = 0; a < k; a++) s2 += expf(z[id[a]] - m);
            for (int64_t a = 0; a < k; a++) w[a] = expf(z[id[a]] - m) / s2;
        }
        if (scaling != 1.f)
            for (int64_t a = 0; a < k; a++) w[a] = w[a] * scaling;
    }
    return 0;
}

/* Scratch values ft_attn_step uses per token of a step (the caller's buffer, allocated once per layer shape). */
int64_t ft_attn_step_work(const ft_attn_layer *L) {
    return 2 * L->d + 2 * L->h * L->dh + 2 * L->hkv * L->dh + L->hkv * L->dv + L->h * L->dv +
           (L->qkv_joined ? L->h * L->dh + L->hkv * L->dh + L->hkv * L->dv : 0);
}

/* y[t, n] = x[t, k] @ W^T (+ b): fp32 rows (fmt < 0) through ft_gemm_f32, tiles through ft_linear and then the bias
 * added in fp32 (QuantLinear's order). Returns 0 or -1 (out of memory). */
static int step_linear(int fmt, const float *w, int64_t n, int64_t k, const float *x, int64_t t, const float *b,
                       float *y) {
    if (fmt < 0) return ft_gemm_f32(w, NULL, n, k, x, t, b, y) ? -1 : 0;
    if (ft_linear(fmt, (const uint8_t *)w, n, k, x, t, y)) return -1;
    if (b)
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < n; j++) y[i * n + j] += b[j];
    return 0;
}

/* IEEE half of x, rounded to nearest even (what torch's fp32 -> fp16 cast gives; x already clamped to the range) */
static uint16_t f32_to_f16_rne(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u)); /* inf / nan */
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past the largest half */
    if (mag < 0x38800000u) {                                  /* a subnormal half (or zero) */
        if (mag < 0x33000000u) return (uint16_t)sign;          /* below half the smallest subnormal: +-0 */
        const uint32_t e = mag >> 23, m = (mag & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14..24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((mag >> 13) - (112u << 10)) & 0xffffu; /* rebias the exponent 127 -> 15 */
    const uint32_t rem = mag & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static uint16_t f32_to_bf16_rne(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* nan: torch's canonical quiet nan */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define FT_F16_MAX 65504.0f
#define FT_F8_MAX 448.0f

/* fp32 -> float8 e4m3fn, rounded to nearest even: torch's cast (c10's fp8e4m3fn_from_fp32_value), so a cache row the
 * fused step writes holds the bits the pool's torch write gives. |x| >= 480 (and NaN) -> the NaN code; the pool and
 * kv_store clamp to +-448 first. */
static inline uint8_t f32_to_f8_rne(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= (1087u << 20)) {
        r = 0x7f;
    } else if (u < (121u << 23)) { /* below 2^-6: subnormal (or zero), rounded by an fp32 add */
        const uint32_t denorm = 141u << 23;
        float f, dm;
        memcpy(&f, &u, 4);
        memcpy(&dm, &denorm, 4);
        f += dm;
        memcpy(&u, &f, 4);
        r = (uint8_t)(u - denorm);
    } else {
        const uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        r = (uint8_t)(u >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

static void kv_store(const float *src, int64_t n, void *dst, int kv_type) {
    if (kv_type == FT_KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (kv_type == FT_KV_F16) {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            const float x = src[i];
            o[i] = f32_to_f16_rne(x > FT_F16_MAX ? FT_F16_MAX : x < -FT_F16_MAX ? -FT_F16_MAX : x);
        }
    } else if (kv_type == FT_KV_F8) {
        uint8_t *o = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            const float x = src[i];
            o[i] = f32_to_f8_rne(x > FT_F8_MAX ? FT_F8_MAX : x < -FT_F8_MAX ? -FT_F8_MAX : x);
        }
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16_rne(src[i]);
    }
}

/* The cache write of the fused step, for tests: n fp32 values to kv_type elements at dst (-1: unknown type). */
int ft_kv_store(const float *src, int64_t n, void *dst, int kv_type) {
    if (kv_type < FT_KV_F32 || kv_type > FT_KV_F8 || n < 0) return -1;
    kv_store(src, n, dst, kv_type);
    return 0;
}

/* Rows a step may carry: a decode token, or a speculative row of a token and its drafts (GEMV_MAX_M). */
#define FT_STEP_MAX_T 8

/* t consecutive tokens of one sequence (positions pos .. pos + t - 1: a decode step, t = 1, or a verify row of
 * speculative decoding) through the attention half of layer L (see the top of the file). h [t, D] is updated in
 * place (the residual), x [t, D] receives the FFN's normed input (norm_out NULL: h itself). k_cache / v_cache point
 * at the sequence's position 0 (rows k_stride / v_stride elements apart, heads contiguous, element type kv_type);
 * token j's row is written at pos + j and it attends rows lo..pos + j (causal). cos / sin [t, rot / 2] are the tokens'
 * rotary table rows; logits [t, E] receive the router's logits (a layer with a router); with the experts and ids
 * (not NULL), ids / weights [t, K] receive the routing and h the FFN's output too. Every kernel here gives a row the
 * same bits whatever the other rows (batch invariance), so a row of t tokens is bitwise t decode steps.
 * work: t * ft_attn_step_work(L) floats. Returns 0, -1 out of memory, -2 bad arguments. */
int ft_attn_step(const ft_attn_layer *L, int64_t t, float *h, float *x, const float *cos, const float *sin,
                 void *k_cache, void *v_cache, int kv_type, int64_t k_stride, int64_t v_stride, int64_t pos,
                 float *work, float *logits, int64_t *ids, float *weights) {
    if (!L || pos < 0 || t < 1 || t > FT_STEP_MAX_T || L->h % L->hkv ||
        kv_type < FT_KV_F32 || kv_type > FT_KV_F8)
        return -2;
    const int64_t d = L->d, nq = L->h * L->dh, nk = L->hkv * L->dh, nv = L->hkv * L->dv;
    float *xn = work, *q = xn + t * d, *q2 = q + t * nq, *k = q2 + t * nq, *k2 = k + t * nk, *v = k2 + t * nk,
          *att = v + t * nv, *o = att + t * L->h * L->dv, *qkv = o + t * d;
    ft_rms_norm(h, L->norm_in, t, d, L->eps, xn);
    const float *w[3] = {L->wq, L->wk, L->wv}, *b[3] = {L->bq, L->bk, L->bv};
    const int64_t n[3] = {nq, nk, nv};
    const int fmt[3] = {L->fmt_q, L->fmt_k, L->fmt_v};
    float *y[3] = {q, k, v};
    if (L->fmt_q < 0) {
        if (L->fmt_k >= 0 || L->fmt_v >= 0) return -2;
        if (ft_gemm_f32_parts(3, w, n, d, xn, t, b, y)) return -2;
    } else if (L->qkv_joined) { /* one product over q|k|v's rows, split per token */
        const int64_t all = nq + nk + nv;
        if (L->bq || L->bk || L->bv) return -2;
        if (ft_linear(L->fmt_q, (const uint8_t *)L->wq, all, d, xn, t, qkv)) return -1;
        for (int64_t j = 0; j < t; j++)
            for (int64_t p = 0, at = 0; p < 3; at += n[p], p++)
                memcpy(y[p] + j * n[p], qkv + j * all + at, sizeof(float) * (size_t)n[p]);
    } else {
        for (int p = 0; p < 3; p++) {
            if (fmt[p] < 0) return -2;
            if (step_linear(fmt[p], w[p], n[p], d, xn, t, b[p], y[p])) return -1;
        }
    }
    if (L->qk_norm) {
        ft_rms_norm(q, L->q_norm, t * L->h, L->dh, L->eps, q2);
        ft_rms_norm(k, L->k_norm, t * L->hkv, L->dh, L->eps, k2);
        float *s = q; q = q2; q2 = s;
        s = k; k = k2; k2 = s;
    }
    if (L->rot > 0) {
        ft_rope(q, t, L->h, L->dh, L->rot, cos, sin, L->rope_half, q2);
        ft_rope(k, t, L->hkv, L->dh, L->rot, cos, sin, L->rope_half, k2);
        q = q2;
        k = k2;
    }
    const size_t es = kv_elsize(kv_type);
    int64_t lo[FT_STEP_MAX_T], hi[FT_STEP_MAX_T], from = 0;
    for (int64_t j = 0; j < t; j++) {
        const int64_t p = pos + j;
        kv_store(k + j * nk, nk, (char *)k_cache + (size_t)(p * k_stride) * es, kv_type);
        kv_store(v + j * nv, nv, (char *)v_cache + (size_t)(p * v_stride) * es, kv_type);
        hi[j] = p + 1;
        lo[j] = 0;
        if (L->window > 0 && hi[j] - L->window > lo[j]) lo[j] = hi[j] - L->window;
        if (L->chunk > 0 && p / L->chunk * L->chunk > lo[j]) lo[j] = p / L->chunk * L->chunk;
        from |= lo[j];
    }
    int rc = t == 1 && from == 0
                 ? ft_attn_decode_kv(q, k_cache, v_cache, kv_type, hi[0], L->h, L->hkv, L->dh, L->dv, k_stride,
                                     v_stride, L->scale, L->sinks, att)
                 : ft_attn_queries_kv(q, t, k_cache, v_cache, kv_type, lo, hi, L->h, L->hkv, L->dh, L->dv, k_stride,
                                      v_stride, L->scale, L->sinks, att);
    if (rc) return -1;
    if (step_linear(L->fmt_o, L->wo, d, L->h * L->dv, att, t, L->bo, o)) return -1;
    for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + o[i];
    if (L->norm_out)
        ft_rms_norm(h, L->norm_out, t, d, L->eps, x);
    else
        memcpy(x, h, sizeof(float) * (size_t)(t * d));
    if (L->router && ft_gemm_f32(L->router, NULL, L->experts, d, x, t, L->router_bias, logits)) return -1;
    if (!L->router || !L->w13 || !ids) return 0;
    if (ft_route(logits, t, L->experts, L->top_k, L->route_mode, L->route_norm, L->route_norm_eps, L->route_scaling,
                 ids, weights))
        return -2;
    rc = ft_moe(L->fmt13, L->fmt2, L->w13, L->w13_stride, L->w2, L->w2_stride, L->experts, d, L->inter, x, t, ids,
                weights, L->top_k, o);
    if (rc) return rc == -2 ? -2 : -1;
    for (int64_t i = 0; i < t * d; i++) h[i] = h[i] + o[i];
    return 0;
}

/* n consecutive layers of one step in one call: ft_attn_step for layer j with the j-th entry of each array (k_cache,
 * v_cache, strides, rotary rows, x, work, logits, ids, weights), one after another on the same h — what n calls
 * give, without a trip back to the caller between layers (whose Python then runs with caches a layer's weights just
 * streamed through). Every layer must run its FFN in the call (experts and ids given). Returns 0, or the failing
 * layer's code (*done: the layers that completed). */
int ft_attn_steps(int64_t n, const ft_attn_layer *const *L, int64_t t, float *h, float *const *x,
                  const float *const *cos, const float *const *sin, void *const *k_cache, void *const *v_cache,
                  int kv_type, const int64_t *k_stride, const int64_t *v_stride, int64_t pos, float *const *work,
                  float *const *logits, int64_t *const *ids, float *const *weights, int64_t *done) {
    *done = 0;
    for (int64_t j = 0; j < n; j++) {
        if (!L[j]->w13 || !L[j]->router || !ids[j]) return -2;
        const int rc = ft_attn_step(L[j], t, h, x[j], cos[j], sin[j], k_cache[j], v_cache[j], kv_type, k_stride[j],
                                    v_stride[j], pos, work[j], logits[j], ids[j], weights[j]);
        if (rc) return rc;
        *done = j + 1;
    }
    return 0;
}

#endif
