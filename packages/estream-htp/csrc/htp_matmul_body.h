/* fp32 matmul body: y[i][j] = sum over kk in order of x[i][kk] * w[kk][j], every product
 * rounded to fp32 before it is added (no fused multiply-add), so every instruction set and
 * backend gives the bits of a sequential fp32 loop. Instantiated per SIMD level: the column
 * block of HTP_MM_NC accumulators per row (4 rows at a time) is vectorised by the compiler
 * and stays in registers over a chunk of HTP_MM_KC values of k; between chunks the partial
 * sums wait in y (a float stored and loaded back is the same float, so the order of the sum
 * is unchanged). Column block outermost, then the k chunk, then the rows: the chunk of w
 * (HTP_MM_KC x 64 floats, 32 KiB) stays in L1 while every row of the range passes over it,
 * where rows outermost streamed the whole of w from the last-level cache for every 4 rows. */
#ifndef ESTREAM_HTP_MATMUL_BODY_H
#define ESTREAM_HTP_MATMUL_BODY_H

#include "htp_internal.h"

/* GCC contracts a*b+c into an FMA across statements (-ffp-contract=fast); this body must not. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#define HTP_NO_CONTRACT __attribute__((optimize("fp-contract=off"))) /* for the instantiations */
#else
#define HTP_NO_CONTRACT /* clang contracts only within one expression (-ffp-contract=on) */
#endif

#define HTP_MM_NT 4  /* rows per register block */
#define HTP_MM_KC 128 /* values of k per chunk */

#define HTP_MM_INLINE static inline __attribute__((always_inline))

/* nt = NT <= HTP_MM_NT rows of x (stride k) times columns [j0, j0 + NC) of w (stride n): the
 * NT x NC accumulators (one fixed-size array per NC, so they stay in registers) are kept over
 * the whole k loop. */
#define HTP_MM_BLOCK(NC)                                                                         \
    HTP_MM_INLINE void htp_mm_block_##NC(const float *x, const float *w, uint32_t k, uint32_t n, \
                                         uint32_t j0, uint32_t k0, uint32_t k1, float *y,        \
                                         const int NT) {                                         \
        float acc[HTP_MM_NT][NC];                                                                \
        for (int u = 0; u < NT; u++)                                                             \
            for (int c = 0; c < NC; c++) acc[u][c] = k0 ? y[(size_t)u * n + j0 + c] : 0.0f;      \
        for (uint32_t kk = k0; kk < k1; kk++) {                                                  \
            const float *wr = w + (size_t)kk * n + j0;                                           \
            for (int u = 0; u < NT; u++) {                                                       \
                const float xv = x[(size_t)u * k + kk];                                          \
                for (int c = 0; c < NC; c++) {                                                   \
                    const float p = xv * wr[c];                                                  \
                    acc[u][c] = acc[u][c] + p;                                                   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int u = 0; u < NT; u++)                                                             \
            for (int c = 0; c < NC; c++) y[(size_t)u * n + j0 + c] = acc[u][c];                  \
    }
HTP_MM_BLOCK(64)
HTP_MM_BLOCK(1)
#undef HTP_MM_BLOCK

/* 8 or 16 columns (routers of 8 or 32 experts): the same sums written with 8-float vectors,
 * which the compiler does not find by itself in loops this short. The weights are loaded and
 * the sums stored through the vector type itself (aligned(4): any float address): a memcpy
 * through an array kept the sums on the stack, a store and a reload per step (~7 G MAC/s). */
typedef float htp_mm_v8 __attribute__((vector_size(32), aligned(4)));
#define HTP_MM_VBLOCK(NC)                                                                        \
    HTP_MM_INLINE void htp_mm_block_##NC(const float *x, const float *w, uint32_t k, uint32_t n, \
                                         uint32_t j0, uint32_t k0, uint32_t k1, float *y,        \
                                         const int NT) {                                         \
        enum { NV = NC / 8 };                                                                    \
        htp_mm_v8 acc[HTP_MM_NT][NV];                                                            \
        for (int u = 0; u < NT; u++)                                                             \
            for (int v = 0; v < NV; v++)                                                         \
                acc[u][v] = k0 ? ((const htp_mm_v8 *)(y + (size_t)u * n + j0))[v] : (htp_mm_v8){0}; \
        for (uint32_t kk = k0; kk < k1; kk++) {                                                  \
            const htp_mm_v8 *wr = (const htp_mm_v8 *)(w + (size_t)kk * n + j0);                  \
            htp_mm_v8 wv[NV];                                                                    \
            for (int v = 0; v < NV; v++) wv[v] = wr[v];                                          \
            for (int u = 0; u < NT; u++) {                                                       \
                const float xv = x[(size_t)u * k + kk];                                          \
                for (int v = 0; v < NV; v++) {                                                   \
                    const htp_mm_v8 p = xv * wv[v];                                              \
                    acc[u][v] = acc[u][v] + p;                                                   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int u = 0; u < NT; u++)                                                             \
            for (int v = 0; v < NV; v++) ((htp_mm_v8 *)(y + (size_t)u * n + j0))[v] = acc[u][v]; \
    }
HTP_MM_VBLOCK(16)
HTP_MM_VBLOCK(8)
#undef HTP_MM_VBLOCK

#define HTP_MM_ROWS(NC)                                                                          \
    switch (nt) {                                                                                \
    case 4: htp_mm_block_##NC(xi, w, k, n, j0, k0, k1, yi, 4); break;                            \
    case 3: htp_mm_block_##NC(xi, w, k, n, j0, k0, k1, yi, 3); break;                            \
    case 2: htp_mm_block_##NC(xi, w, k, n, j0, k0, k1, yi, 2); break;                            \
    default: htp_mm_block_##NC(xi, w, k, n, j0, k0, k1, yi, 1); break;                           \
    }

/* Rows [i0, i1) of y = x @ w (x [t][k], w [k][n], y [t][n]): column blocks of 64, then 16,
 * then 8 (small routers: 8 or 32 experts), then single columns; in each, chunks of k, and in
 * each chunk every row of the range. */
#define HTP_MM_COLS(NC)                                                                          \
    for (uint32_t k0 = 0; k0 < k; k0 += HTP_MM_KC) {                                             \
        const uint32_t k1 = HTP_MIN(k, k0 + HTP_MM_KC);                                          \
        for (uint32_t i = i0; i < i1; i += HTP_MM_NT) {                                          \
            const uint32_t nt = HTP_MIN((uint32_t)HTP_MM_NT, i1 - i);                            \
            const float *xi = x + (size_t)i * k;                                                 \
            float *yi = y + (size_t)i * n;                                                       \
            HTP_MM_ROWS(NC)                                                                      \
        }                                                                                        \
    }
HTP_MM_INLINE void htp_matmul_f32_body(const float *x, const float *w, uint32_t k, uint32_t n,
                                       uint32_t i0, uint32_t i1, float *y) {
    uint32_t j0 = 0;
    for (; j0 + 64 <= n; j0 += 64) HTP_MM_COLS(64)
    for (; j0 + 16 <= n; j0 += 16) HTP_MM_COLS(16)
    for (; j0 + 8 <= n; j0 += 8) HTP_MM_COLS(8)
    for (; j0 < n; j0++) HTP_MM_COLS(1)
}

#undef HTP_MM_COLS
#undef HTP_MM_ROWS

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif
