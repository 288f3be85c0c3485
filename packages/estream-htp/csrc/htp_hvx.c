/* Hexagon HVX inner-loop table (128-byte vectors, v66+ integer HVX).
 *
 * Q4_0 tiles x int8 activations, on the tiles as stored (q4_0-t32r4, docs/contracts.md section 1):
 * a 128-byte group of a tile holds 4 bytes for each of the 32 rows, i.e. one HVX vector whose
 * 32-bit lanes are the rows. Its low nibbles are columns 4g..4g+3 and its high nibbles columns
 * 16+4g..16+4g+3 of the 32-column block, so
 *     lanes += vrmpy(group & 0x0f, 4 activation bytes of cols 4g..)      (Vx.w += vrmpy(Vu.ub, Rt.b))
 *     lanes += vrmpy((group >> 4) & 0x0f, 4 activation bytes of cols 16+4g..)
 * eight vrmpy per tile and token give the 32 rows' sums of nibble x activation, and
 * sum - 8 * (sum of the block's activations) is the Q4_0 dot product: exactly the int32 values
 * of the portable kernel. The nibble vectors of a tile are split once and reused for every token.
 *
 * Activation quantisation: the block maximum |x| is found in HVX integer arithmetic (clear the
 * sign bits; non-negative floats order as their bit patterns, so vmax.w over the lanes and four
 * rotations), the scale and the rounding of x / scale stay in float.
 *
 * Floating point (the scales' f16 -> f32, scale x scale, the fp32 accumulation across blocks,
 * the rounding of activations) is scalar Hexagon float here, in the portable kernel's operation
 * order, so results are bit-identical to the host's. HTP_HVX_FLOAT is the one switch a device
 * build flips to replace those parts by qf32/hf HVX code (v68+; QEMU 7.2 does not emulate HVX
 * float, so that code is not written here and selecting it is a compile error).
 *
 * Q8_0 tiles (eight groups of signed bytes) use the same vrmpy with the sign bits flipped, and
 * the other weight formats (Q4_K, Q5_K, Q6_K; IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1, MXFP4) the same
 * scheme with their own integer operands and the portable bodies' scalar epilogues (below). */
#include "htp_gemm_body.h"

#ifdef HTP_HVX
#include <hvx_hexagon_protos.h>

#ifndef HTP_HVX_FLOAT
#define HTP_HVX_FLOAT 0
#endif
#if HTP_HVX_FLOAT
#error "HTP_HVX_FLOAT=1 selects qf32/hf HVX float code for a device build; it is not implemented here"
#endif

typedef int32_t hvx_vec __attribute__((__vector_size__(128), __aligned__(128)));
typedef int32_t hvx_uvec __attribute__((__vector_size__(128), __aligned__(1))); /* vmemu */

#define HVX_Q4_NT 64

/* the int32 Q4_0 x Q8 dot products of one tile's 32 rows with one activation block, given as
 * eight 4-byte words (w[i] = bytes 4i..4i+3) */
static inline hvx_vec hvx_q4_dot(const hvx_vec lo[4], const hvx_vec hi[4], const int32_t *w, int32_t s) {
    hvx_vec acc = Q6_Vw_vrmpy_VubRb(lo[0], w[0]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, hi[0], w[4]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, lo[1], w[1]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, hi[1], w[5]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, lo[2], w[2]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, hi[2], w[6]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, lo[3], w[3]);
    acc = Q6_Vw_vrmpyacc_VwVubRb(acc, hi[3], w[7]);
    return Q6_Vw_vsub_VwVw(acc, Q6_V_vsplat_R(8 * s));
}

/* The activation block's eight 4-byte words (w[i] = bytes 4i..4i+3) as vrmpy's scalar operands:
 * read in place (eight memw) when the rows are 4-byte aligned, else copied to `wu`. */
static inline const int32_t *hvx_act_words(const int8_t *qb, int aligned, int32_t wu[8]) {
    return aligned ? (const int32_t *)(const void *)qb : (const int32_t *)memcpy(wu, qb, 32);
}

/* The strips' outputs: rows 0..rows-1 of each of the nt tokens' fp32 accumulators. */
static inline void hvx_store(const float acc[][32], uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    for (uint32_t u = 0; u < nt; u++)
        for (uint32_t r = 0; r < rows; r++) out[(size_t)u * ldo + r] = acc[u][r];
}

