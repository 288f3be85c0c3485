/* Generic inner loops over tile formats, compiled once per instruction set (each table's
 * translation unit instantiates them under its target attribute so the compiler vectorises
 * them). Only inner loops live here: the tile/token drivers are in htp_core.c, written once. */
#ifndef ESTREAM_HTP_GEMM_BODY_H
#define ESTREAM_HTP_GEMM_BODY_H

#include "htp_internal.h"

#define HTP_INLINE static inline __attribute__((always_inline))

/* panel[c*32 + r] = W[row r][col c] for one tile (32 rows, 32 columns). */
HTP_INLINE void htp_dequant_tile_body(const uint8_t *p, uint32_t fmt, float *panel) {
    float d[32];
    for (int r = 0; r < 32; r++) {
        uint16_t h;
        memcpy(&h, p + 2 * r, 2);
        d[r] = htp_f16_to_f32(h);
    }
    const uint8_t *g = p + 64;
    if (fmt == HTP_FMT_Q4_0_T32R4) {
        for (int gi = 0; gi < 4; gi++) {
            for (int b = 0; b < 4; b++) {
                float *lo = panel + (4 * gi + b) * 32;
                float *hi = panel + (16 + 4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) {
                    uint8_t v = g[gi * 128 + r * 4 + b];
                    lo[r] = d[r] * (float)((int)(v & 15) - 8);
                    hi[r] = d[r] * (float)((int)(v >> 4) - 8);
                }
            }
        }
    } else {
        for (int gi = 0; gi < 8; gi++) {
            for (int b = 0; b < 4; b++) {
                float *col = panel + (4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) col[r] = d[r] * (float)(int8_t)g[gi * 128 + r * 4 + b];
            }
        }
    }
}

/* acc[u][r] for NT tokens over the whole strip panel (k x 32). */
HTP_INLINE void htp_f32_block(const float *panel, uint32_t k, const float *x, uint32_t ldx,
                              float *out, uint32_t ldo, uint32_t rows, const int NT) {
    float acc[4][32];
    for (int u = 0; u < NT; u++)
        for (int r = 0; r < 32; r++) acc[u][r] = 0.0f;
    for (uint32_t c = 0; c < k; c++) {
        const float *pc = panel + (size_t)c * 32;
        for (int u = 0; u < NT; u++) {
            const float xv = x[(size_t)u * ldx + c];
            for (int r = 0; r < 32; r++) acc[u][r] += xv * pc[r];
        }
    }
    for (int u = 0; u < NT; u++)
        for (uint32_t r = 0; r < rows; r++) out[(size_t)u * ldo + r] = acc[u][r];
}

/* Strip kernel over a dequantized panel, nt <= 4 tokens. */
HTP_INLINE void htp_f32_strip_body(const float *panel, uint32_t k, const float *x, uint32_t ldx,
                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    switch (nt) {
    case 4: htp_f32_block(panel, k, x, ldx, out, ldo, rows, 4); break;
    case 3: htp_f32_block(panel, k, x, ldx, out, ldo, rows, 3); break;
    case 2: htp_f32_block(panel, k, x, ldx, out, ldo, rows, 2); break;
    case 1: htp_f32_block(panel, k, x, ldx, out, ldo, rows, 1); break;
    default: break;
    }
}

HTP_INLINE void htp_quantize_row_q8_body(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s) {
    for (uint32_t j = 0; j < k / 32; j++) {
        const float *xb = x + 32 * j;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
        }
        const float dd = amax / 127.0f;
        const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = (int)nearbyintf(xb[i] * id);
            q[32 * j + i] = (int8_t)v;
            sum += v;
        }
        d[j] = dd;
        s[j] = sum;
    }
}

/* Reference-order Q8-activation strip kernel (any table can use it), any nt. */
HTP_INLINE void htp_q8_strip_body(const uint8_t *strip, uint32_t fmt, uint32_t kb,
                                  const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
                                  uint32_t rows) {
    const uint32_t k = kb * 32;
    const size_t tbytes = fmt == HTP_FMT_Q4_0_T32R4 ? HTP_Q4_TILE_BYTES : HTP_Q8_TILE_BYTES;
    for (uint32_t tt = 0; tt < nt; tt++) {
        float acc[32];
        for (int r = 0; r < 32; r++) acc[r] = 0.0f;
        const int8_t *qa = a->q + (size_t)tt * k;
        for (uint32_t j = 0; j < kb; j++) {
            const uint8_t *tile = strip + j * tbytes;
            const int8_t *qb = qa + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            int32_t dot[32];
            if (fmt == HTP_FMT_Q4_0_T32R4) {
                const int32_t s8 = 8 * a->s[(size_t)tt * kb + j];
                for (int r = 0; r < 32; r++) {
                    int32_t sacc = 0;
                    for (int gi = 0; gi < 4; gi++)
                        for (int b = 0; b < 4; b++) {
                            uint8_t v = tile[64 + gi * 128 + r * 4 + b];
                            sacc += (int32_t)(v & 15) * qb[4 * gi + b] + (int32_t)(v >> 4) * qb[16 + 4 * gi + b];
                        }
                    dot[r] = sacc - s8;
                }
            } else {
                for (int r = 0; r < 32; r++) {
                    int32_t sacc = 0;
                    for (int gi = 0; gi < 8; gi++)
                        for (int b = 0; b < 4; b++)
                            sacc += (int32_t)(int8_t)tile[64 + gi * 128 + r * 4 + b] * qb[4 * gi + b];
                    dot[r] = sacc;
                }
            }
            for (int r = 0; r < 32; r++) {
                uint16_t h;
                memcpy(&h, tile + 2 * r, 2);
                const float sc = htp_f16_to_f32(h) * da;
                acc[r] += (float)dot[r] * sc;
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

#endif
