/* Generic inner loops over tile formats, compiled once per instruction set (each table's
 * translation unit instantiates them under its target attribute so the compiler vectorises
 * them). Only inner loops live here: the tile/token drivers are in htp_core.c, written once. */
#ifndef ESTREAM_HTP_GEMM_BODY_H
#define ESTREAM_HTP_GEMM_BODY_H

#include "htp_internal.h"

#define HTP_INLINE static inline __attribute__((always_inline))

/* ---- K-quant tiles (docs/format.md §1): one 32-column sub-block of 32 rows.
 * q4_k-t32r4 (704 B): fp16 d [32] at 0, fp16 dmin [32] at 64, uint8 sc [32] at 128, uint8 m [32]
 *   at 160, then 4 groups of 128 B at 192 with the nibbles in Q4_0 order (byte 4g+b of row r at
 *   192 + 128g + 4r + b: low nibble = column 4g+b, high = column 16+4g+b), values 0..15;
 *   W = (d*sc)*q - dmin*m.
 * q6_k-t32r4 (1152 B): fp16 d [32] at 0, int8 scale pairs at 64 + 2r (columns 0..15, 16..31),
 *   then 8 groups of 128 B at 128 with int8 values -32..31 (column 4g+b of row r at
 *   128 + 128g + 4r + b); W = (d*sc)*q. */
HTP_INLINE void htp_dequant_kq_tile_body(const uint8_t *p, uint32_t fmt, float *panel) {
    if (fmt == HTP_FMT_IQ4_XS_T32R4) { /* (d * sc) * kv[code], llama.cpp's dequantize_row_iq4_xs */
        float s[32];
        for (int r = 0; r < 32; r++) {
            uint16_t h;
            memcpy(&h, p + 2 * r, 2);
            s[r] = htp_f16_to_f32(h) * (float)(int8_t)p[64 + r];
        }
        for (int gi = 0; gi < 4; gi++)
            for (int b = 0; b < 4; b++) {
                float *lo = panel + (4 * gi + b) * 32;
                float *hi = panel + (16 + 4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) {
                    const uint8_t v = p[96 + gi * 128 + r * 4 + b];
                    lo[r] = s[r] * (float)htp_iq4nl_kvalues[v & 15];
                    hi[r] = s[r] * (float)htp_iq4nl_kvalues[v >> 4];
                }
            }
    } else if (fmt == HTP_FMT_MXFP4_T32R4) { /* (the tiles with other than one fp16 scale per row) */
        float s[32];
        for (int r = 0; r < 32; r++) s[r] = htp_e8m0_half(p[r]);
        for (int gi = 0; gi < 4; gi++)
            for (int b = 0; b < 4; b++) {
                float *lo = panel + (4 * gi + b) * 32;
                float *hi = panel + (16 + 4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) {
                    const uint8_t v = p[32 + gi * 128 + r * 4 + b];
                    lo[r] = (float)htp_mxfp4_kvalues[v & 15] * s[r];
                    hi[r] = (float)htp_mxfp4_kvalues[v >> 4] * s[r];
                }
            }
    } else if (fmt == HTP_FMT_Q4_K_T32R4 || fmt == HTP_FMT_Q5_K_T32R4) {
        float s[32], mn[32];
        for (int r = 0; r < 32; r++) {
            uint16_t h, hm;
            memcpy(&h, p + 2 * r, 2);
            memcpy(&hm, p + 64 + 2 * r, 2);
            s[r] = htp_f16_to_f32(h) * (float)p[128 + r];
            mn[r] = htp_f16_to_f32(hm) * (float)p[160 + r];
        }
        for (int gi = 0; gi < 4; gi++)
            for (int b = 0; b < 4; b++) {
                float *lo = panel + (4 * gi + b) * 32;
                float *hi = panel + (16 + 4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) {
                    const uint8_t v = p[192 + gi * 128 + r * 4 + b];
                    uint32_t h = 0; /* q5_k: the fifth bits of the row, bit c = column c */
                    if (fmt == HTP_FMT_Q5_K_T32R4) memcpy(&h, p + 704 + 4 * r, 4);
                    const int cl = 4 * gi + b;
                    lo[r] = s[r] * (float)((v & 15) | (((h >> cl) & 1) << 4)) - mn[r];
                    hi[r] = s[r] * (float)((v >> 4) | (((h >> (cl + 16)) & 1) << 4)) - mn[r];
                }
            }
    } else {
        float s[2][32];
        for (int r = 0; r < 32; r++) {
            uint16_t h;
            memcpy(&h, p + 2 * r, 2);
            const float d = htp_f16_to_f32(h);
            s[0][r] = d * (float)(int8_t)p[64 + 2 * r];
            s[1][r] = d * (float)(int8_t)p[64 + 2 * r + 1];
        }
        for (int gi = 0; gi < 8; gi++)
            for (int b = 0; b < 4; b++) {
                float *col = panel + (4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) col[r] = s[gi >> 2][r] * (float)(int8_t)p[128 + gi * 128 + r * 4 + b];
            }
    }
}