/* The 32 row scales of a tile, f16 -> f32: a branch-free pass for normal numbers and zeros
 * (bits = sign | ((h & 0x7fff) << 13) + (112 << 23)), redone with the general conversion when a
 * tile holds a subnormal, an infinity or a NaN. Same values as htp_f16_to_f32. */
static inline void hvx_f16_scales(const uint8_t *tile, float dr[32]) {
    uint32_t special = 0;
    for (int r = 0; r < 32; r++) {
        const uint32_t h = (uint32_t)tile[2 * r] | ((uint32_t)tile[2 * r + 1] << 8);
        const uint32_t mag = h & 0x7fffu, e = mag >> 10;
        special |= (e == 31u) | ((e == 0u) & (mag != 0u));
        const uint32_t bits = ((h & 0x8000u) << 16) | (mag ? (mag << 13) + (112u << 23) : 0u);
        memcpy(&dr[r], &bits, 4);
    }
    if (special) {
        for (int r = 0; r < 32; r++) {
            uint16_t h;
            memcpy(&h, tile + 2 * r, 2);
            dr[r] = htp_f16_to_f32(h);
        }
    }
}

__attribute__((noinline)) void htp_hvx_q4q8_strip(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                  uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    float acc[HVX_Q4_NT][32];
    int32_t dot[32] __attribute__((aligned(128)));
    memset(acc, 0, sizeof(float) * 32 * nt);
    const hvx_vec m4 = Q6_V_vsplat_R(0x0f0f0f0f);
    const int aligned = ((uintptr_t)a->q & 3) == 0; /* k is a multiple of 32 */
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q4_TILE_BYTES;
        hvx_vec lo[4], hi[4];
        for (int g = 0; g < 4; g++) {
            const hvx_vec v = (hvx_vec) * (const hvx_uvec *)(tile + 64 + 128 * g);
            lo[g] = Q6_V_vand_VV(v, m4);
            hi[g] = Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(v, 4), m4);
        }
        float dr[32]; /* HTP_HVX_FLOAT: scalar */
        hvx_f16_scales(tile, dr);
        for (uint32_t u = 0; u < nt; u++) {
            const int8_t *qb = a->q + (size_t)u * k + 32 * j;
            int32_t wu[8];
            const int32_t *w = hvx_act_words(qb, aligned, wu);
            *(hvx_vec *)dot = hvx_q4_dot(lo, hi, w, a->s[(size_t)u * kb + j]);
            const float da = a->d[(size_t)u * kb + j]; /* HTP_HVX_FLOAT: scalar */
            float *ac = acc[u];
            for (int r = 0; r < 32; r++) ac[r] = HTP_FMAF((float)dot[r], dr[r] * da, ac[r]);
        }
    }
    hvx_store(acc, nt, out, ldo, rows);
}

/* Q8_0 tiles x int8 activations: a group's bytes are signed, vrmpy wants unsigned weights, so
 * the sign bit is flipped (w ^ 0x80 = w + 128 as an unsigned byte) and 128 * (sum of the
 * block's activations) subtracted: the same int32 dot products as the portable kernel. */
__attribute__((noinline)) void htp_hvx_q8q8_strip(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                  uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    float acc[HVX_Q4_NT][32];
    int32_t dot[32] __attribute__((aligned(128)));
    memset(acc, 0, sizeof(float) * 32 * nt);
    const hvx_vec flip = Q6_V_vsplat_R((int32_t)0x80808080);
    const int aligned = ((uintptr_t)a->q & 3) == 0;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q8_TILE_BYTES;
        hvx_vec gv[8];
        for (int g = 0; g < 8; g++) gv[g] = Q6_V_vxor_VV((hvx_vec) * (const hvx_uvec *)(tile + 64 + 128 * g), flip);
        float dr[32]; /* HTP_HVX_FLOAT: scalar */
        hvx_f16_scales(tile, dr);
        for (uint32_t u = 0; u < nt; u++) {
            const int8_t *qb = a->q + (size_t)u * k + 32 * j;
            int32_t wu[8];
            const int32_t *w = hvx_act_words(qb, aligned, wu);
            hvx_vec d = Q6_Vw_vrmpy_VubRb(gv[0], w[0]);
            for (int g = 1; g < 8; g++) d = Q6_Vw_vrmpyacc_VwVubRb(d, gv[g], w[g]);
            *(hvx_vec *)dot = Q6_Vw_vsub_VwVw(d, Q6_V_vsplat_R(128 * a->s[(size_t)u * kb + j]));
            const float da = a->d[(size_t)u * kb + j]; /* HTP_HVX_FLOAT: scalar */
            float *ac = acc[u];
            for (int r = 0; r < 32; r++) ac[r] = HTP_FMAF((float)dot[r], dr[r] * da, ac[r]);
        }
    }
    hvx_store(acc, nt, out, ldo, rows);
}

