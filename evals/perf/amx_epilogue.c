/* What the exact AMX mode's per-block epilogue costs on this CPU (evals/perf/amx_epilogue.py builds and runs this).
 *
 * The exact mode (runtime/kernels/csrc/ft_amx.h) multiplies each 32-value block of int8 activations by a block of
 * weights in one tile product (TDPBSUD, 16 tokens x 16 rows x 32), stores the int32 tile, and applies the block's two
 * scales in fp32 with 16 vector loads, conversions, multiplies and FMAs, so every output is bit-identical to the
 * one-token VNNI kernels. This loop does exactly that over `NB` blocks, and the same loop with parts left out:
 *   full         tile loads + product + store + epilogue reading the stored tile (the kernel's inner loop)
 *   no-readback  the same, the epilogue reading a constant buffer instead of the stored tile
 *   no-store     no tile store; the epilogue reads a buffer no tile writes
 *   tiles        tile loads + product only
 *   epilogue     the epilogue alone (loads, conversions, multiplies, FMAs), no AMX
 * and measures the core clock with a chain of dependent multiplies, so the times print as cycles too.
 * Prints one line per mode: "<mode> <ns per block> <cycles per block>", then "clock <GHz>". Exit 2: no AMX (the
 * kernel refused the tile state). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NB 64
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg;

static int8_t A[NB * 512] __attribute__((aligned(64)));
static uint8_t B[NB * 512] __attribute__((aligned(64)));
static int32_t CONST_C[256] __attribute__((aligned(64)));
static float DW[NB * 16] __attribute__((aligned(64)));
static float DA[NB * 16] __attribute__((aligned(64)));
static volatile float SINK;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

enum { FULL, NO_READBACK, NO_STORE, TILES, EPILOGUE, MODES };
static const char *NAMES[MODES] = {"full", "no-readback", "no-store", "tiles", "epilogue"};

static void store_ring(int e, int32_t *dst) {
    switch (e & 3) {
    case 0: _tile_stored(0, dst, 64); break;
    case 1: _tile_stored(1, dst, 64); break;
    case 2: _tile_stored(2, dst, 64); break;
    default: _tile_stored(3, dst, 64); break;
    }
}

__attribute__((noinline)) static void run(int mode, long iters) {
    int32_t ring[4][256] __attribute__((aligned(64)));
    memset(ring, 0, sizeof ring);
    for (long it = 0; it < iters; it++) {
        __m512 acc[16];
        for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < NB + 2; b++) {
            if (b >= 2 && mode != TILES) { /* block e's epilogue, its tile stored an iteration ago */
                const int e = b - 2;
                const int32_t *cb = mode == FULL ? ring[e & 3] : CONST_C;
                const __m512 dw = _mm512_load_ps(DW + 16 * e);
#pragma GCC unroll 16
                for (int m = 0; m < 16; m++)
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * m)),
                                             _mm512_mul_ps(dw, _mm512_set1_ps(DA[e * 16 + m])), acc[m]);
            }
            if (b < NB && mode != EPILOGUE) {
                switch (b & 3) { /* tile numbers are immediates; A and B double-buffered */
#define STEP(C, TA, TB)                                                                                                \
    _tile_loadd(TA, A + b * 512, 32);                                                                                  \
    _tile_loadd(TB, B + b * 512, 64);                                                                                  \
    _tile_zero(C);                                                                                                     \
    _tile_dpbsud(C, TA, TB);                                                                                           \
    break;
                case 0: STEP(0, 4, 5)
                case 1: STEP(1, 6, 7)
                case 2: STEP(2, 4, 5)
                default: STEP(3, 6, 7)
#undef STEP
                }
            }
            if (b >= 1 && b <= NB && (mode == FULL || mode == NO_READBACK)) store_ring(b - 1, ring[(b - 1) & 3]);
        }
        float s = 0.f;
        for (int m = 0; m < 16; m++) s += _mm512_reduce_add_ps(acc[m]);
        SINK += s;
    }
}

static double clock_ghz(void) {
    long x = 3, n = 50000000;
    double t = now();
    for (long i = 0; i < n; i++) __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
    t = now() - t;
    return 12.0 * n / t / 1e9; /* 4 dependent multiplies of 3 cycles each per iteration */
}

int main(int argc, char **argv) {
    const long iters = argc > 1 ? atol(argv[1]) : 20000;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        puts("no AMX: the kernel refused the tile state");
        return 2;
    }
    tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    c.rows[4] = c.rows[6] = 16;
    c.colsb[4] = c.colsb[6] = 32;
    c.rows[5] = c.rows[7] = 8;
    c.colsb[5] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
    for (int i = 0; i < NB * 512; i++) {
        A[i] = (int8_t)(i * 7);
        B[i] = (uint8_t)(i * 13 & 15);
    }
    for (int i = 0; i < NB * 16; i++) {
        DW[i] = 1e-3f;
        DA[i] = 1e-2f;
    }
    const double ghz = clock_ghz();
    for (int mode = 0; mode < MODES; mode++) {
        run(mode, iters / 10 + 1);
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            const double t = now();
            run(mode, iters);
            const double dt = (now() - t) / ((double)iters * NB);
            best = dt < best ? dt : best;
        }
        printf("%s %.3f %.1f\n", NAMES[mode], best * 1e9, best * 1e9 * ghz);
    }
    printf("clock %.2f\n", ghz);
    _tile_release();
    return 0;
}