/* The K-quant int8 epilogues: one fp32 sequence per format, which every table (portable, AVX2,
 * AVX-512, NEON, HVX) follows operation for operation, so all give the same bits. Every product
 * that is rounded feeds only a multiplicand of an explicit fused multiply-add, so no compiler
 * contraction (-ffp-contract=fast or on) can change the sequence.
 * Q4_K / Q5_K, per row and 32-block, given the exact int32 dot = sum q*a and the block's
 * activation sum sa: ds = d*sc and dm = dmin*m (exact in fp32: an 11-bit fp16 significand times
 * a 6-bit integer; the SIMD kernels take them once per tile), then
 *     acc = fma((float)dot, ds*da, acc);  acc = fma(-dm, (float)sa*da, acc).
 * Q6_K, given the exact int32 sc0*dot0 + sc1*dot1:  acc = fma((float)dot, d*da, acc).
 * (float)dot is exact (|dot| < 2^24 for all three). HTP_FMAF(a, b, c) = a*b + c rounded once:
 * Hexagon's sffma (Rx += sfmpy(Rs, Rt), fused; the freestanding runtime has no fmaf), elsewhere
 * the compiler's fmaf (one instruction under FMA / NEON, glibc's correctly rounded fmaf on the
 * baseline x86-64 portable table). */
#if defined(__hexagon__)
#define HTP_FMAF(a, b, c) __builtin_HEXAGON_F2_sffma((c), (a), (b))
#else
#define HTP_FMAF(a, b, c) __builtin_fmaf((a), (b), (c))
#endif
HTP_INLINE float htp_q45k_epilogue(float acc, int32_t dot, int32_t sa, float ds, float dm,
                                   float da) {
    const float dsda = ds * da, sada = (float)sa * da;
    acc = HTP_FMAF((float)dot, dsda, acc);
    return HTP_FMAF(-dm, sada, acc);
}
HTP_INLINE float htp_q6k_epilogue(float acc, int32_t dot, float d, float da) {
    const float dda = d * da;
    return HTP_FMAF((float)dot, dda, acc);
}

/* Q4_K tiles x Q8 activations, reference order, any nt. Per row and 32-block: the integer dot
 * of the nibbles with the activations, dot, and the block's activation sum, sa (exact int32);
 * then htp_q45k_epilogue: llama.cpp's vec_dot_q4_K_q8_K rule (d*sc*dot - dmin*m*sa) * da with
 * the activation scale per 32-block instead of per 256, in the one fp32 order all tables share. */