/* Q4_K / Q5_K tiles x int8 activations: the Q4_0 kernel's scheme on the nibbles at byte 192
 * (values 0..15, vrmpy's unsigned operand as they are, sums from 0), Q5_K's fifth bits added
 * (row r's word at 704 + 4r is one vector whose lanes are the rows: hvx_fifth moves the bits of
 * a group's 4 columns to bit 4 of the lane's 4 bytes); nibble vectors and row scales made once
 * per tile, then per token eight vrmpy and the shared scalar epilogue htp_q45k_epilogue per row
 * (ds = d·sc and dm = dmin·m exact, as in the portable body): the portable bits. */
static inline hvx_vec hvx_fifth(hvx_vec h, int first) {
    const hvx_vec x = Q6_V_vand_VV(Q6_Vuw_vlsr_VuwR(h, first), Q6_V_vsplat_R(0xf));
    hvx_vec y = Q6_V_vor_VV(Q6_Vw_vasl_VwR(x, 4), Q6_Vw_vasl_VwR(x, 11)); /* bit b -> 8b + 4 */
    y = Q6_V_vor_VV(y, Q6_V_vor_VV(Q6_Vw_vasl_VwR(x, 18), Q6_Vw_vasl_VwR(x, 25)));
    return Q6_V_vand_VV(y, Q6_V_vsplat_R(0x10101010));
}

static inline __attribute__((always_inline)) void hvx_q45k_strip(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int q5) {
    const uint32_t k = kb * 32;
    float acc[HVX_Q4_NT][32];
    int32_t dot[32] __attribute__((aligned(128)));
    memset(acc, 0, sizeof(float) * 32 * nt);
    const hvx_vec m4 = Q6_V_vsplat_R(0x0f0f0f0f);
    const int aligned = ((uintptr_t)a->q & 3) == 0;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * (q5 ? HTP_Q5K_TILE_BYTES : HTP_Q4K_TILE_BYTES);
        hvx_vec lo[4], hi[4];
        const hvx_vec h = q5 ? (hvx_vec) * (const hvx_uvec *)(tile + 704) : Q6_V_vsplat_R(0);
        for (int g = 0; g < 4; g++) {
            const hvx_vec v = (hvx_vec) * (const hvx_uvec *)(tile + 192 + 128 * g);
            lo[g] = Q6_V_vand_VV(v, m4);
            hi[g] = Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(v, 4), m4);
            if (q5) {
                lo[g] = Q6_V_vor_VV(lo[g], hvx_fifth(h, 4 * g));
                hi[g] = Q6_V_vor_VV(hi[g], hvx_fifth(h, 16 + 4 * g));
            }
        }
        float ds[32], dm[32]; /* HTP_HVX_FLOAT: scalar */
        hvx_f16_scales(tile, ds);
        hvx_f16_scales(tile + 64, dm);
        for (int r = 0; r < 32; r++) {
            ds[r] *= (float)tile[128 + r];
            dm[r] *= (float)tile[160 + r];
        }
        for (uint32_t u = 0; u < nt; u++) {
            const int8_t *qb = a->q + (size_t)u * k + 32 * j;
            int32_t wu[8];
            const int32_t *w = hvx_act_words(qb, aligned, wu);
            hvx_vec d = Q6_Vw_vrmpy_VubRb(lo[0], w[0]);
            for (int g = 0; g < 4; g++) {
                if (g) d = Q6_Vw_vrmpyacc_VwVubRb(d, lo[g], w[g]);
                d = Q6_Vw_vrmpyacc_VwVubRb(d, hi[g], w[4 + g]);
            }
            *(hvx_vec *)dot = d;
            const float da = a->d[(size_t)u * kb + j]; /* HTP_HVX_FLOAT: scalar */
            const int32_t sa = a->s[(size_t)u * kb + j];
            float *ac = acc[u];
            for (int r = 0; r < 32; r++) ac[r] = htp_q45k_epilogue(ac[r], dot[r], sa, ds[r], dm[r], da);
        }
    }
    hvx_store(acc, nt, out, ldo, rows);
}
__attribute__((noinline)) void htp_hvx_q4kq8_strip(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    hvx_q45k_strip(strip, kb, a, nt, out, ldo, rows, 0);
}
__attribute__((noinline)) void htp_hvx_q5kq8_strip(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    hvx_q45k_strip(strip, kb, a, nt, out, ldo, rows, 1);
}

