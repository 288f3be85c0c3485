/* RMSNorm body, one row after another: each row's sum of squares in double over 8 fixed lanes
 * (column c goes to lane c % 8, the tail past the last full 8 to a ninth sum), the lanes added
 * in one fixed tree, then out = x * inv * w in fp32 (two rounded products). The lanes are a
 * vector of 8 doubles (GCC / clang vector extensions: one zmm under AVX-512, two ymm under AVX2,
 * scalars where there is no double SIMD); a float's square is exact in double, so a fused
 * multiply-add gives the same sums: every instruction set and every split of the rows gives
 * the same bits. */
#ifndef ESTREAM_HTP_NORM_BODY_H
#define ESTREAM_HTP_NORM_BODY_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef double htp_v8d __attribute__((vector_size(64)));
typedef float htp_v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) void htp_rms_rows_body(const float *x,
                                                                    const float *w, uint32_t d,
                                                                    float eps, size_t rows,
                                                                    float *out) {
    for (size_t i = 0; i < rows; i++) {
        const float *xr = x + i * d;
        float *o = out + i * d;
        htp_v8d acc = {0, 0, 0, 0, 0, 0, 0, 0};
        uint32_t col = 0;
        for (; col + 8 <= d; col += 8) {
            htp_v8f v;
            __builtin_memcpy(&v, xr + col, sizeof v);
            const htp_v8d dv = __builtin_convertvector(v, htp_v8d);
            acc += dv * dv;
        }
        double ss = 0.0;
        for (; col < d; col++) ss += (double)xr[col] * xr[col];
        ss += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float inv = (float)(1.0 / sqrt(ss / d + (double)eps));
        if (w)
            for (uint32_t k = 0; k < d; k++) o[k] = xr[k] * inv * w[k];
        else
            for (uint32_t k = 0; k < d; k++) o[k] = xr[k] * inv;
    }
}

#endif