HTP_INLINE void htp_q4k_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t tt = 0; tt < nt; tt++) {
        float acc[32];
        for (int r = 0; r < 32; r++) acc[r] = 0.0f;
        const int8_t *qa = a->q + (size_t)tt * k;
        for (uint32_t j = 0; j < kb; j++) {
            const uint8_t *tile = strip + (size_t)j * HTP_Q4K_TILE_BYTES;
            const int8_t *qb = qa + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            const int32_t sa = a->s[(size_t)tt * kb + j];
            int32_t dot[32];
            for (int r = 0; r < 32; r++) {
                int32_t sacc = 0;
                for (int gi = 0; gi < 4; gi++)
                    for (int b = 0; b < 4; b++) {
                        const uint8_t v = tile[192 + gi * 128 + r * 4 + b];
                        sacc += (int32_t)(v & 15) * qb[4 * gi + b] + (int32_t)(v >> 4) * qb[16 + 4 * gi + b];
                    }
                dot[r] = sacc;
            }
            for (int r = 0; r < 32; r++) {
                uint16_t h, hm;
                memcpy(&h, tile + 2 * r, 2);
                memcpy(&hm, tile + 64 + 2 * r, 2);
                const float ds = htp_f16_to_f32(h) * (float)tile[128 + r];
                const float dm = htp_f16_to_f32(hm) * (float)tile[160 + r];
                acc[r] = htp_q45k_epilogue(acc[r], dot[r], sa, ds, dm, da);
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

/* Q5_K tiles x Q8 activations, reference order, any nt: the Q4_K body with q = nibble + 16 x
 * fifth bit (0..31); q5_k-t32r4 (832 B) is q4_k-t32r4 followed by a fifth group at 704: row r's
 * fifth bits as a little-endian uint32 at 704 + 4r (bit c = column c). Per row and 32-block the
 * exact int32 dot = sum q*a and the block's activation sum sa, then llama.cpp's
 * vec_dot_q5_K_q8_K rule in the shared order (htp_q45k_epilogue). */
HTP_INLINE void htp_q5k_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t tt = 0; tt < nt; tt++) {
        float acc[32];
        for (int r = 0; r < 32; r++) acc[r] = 0.0f;
        const int8_t *qa = a->q + (size_t)tt * k;
        for (uint32_t j = 0; j < kb; j++) {
            const uint8_t *tile = strip + (size_t)j * HTP_Q5K_TILE_BYTES;
            const int8_t *qb = qa + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            const int32_t sa = a->s[(size_t)tt * kb + j];
            int32_t dot[32];
            for (int r = 0; r < 32; r++) {
                uint32_t h;
                memcpy(&h, tile + 704 + 4 * r, 4);
                int32_t sacc = 0;
                for (int gi = 0; gi < 4; gi++)
                    for (int b = 0; b < 4; b++) {
                        const uint8_t v = tile[192 + gi * 128 + r * 4 + b];
                        const int cl = 4 * gi + b;
                        const int32_t ql = (int32_t)((v & 15) | (((h >> cl) & 1) << 4));
                        const int32_t qh = (int32_t)((v >> 4) | (((h >> (cl + 16)) & 1) << 4));
                        sacc += ql * qb[cl] + qh * qb[16 + cl];
                    }
                dot[r] = sacc;
            }
            for (int r = 0; r < 32; r++) {
                uint16_t hd, hm;
                memcpy(&hd, tile + 2 * r, 2);
                memcpy(&hm, tile + 64 + 2 * r, 2);
                const float ds = htp_f16_to_f32(hd) * (float)tile[128 + r];
                const float dm = htp_f16_to_f32(hm) * (float)tile[160 + r];
                acc[r] = htp_q45k_epilogue(acc[r], dot[r], sa, ds, dm, da);
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

/* Q6_K tiles x Q8 activations, reference order, any nt: per row and 32-block the exact integer
 * sc0 * dot(columns 0..15) + sc1 * dot(columns 16..31), times d*da (htp_q6k_epilogue). */
HTP_INLINE void htp_q6k_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t tt = 0; tt < nt; tt++) {
        float acc[32];
        for (int r = 0; r < 32; r++) acc[r] = 0.0f;
        const int8_t *qa = a->q + (size_t)tt * k;
        for (uint32_t j = 0; j < kb; j++) {
            const uint8_t *tile = strip + (size_t)j * HTP_Q6K_TILE_BYTES;
            const int8_t *qb = qa + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            int32_t dot[32];
            for (int r = 0; r < 32; r++) {
                int32_t lo = 0, hi = 0;
                for (int gi = 0; gi < 4; gi++)
                    for (int b = 0; b < 4; b++) {
                        lo += (int32_t)(int8_t)tile[128 + gi * 128 + r * 4 + b] * qb[4 * gi + b];
                        hi += (int32_t)(int8_t)tile[128 + (gi + 4) * 128 + r * 4 + b] * qb[16 + 4 * gi + b];
                    }
                dot[r] = (int32_t)(int8_t)tile[64 + 2 * r] * lo + (int32_t)(int8_t)tile[65 + 2 * r] * hi;
            }
            for (int r = 0; r < 32; r++) {
                uint16_t h;
                memcpy(&h, tile + 2 * r, 2);
                acc[r] = htp_q6k_epilogue(acc[r], dot[r], htp_f16_to_f32(h), da);
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

/* MXFP4 tiles x Q8 activations, reference order, any nt. mxfp4-t32r4 (544 B): uint8 E8M0
 * exponent e [32] at 0, then 4 groups of 128 B at 32 with the FP4 codes in Q4_0 order (byte
 * 4g+b of row r at 32 + 128g + 4r + b: low nibble = column 4g+b, high = column 16+4g+b). Per
 * row and 32-block the exact int32 dot = sum kv[code] * a (kv: the doubled E2M1 values,
 * -12..12), then acc += (float)dot * (e8m0_half(e) * da): llama.cpp's vec_dot_mxfp4_q8_0. The
 * product and the sum are two statements (no fused multiply-add), so every table that keeps
 * this order gives these bits. */
HTP_INLINE void htp_mxfp4_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                     uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t tt = 0; tt < nt; tt++) {
        float acc[32];
        for (int r = 0; r < 32; r++) acc[r] = 0.0f;
        const int8_t *qa = a->q + (size_t)tt * k;
        for (uint32_t j = 0; j < kb; j++) {
            const uint8_t *tile = strip + (size_t)j * HTP_MXFP4_TILE_BYTES;
            const int8_t *qb = qa + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            int32_t dot[32];
            for (int r = 0; r < 32; r++) {
                int32_t sacc = 0;
                for (int gi = 0; gi < 4; gi++)
                    for (int b = 0; b < 4; b++) {
                        const uint8_t v = tile[32 + gi * 128 + r * 4 + b];
                        sacc += (int32_t)htp_mxfp4_kvalues[v & 15] * qb[4 * gi + b] +
                                (int32_t)htp_mxfp4_kvalues[v >> 4] * qb[16 + 4 * gi + b];
                    }
                dot[r] = sacc;
            }
            for (int r = 0; r < 32; r++) {
                const float sc = htp_e8m0_half(tile[r]) * da;
                const float v = (float)dot[r] * sc;
                acc[r] += v;
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

/* A tile's 32 x 32 IQ4_NL codes (Q4_0's nibble order, from `codes`) as their int8 values kv[code],
 * column-major (w[c][r]: the 32 rows of a column side by side, so that the dots below run across
 * rows): decoded once per tile and used for every token (the dots are exact, so the order of
 * tokens and tiles leaves every bit as the per-token reference gives it). */
HTP_INLINE void htp_iq4_codes_decode(const uint8_t *codes, int8_t w[32][32]) {
    for (int r = 0; r < 32; r++)
        for (int gi = 0; gi < 4; gi++)
            for (int b = 0; b < 4; b++) {
                const uint8_t v = codes[gi * 128 + r * 4 + b];
                w[4 * gi + b][r] = htp_iq4nl_kvalues[v & 15];
                w[16 + 4 * gi + b][r] = htp_iq4nl_kvalues[v >> 4];
            }
}
/* The exact int32 dots of a decoded tile's 32 rows (column-major w) with a 32-value block of
 * int8 activations; a loop over rows per column, which compilers vectorize. */
HTP_INLINE void htp_i8_dots32(const int8_t w[32][32], const int8_t *qb, int32_t dot[32]) {
    for (int r = 0; r < 32; r++) dot[r] = 0;
    for (int c = 0; c < 32; c++) {
        const int32_t q = qb[c];
        for (int r = 0; r < 32; r++) dot[r] += (int32_t)w[c][r] * q;
    }
}

/* IQ4_NL / IQ4_XS tiles x Q8 activations (the one driver of both): per row and 32-block
 * acc += (float)(sc * dot) * (d * da) with sc the IQ4_XS row's int8 sub-block scale at
 * `scales_at` (IQ4_NL: none, sc = 1, so (float)dot exactly), d the row's fp16 at 2r and the codes
 * at `codes_at`. The output is the accumulator: 0, then one term per tile in tile order, as a
 * per-token accumulator would add them; each tile is decoded once for all tokens. */
HTP_INLINE void htp_iq4_strip_body(const uint8_t *strip, uint32_t tile_bytes, uint32_t codes_at,
                                   uint32_t scales_at, uint32_t kb, const htp_act_q8 *a,
                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (uint32_t tt = 0; tt < nt; tt++)
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * tile_bytes;
        int8_t w[32][32];
        float d[32];
        int32_t sc[32];
        htp_iq4_codes_decode(tile + codes_at, w);
        for (uint32_t r = 0; r < rows; r++) {
            uint16_t h;
            memcpy(&h, tile + 2 * r, 2);
            d[r] = htp_f16_to_f32(h);
            sc[r] = scales_at ? (int32_t)(int8_t)tile[scales_at + r] : 1;
        }
        for (uint32_t tt = 0; tt < nt; tt++) {
            const int8_t *qb = a->q + (size_t)tt * k + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            float *o = out + (size_t)tt * ldo;
            int32_t dot[32];
            htp_i8_dots32((const int8_t(*)[32])w, qb, dot);
            for (uint32_t r = 0; r < rows; r++) {
                const float dd = d[r] * da;
                const float v = (float)(sc[r] * dot[r]) * dd;
                o[r] += v;
            }
        }
    }
}

/* IQ4_NL tiles: iq4_nl-t32r4 (576 B) is laid as q4_0-t32r4 (fp16 d per row, then the codes in
 * Q4_0's nibble order at 64); dot = sum kv[code] * a (kv: llama.cpp's kvalues_iq4nl,
 * -127..113), acc += (float)dot * (d * da): llama.cpp's vec_dot_iq4_nl_q8_0. */
HTP_INLINE void htp_iq4nl_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                     uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    htp_iq4_strip_body(strip, HTP_Q4_TILE_BYTES, 64, 0, kb, a, nt, out, ldo, rows);
}

/* Q4_1 / Q5_0 / Q5_1 tiles (docs/format.md): q4_1-t32r4 (640 B) = the rows' (d, m) fp16 pairs
 * at 4r, then 4 groups of Q4_0-order nibbles at 128; q5_0-t32r4 (704 B) = fp16 d at 2r, each
 * row's 32 fifth bits as a little-endian uint32 at 64 + 4r (bit c = column c), nibbles at 192;
 * q5_1-t32r4 (768 B) = (d, m) at 4r, fifth bits at 128 + 4r, nibbles at 256. q = nibble + 16 x
 * fifth bit; W = d*q + m (Q4_1, Q5_1) or d*(q - 16) (Q5_0). */
typedef struct htp_aff_layout {
    uint32_t bytes, m, qh, nib; /* tile bytes; has an m; offset of the fifth bits (0: none) and
                                   of the nibbles */
} htp_aff_layout;
HTP_INLINE htp_aff_layout htp_aff_layout_of(uint32_t fmt) {
    if (fmt == HTP_FMT_Q4_1_T32R4) return (htp_aff_layout){HTP_Q41_TILE_BYTES, 1, 0, 128};
    if (fmt == HTP_FMT_Q5_0_T32R4) return (htp_aff_layout){HTP_Q50_TILE_BYTES, 0, 64, 192};
    return (htp_aff_layout){HTP_Q51_TILE_BYTES, 1, 128, 256};
}
/* The 5-bit (or 4-bit) value of column c of row r, and the row's d and m. */
HTP_INLINE int32_t htp_aff_q(const uint8_t *tile, htp_aff_layout L, int r, int c) {
    const uint8_t v = tile[L.nib + 128 * ((c % 16) / 4) + 4 * r + c % 4];
    int32_t q = c < 16 ? (v & 15) : (v >> 4);
    if (L.qh) q |= ((tile[L.qh + 4 * r + c / 8] >> (c % 8)) & 1) << 4;
    return q;
}
HTP_INLINE void htp_aff_dm(const uint8_t *tile, htp_aff_layout L, int r, float *d, float *m) {
    uint16_t h, hm = 0;
    memcpy(&h, tile + (L.m ? 4 * r : 2 * r), 2);
    if (L.m) memcpy(&hm, tile + 4 * r + 2, 2);
    *d = htp_f16_to_f32(h);
    *m = htp_f16_to_f32(hm);
}
HTP_INLINE void htp_dequant_aff_tile(const uint8_t *p, uint32_t fmt, float *panel) {
    const htp_aff_layout L = htp_aff_layout_of(fmt);
    for (int r = 0; r < 32; r++) {
        float d, m;
        htp_aff_dm(p, L, r, &d, &m);
        for (int c = 0; c < 32; c++) {
            const int32_t q = htp_aff_q(p, L, r, c);
            panel[c * 32 + r] = L.m ? d * (float)q + m : d * (float)(q - 16);
        }
    }
}
/* x Q8 activations, reference order, any nt: per row and 32-block the exact int32 dot = sum q*a
 * (Q5_0: sum (q - 16)*a) and the activations' sum sa; then Q5_0: (float)dot * (d*da), llama.cpp's
 * vec_dot_q5_0_q8_0; Q4_1 / Q5_1: (float)dot * (d*da) + (float)sa * (m*da), its
 * vec_dot_q4_1_q8_1 / q5_1 (the activation sum times m). Each product and sum its own
 * statement (no fused multiply-add). */
HTP_INLINE void htp_aff_strip_body(const uint8_t *strip, uint32_t fmt, uint32_t kb,
                                   const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
                                   uint32_t rows) {
    const htp_aff_layout L = htp_aff_layout_of(fmt);
    const uint32_t k = kb * 32;
    /* the output is the accumulator (as in htp_iq4nl_strip_body); q (0..31) decoded once a tile */
    for (uint32_t tt = 0; tt < nt; tt++)
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = 0.0f;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * L.bytes;
        int8_t w[32][32];
        float d[32], m[32];
        for (int r = 0; r < 32; r++) /* all 32 rows: the dots run across them */
            for (int c = 0; c < 32; c++) w[c][r] = (int8_t)htp_aff_q(tile, L, r, c);
        for (uint32_t r = 0; r < rows; r++) htp_aff_dm(tile, L, (int)r, &d[r], &m[r]);
        for (uint32_t tt = 0; tt < nt; tt++) {
            const int8_t *qb = a->q + (size_t)tt * k + 32 * j;
            const float da = a->d[(size_t)tt * kb + j];
            const int32_t sa = a->s[(size_t)tt * kb + j];
            float *o = out + (size_t)tt * ldo;
            int32_t dots[32];
            htp_i8_dots32((const int8_t(*)[32])w, qb, dots);
            for (uint32_t r = 0; r < rows; r++) {
                const int32_t dot = dots[r];
                if (L.m) {
                    const float p1 = (float)dot * (d[r] * da);
                    const float p2 = (float)sa * (m[r] * da);
                    const float v = p1 + p2;
                    o[r] += v;
                } else {
                    const float v = (float)(dot - 16 * sa) * (d[r] * da);
                    o[r] += v;
                }
            }
        }
    }
}

/* IQ4_XS tiles x Q8 activations, reference order, any nt. iq4_xs-t32r4 (608 B): fp16 d per row
 * at 2r, the row's int8 sub-block scale sc = ls - 32 (-32..31) at 64 + r, then the IQ4_NL codes in
 * Q4_0's nibble order at 96 (byte 4g+b of row r at 96 + 128g + 4r + b). Per row and 32-block the
 * exact int32 dot = sum kv[code] * a, then acc += (float)(sc * dot) * (d * da), product then sum:
 * llama.cpp's vec_dot_iq4_xs_q8_K with the activation scale per 32-block instead of per 256
 * (|sc * dot| <= 32 * 127 * 127 * 32 < 2^24: the conversion is exact). */
HTP_INLINE void htp_iq4xs_strip_body(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                     uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    htp_iq4_strip_body(strip, HTP_IQ4XS_TILE_BYTES, 96, 64, kb, a, nt, out, ldo, rows);
}

/* Row r, column c of an f16-t32r4 / bf16-t32r4 tile as fp32 (exact): the 16-bit value at
 * 128 * (c / 2) + 4r + 2 * (c % 2); F16 converted, BF16 the high half of a float32. */
HTP_INLINE float htp_f16t_value(const uint8_t *p, uint32_t fmt, int r, int c) {
    uint16_t h;
    memcpy(&h, p + 128 * (c >> 1) + 4 * r + 2 * (c & 1), 2);
    if (fmt == HTP_FMT_F16_T32R4) return htp_f16_to_f32(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* panel[c*32 + r] = W[row r][col c] for one tile (32 rows, 32 columns). */
HTP_INLINE void htp_dequant_tile_body(const uint8_t *p, uint32_t fmt, float *panel) {
    if (HTP_IS_FLOAT_TILE(fmt)) {
        for (int c = 0; c < 32; c++)
            for (int r = 0; r < 32; r++) panel[c * 32 + r] = htp_f16t_value(p, fmt, r, c);
        return;
    }
    if (fmt == HTP_FMT_Q4_1_T32R4 || fmt == HTP_FMT_Q5_0_T32R4 || fmt == HTP_FMT_Q5_1_T32R4) {
        htp_dequant_aff_tile(p, fmt, panel);
        return;
    }
    if (fmt == HTP_FMT_Q4_K_T32R4 || fmt == HTP_FMT_Q5_K_T32R4 || fmt == HTP_FMT_Q6_K_T32R4 ||
        fmt == HTP_FMT_MXFP4_T32R4 || fmt == HTP_FMT_IQ4_XS_T32R4) {
        htp_dequant_kq_tile_body(p, fmt, panel);
        return;
    }
    float d[32];
    for (int r = 0; r < 32; r++) {
        uint16_t h;
        memcpy(&h, p + 2 * r, 2);
        d[r] = htp_f16_to_f32(h);
    }
    const uint8_t *g = p + 64;
    if (fmt == HTP_FMT_IQ4_NL_T32R4) {
        for (int gi = 0; gi < 4; gi++)
            for (int b = 0; b < 4; b++) {
                float *lo = panel + (4 * gi + b) * 32;
                float *hi = panel + (16 + 4 * gi + b) * 32;
                for (int r = 0; r < 32; r++) {
                    const uint8_t v = g[gi * 128 + r * 4 + b];
                    lo[r] = d[r] * (float)htp_iq4nl_kvalues[v & 15];
                    hi[r] = d[r] * (float)htp_iq4nl_kvalues[v >> 4];
                }
            }
    } else if (fmt == HTP_FMT_Q4_0_T32R4) {
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

/* Reference-order Q8-activation strip kernel (any table can use it), any nt. Per row and block:
 * acc = fma((float)dot, d*da, acc), the fused multiply-add of the SIMD kernels (no compiler
 * contraction decides it), so every table gives the same bits. */
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
                acc[r] = HTP_FMAF((float)dot[r], sc, acc[r]); /* the SIMD kernels' fused step */
            }
        }
        for (uint32_t r = 0; r < rows; r++) out[(size_t)tt * ldo + r] = acc[r];
    }
}

#endif