/* Q6_K tiles x int8 activations: the signed values (-32..31) + 32 as vrmpy's unsigned operand,
 * the two halves' sums (columns 0..15 from groups 0..3, 16..31 from 4..7) started at -32 x the
 * half's activation sum (htp_act_q8.z where the op made it), then per row the exact int32
 * sc0 * lo + sc1 * hi and htp_q6k_epilogue, scalar: the portable bits. */
__attribute__((noinline)) void htp_hvx_q6kq8_strip(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                   uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    float acc[HVX_Q4_NT][32];
    int32_t dl[32] __attribute__((aligned(128))), dh[32] __attribute__((aligned(128)));
    memset(acc, 0, sizeof(float) * 32 * nt);
    const hvx_vec b32 = Q6_V_vsplat_R(0x20202020);
    const int aligned = ((uintptr_t)a->q & 3) == 0;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q6K_TILE_BYTES;
        hvx_vec gv[8];
        for (int g = 0; g < 8; g++)
            gv[g] = Q6_Vb_vadd_VbVb((hvx_vec) * (const hvx_uvec *)(tile + 128 + 128 * g), b32);
        float dr[32]; /* HTP_HVX_FLOAT: scalar */
        hvx_f16_scales(tile, dr);
        for (uint32_t u = 0; u < nt; u++) {
            const int8_t *qb = a->q + (size_t)u * k + 32 * j;
            int32_t wu[8], z[2];
            const int32_t *w = hvx_act_words(qb, aligned, wu);
            if (a->z) {
                z[0] = a->z[((size_t)u * kb + j) * 2], z[1] = a->z[((size_t)u * kb + j) * 2 + 1];
            } else {
                htp_q8_q6k_seeds(qb, 1, z);
            }
            hvx_vec l = Q6_V_vsplat_R(z[0]), hh = Q6_V_vsplat_R(z[1]);
            for (int g = 0; g < 4; g++) {
                l = Q6_Vw_vrmpyacc_VwVubRb(l, gv[g], w[g]);
                hh = Q6_Vw_vrmpyacc_VwVubRb(hh, gv[4 + g], w[4 + g]);
            }
            *(hvx_vec *)dl = l;
            *(hvx_vec *)dh = hh;
            const float da = a->d[(size_t)u * kb + j]; /* HTP_HVX_FLOAT: scalar */
            float *ac = acc[u];
            for (int r = 0; r < 32; r++) {
                const int32_t dot = (int32_t)(int8_t)tile[64 + 2 * r] * dl[r] + (int32_t)(int8_t)tile[65 + 2 * r] * dh[r];
                ac[r] = htp_q6k_epilogue(ac[r], dot, dr[r], da);
            }
        }
    }
    hvx_store(acc, nt, out, ldo, rows);
}

/* IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 (K: the LQ_* kind, htp_internal.h) and MXFP4 (K = HX_MX)
 * tiles x int8 activations, the Q4_0 kernel's scheme: per tile the codes' values as vrmpy's
 * unsigned operand, made once and used for every token (Q4_1: the nibbles; Q5_0 / Q5_1: plus 16 x
 * the fifth bit, hvx_fifth; IQ4 and MXFP4: kv[code] + 128 by a 16-way compare and select, the
 * sums starting at -128 x the block's activation sum), eight vrmpy per token, then the portable
 * body's scalar epilogue row by row, each product and sum its own statement (the executor is
 * built with -ffp-contract=off): the portable bits. */
