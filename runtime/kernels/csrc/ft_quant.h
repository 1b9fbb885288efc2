/* Load-time quantization to GGUF Q8_0 / Q4_0 blocks, the same rules as runtime/quant/blocks.py (the reference):
 * q8: d = fp16(absmax / 127), q = round(x / d); q4: d = fp16(m / -8) with m the value of largest magnitude,
 * code = clamp(round(x / d + 8), 0, 15), then (refine) a few shrunken scales and a least-squares refit.
 * Sums run in a different order than torch's, so an exact tie may resolve differently in rare blocks. */
#ifndef FT_QUANT_H
#define FT_QUANT_H

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

#endif
