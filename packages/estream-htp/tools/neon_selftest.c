/* Self-test of the arm64 kernel set against the portable one, for cross builds run under
 * qemu-aarch64 (see tests/test_cross_arm64.py). Exits non-zero on any mismatch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "htp.h"

static uint32_t rng_state = 12345u;
static uint32_t rnd(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}
static float frand(void) { return (float)(rnd() % 20001) / 10000.0f - 1.0f; }

static double rel(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static int check_gemm(uint32_t n, uint32_t k, uint32_t t, uint32_t act) {
    const size_t tiles = (size_t)((n + 31) / 32) * (k / 32);
    uint8_t *w = malloc(tiles * 576);
    for (size_t i = 0; i < tiles; i++) {
        uint8_t *tile = w + i * 576;
        for (int r = 0; r < 32; r++) {
            uint16_t h = (uint16_t)(((rnd() & 1) << 15) | ((8 + rnd() % 6) << 10) | (rnd() & 0x3ff));
            memcpy(tile + 2 * r, &h, 2);
        }
        for (int b = 64; b < 576; b++) tile[b] = (uint8_t)rnd();
    }
    float *x = malloc(sizeof(float) * t * k), *y0 = malloc(sizeof(float) * t * n), *y1 = malloc(sizeof(float) * t * n);
    for (size_t i = 0; i < (size_t)t * k; i++) x[i] = frand();
    int bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        /* ABI v2: one backend per kernel set, operands as registered buffers */
        const htp_backend_desc bd = {HTP_ABI_VERSION, HTP_BACKEND_HOST, 2,
                                     pass ? HTP_SIMD_NEON : HTP_SIMD_PORTABLE, -1, 0, {0, 0}};
        htp_backend *be = NULL;
        if (htp_backend_init(&bd, &be)) return 1;
        float *y = pass ? y1 : y0;
        const htp_buffer_desc bw = {-1, HTP_BUF_READ, 0, tiles * 576, (uint64_t)(uintptr_t)w};
        const htp_buffer_desc bx = {-1, HTP_BUF_READ, 0, sizeof(float) * t * k, (uint64_t)(uintptr_t)x};
        const htp_buffer_desc by = {-1, HTP_BUF_READ | HTP_BUF_WRITE, 0, sizeof(float) * t * n,
                                    (uint64_t)(uintptr_t)y};
        uint32_t iw, ix, iy;
        htp_op_desc op;
        memset(&op, 0, sizeof op);
        op.opcode = HTP_OP_GEMM;
        op.act = act;
        op.n_refs = 3;
        op.p.gemm = (htp_gemm_params){HTP_FMT_Q4_0_T32R4, n, k, t, k, n};
        if (htp_buffer_register(be, &bw, &iw) || htp_buffer_register(be, &bx, &ix) ||
            htp_buffer_register(be, &by, &iy))
            bad = 1;
        op.ref[0].buffer = iw, op.ref[1].buffer = ix, op.ref[2].buffer = iy;
        if (!bad && htp_op_run(be, &op)) bad = 1;
        htp_backend_free(be);
    }
    const double e = rel(y1, y0, (size_t)t * n);
    printf("gemm n=%u k=%u t=%u act=%u: rel %.3g\n", n, k, t, act, e);
    if (!(e <= 1e-6)) bad = 1;
    free(w), free(x), free(y0), free(y1);
    return bad;
}

int main(void) {
    if (htp_simd_best() != HTP_SIMD_NEON) {
        printf("NEON dot-product level not available (best = %u)\n", htp_simd_best());
        return 2;
    }
    int bad = 0;
    const uint32_t shapes[][3] = {{1, 32, 1}, {33, 64, 3}, {100, 96, 7}, {64, 256, 17}, {200, 512, 5}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        for (uint32_t act = 0; act < 2; act++) bad |= check_gemm(shapes[i][0], shapes[i][1], shapes[i][2], act);
    printf(bad ? "FAILED\n" : "OK\n");
    return bad;
}