#define HX_MX 5
static inline hvx_vec hvx_lut16(hvx_vec nib, const hvx_vec tab[16]) {
    hvx_vec r = tab[0];
    for (int c = 1; c < 16; c++) r = Q6_V_vmux_QVV(Q6_Q_vcmp_eq_VbVb(nib, Q6_Vb_vsplat_R(c)), tab[c], r);
    return r;
}

static inline __attribute__((always_inline)) void hvx_lq_strip(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int K) {
    const int lut = K == HX_MX || LQ_IQ4(K);
    const size_t tbytes = K == HX_MX ? HTP_MXFP4_TILE_BYTES : LQ_BYTES(K);
    const uint32_t nib = K == HX_MX ? 32 : LQ_NIB(K);
    const uint32_t k = kb * 32;
    float acc[HVX_Q4_NT][32];
    int32_t dot[32] __attribute__((aligned(128)));
    memset(acc, 0, sizeof(float) * 32 * nt);
    const hvx_vec m4 = Q6_V_vsplat_R(0x0f0f0f0f);
    hvx_vec tab[16];
    for (int c = 0; c < 16; c++) {
        const int8_t kv = K == HX_MX ? htp_mxfp4_kvalues[c] : htp_iq4nl_kvalues[c];
        tab[c] = Q6_Vb_vsplat_R((uint8_t)(kv + 128));
    }
    const int aligned = ((uintptr_t)a->q & 3) == 0;
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * tbytes;
        hvx_vec lo[4], hi[4];
        const hvx_vec h = K != HX_MX && LQ_Q5(K) ? (hvx_vec) * (const hvx_uvec *)(tile + LQ_QH(K)) : Q6_V_vsplat_R(0);
        for (int g = 0; g < 4; g++) {
            const hvx_vec v = (hvx_vec) * (const hvx_uvec *)(tile + nib + 128 * g);
            lo[g] = Q6_V_vand_VV(v, m4);
            hi[g] = Q6_V_vand_VV(Q6_Vuh_vlsr_VuhR(v, 4), m4);
            if (lut) {
                lo[g] = hvx_lut16(lo[g], tab);
                hi[g] = hvx_lut16(hi[g], tab);
            } else if (LQ_Q5(K)) {
                lo[g] = Q6_V_vor_VV(lo[g], hvx_fifth(h, 4 * g));
                hi[g] = Q6_V_vor_VV(hi[g], hvx_fifth(h, 16 + 4 * g));
            }
        }
        float d[32], m[32]; /* HTP_HVX_FLOAT: scalar */
        int32_t sc[32];
        for (int r = 0; r < 32; r++) {
            uint16_t hd, hm = 0;
            if (K == HX_MX) {
                d[r] = htp_e8m0_half(tile[r]);
                continue;
            }
            memcpy(&hd, tile + (LQ_HASM(K) ? 4 * r : 2 * r), 2);
            if (LQ_HASM(K)) memcpy(&hm, tile + 4 * r + 2, 2);
            d[r] = htp_f16_to_f32(hd);
            m[r] = htp_f16_to_f32(hm);
            sc[r] = K == LQ_IQ4XS ? (int32_t)(int8_t)tile[64 + r] : 1;
        }
        for (uint32_t u = 0; u < nt; u++) {
            const int8_t *qb = a->q + (size_t)u * k + 32 * j;
            int32_t wu[8];
            const int32_t *w = hvx_act_words(qb, aligned, wu);
            const int32_t sa = a->s[(size_t)u * kb + j];
            hvx_vec dv = Q6_V_vsplat_R(lut ? -128 * sa : 0);
            for (int g = 0; g < 4; g++) {
                dv = Q6_Vw_vrmpyacc_VwVubRb(dv, lo[g], w[g]);
                dv = Q6_Vw_vrmpyacc_VwVubRb(dv, hi[g], w[4 + g]);
            }
            *(hvx_vec *)dot = dv;
            const float da = a->d[(size_t)u * kb + j]; /* HTP_HVX_FLOAT: scalar */
            float *ac = acc[u];
            for (int r = 0; r < 32; r++) {
                float v;
                if (K == HX_MX) {
                    const float s = d[r] * da;
                    v = (float)dot[r] * s;
                } else if (LQ_IQ4(K)) {
                    const float dd = d[r] * da;
                    v = (float)(sc[r] * dot[r]) * dd;
                } else if (LQ_HASM(K)) {
                    const float p1 = (float)dot[r] * (d[r] * da);
                    const float p2 = (float)sa * (m[r] * da);
                    v = p1 + p2;
                } else {
                    v = (float)(dot[r] - 16 * sa) * (d[r] * da);
                }
                ac[r] += v;
            }
        }
    }
    hvx_store(acc, nt, out, ldo, rows);
}
LQ_ENTRIES(hvx, __attribute__((noinline)), hvx_lq_strip)
__attribute__((noinline)) static void mxq8_strip_hvx(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                                     uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    hvx_lq_strip(strip, kb, a, nt, out, ldo, rows, HX_MX);
}

/* One 32-float block per vector: amax in HVX integer, the rest scalar float (as portable). */
static void quantize_q8_hvx(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s) {
    const hvx_vec nosign = Q6_V_vsplat_R(0x7fffffff);
    for (uint32_t j = 0; j < k / 32; j++) {
        const float *xb = x + 32 * j;
        hvx_vec m = Q6_V_vand_VV((hvx_vec) * (const hvx_uvec *)xb, nosign);
        for (int sh = 64; sh >= 4; sh >>= 1) m = Q6_Vw_vmax_VwVw(m, Q6_V_vror_VR(m, sh));
        const int32_t bits = Q6_R_vextract_VR(m, 0);
        float amax;
        memcpy(&amax, &bits, 4);
        const float dd = amax / 127.0f; /* HTP_HVX_FLOAT: scalar from here */
        const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            q[32 * j + i] = (int8_t)v;
            sum += v;
        }
        d[j] = dd;
        s[j] = sum;
    }
}

/* diagnostics: 12 independent vrmpy chains (the expert op's instruction) */
static int32_t dot_peak_hvx(uint64_t iters) {
    hvx_vec acc[12];
    const hvx_vec v = Q6_V_vsplat_R(0x01020304);
    for (int i = 0; i < 12; i++) acc[i] = Q6_V_vsplat_R(i);
    for (uint64_t it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) acc[i] = Q6_Vw_vrmpyacc_VwVubRb(acc[i], v, 0x01010101 + i);
    hvx_vec t = acc[0];
    for (int i = 1; i < 12; i++) t = Q6_Vw_vadd_VwVw(t, acc[i]);
    return Q6_R_vextract_VR(t, 0);
}

const htp_isa htp_isa_hvx = {
    .level = HTP_SIMD_HVX,
    .q4q8_strip = htp_hvx_q4q8_strip,
    .q4q8_nt = HVX_Q4_NT,
    .q8q8_strip = htp_hvx_q8q8_strip,
    .q8q8_nt = HVX_Q4_NT,
    .q4kq8_strip = htp_hvx_q4kq8_strip,
    .q6kq8_strip = htp_hvx_q6kq8_strip,
    .kq8_nt = HVX_Q4_NT,
    .q5kq8_strip = htp_hvx_q5kq8_strip,
    .nlq8_strip = nlq8_strip_hvx,
    .xsq8_strip = xsq8_strip_hvx,
    .affq8_strip = affq8_strip_hvx,
    .mxq8_strip = mxq8_strip_hvx,
    .mxq8_nt = HVX_Q4_NT,
    .dequant_tile = htp_dequant_portable,
    .f32_strip = htp_f32_strip_portable,
    .f32_nt = 4,
    .quantize_row_q8 = quantize_q8_hvx,
    .attention_task = htp_attn_task_portable,
    .attention_kt_cols = 0,
    .swiglu = htp_swiglu_portable,
    .swiglu_oai = htp_swiglu_oai_portable,
    .rms_rows = htp_rms_rows_portable,
    .matmul_f32 = htp_matmul_f32_portable,
    .dot_peak = dot_peak_hvx,
    .dot_macs_per_iter = 12 * 128,
};
#endif
