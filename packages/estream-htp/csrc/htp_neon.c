/* arm64 inner-loop table: the portable kernels (which the compiler vectorises with baseline NEON)
 * plus an int8 x Q8 tile kernel for every weight format (Q4_0; IQ4_NL / IQ4_XS / Q4_1 / Q5_0 /
 * Q5_1; Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4) on the dot-product extension (SDOT,
 * armv8.2-a+dotprod) and the NEON attention tasks of htp_attn_neon.c (fp32 products, and bf16
 * products on FEAT_BF16 CPUs).
 *
 * A 128-byte group of a tile is eight 16-byte registers, each holding 4 rows x 4 bytes; one
 * `vdotq_laneq_s32` multiplies 4 rows by a broadcast 4-byte lane of the activation block.
 * Tested only under qemu-aarch64 (tools/neon_selftest.c), never on arm64 hardware. */
#include "htp_internal.h"

#if defined(__aarch64__) && !defined(HTP_NO_SIMD)
#include <arm_neon.h>
#include "htp_matmul_body.h" /* HTP_NO_CONTRACT */
#include <sys/auxv.h>

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

int htp_neon_dotprod_supported(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }

#define HTP_T_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

/* One token's outputs of a 16-row half (`half` 0: rows 0..15, 1: 16..31) from its four
 * accumulators, the rows past `rows` left alone. */
HTP_T_DOTPROD static inline __attribute__((always_inline)) void neon_store_half(
    float *out, uint32_t rows, int half, const float32x4_t acc[4]) {
    float tmp[16];
    for (int i = 0; i < 4; i++) vst1q_f32(tmp + 4 * i, acc[i]);
    const uint32_t r0 = 16u * (uint32_t)half;
    for (uint32_t r = 0; r < 16 && r0 + r < rows; r++) out[r0 + r] = tmp[r];
}

/* The strip drivers of the kernels below that take 2 tokens a pass: HALF(strip, kb, q, d, s, k,
 * out, ldo, rows, half, NT, KIND) for each 16-row half of each block of 2 tokens (NT a
 * constant 2, or 1 for the last odd token). */
#define NEON_STRIP2(HALF, KIND)                                                                   \
    do {                                                                                          \
        const uint32_t k = kb * 32;                                                               \
        for (uint32_t t0 = 0; t0 < nt; t0 += 2) {                                                 \
            const int8_t *q = a->q + (size_t)t0 * k;                                              \
            const float *d = a->d + (size_t)t0 * kb;                                              \
            const int32_t *s = a->s + (size_t)t0 * kb;                                            \
            float *o = out + (size_t)t0 * ldo;                                                    \
            for (int half = 0; half < (rows > 16 ? 2 : 1); half++) {                              \
                if (nt - t0 >= 2)                                                                 \
                    HALF(strip, kb, q, d, s, k, o, ldo, rows, half, 2, KIND);                     \
                else                                                                              \
                    HALF(strip, kb, q, d, s, k, o, ldo, rows, half, 1, KIND);                     \
            }                                                                                     \
        }                                                                                         \
    } while (0)

HTP_T_DOTPROD static inline __attribute__((always_inline)) void q4q8_half_neon(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, int half, const int NT) {
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float32x4_t acc[2][4];
    for (int u = 0; u < NT; u++)
        for (int i = 0; i < 4; i++) acc[u][i] = vdupq_n_f32(0.0f);
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * HTP_Q4_TILE_BYTES;
        int32x4_t ia[2][4];
        int8x16_t a0[2], a1[2];
        for (int u = 0; u < NT; u++) {
            for (int i = 0; i < 4; i++) ia[u][i] = vdupq_n_s32(0);
            a0[u] = vld1q_s8(q + (size_t)u * k + 32 * j);
            a1[u] = vld1q_s8(q + (size_t)u * k + 32 * j + 16);
        }
#define HTP_NEON_GROUP(G)                                                                         \
    do {                                                                                          \
        const uint8_t *gp = tile + 64 + 128 * (G) + 64 * half;                                    \
        for (int i = 0; i < 4; i++) {                                                             \
            const uint8x16_t v = vld1q_u8(gp + 16 * i);                                           \
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, m4));                            \
            const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));                           \
            for (int u = 0; u < NT; u++) {                                                        \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], lo, a0[u], (G));                             \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], hi, a1[u], (G));                             \
            }                                                                                     \
        }                                                                                         \
    } while (0)
        HTP_NEON_GROUP(0);
        HTP_NEON_GROUP(1);
        HTP_NEON_GROUP(2);
        HTP_NEON_GROUP(3);
#undef HTP_NEON_GROUP
        float32x4_t dw[4];
        for (int i = 0; i < 4; i++)
            dw[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(tile + 32 * half + 8 * i))));
        for (int u = 0; u < NT; u++) {
            const float da = d[(size_t)u * kb + j];
            const int32x4_t s8 = vdupq_n_s32(8 * s[(size_t)u * kb + j]);
            for (int i = 0; i < 4; i++) {
                const float32x4_t f = vcvtq_f32_s32(vsubq_s32(ia[u][i], s8));
                acc[u][i] = vfmaq_f32(acc[u][i], f, vmulq_n_f32(dw[i], da));
            }
        }
    }
    for (int u = 0; u < NT; u++) neon_store_half(out + (size_t)u * ldo, rows, half, acc[u]);
}

HTP_T_DOTPROD static void q4q8_strip_neon(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,
                                          uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    const uint32_t k = kb * 32;
    for (int half = 0; half < (rows > 16 ? 2 : 1); half++) {
        if (nt == 2)
            q4q8_half_neon(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, half, 2);
        else
            q4q8_half_neon(strip, kb, a->q, a->d, a->s, k, out, ldo, rows, half, 1);
    }
}

/* IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 x Q8 tile kernel (K: the LQ_* kind, a compile-time
 * constant), the Q4_0 kernel's scheme: the nibbles of a 16-byte register (4 rows x 4 bytes) as
 * int8 for SDOT, IQ4 codes through one vqtbl1q_s8 of kvalues_iq4nl, Q5 values plus 16 x the
 * fifth bit (the row's word at 64 + 4r / 128 + 4r, bit c = column c: vqtbl1q_u8 copies the
 * byte of the lane's four columns to its 4 bytes, vtstq_u8 picks bit b for byte b). The integer
 * sums are the portable body's exact dots (Q5_0's start at -16 x the block's activation sum),
 * and the fp32 epilogue is the portable body's, operation for operation, no fused multiply-add
 * (HTP_NO_CONTRACT; htp_x86.c's LQ_KERNEL states it). */
/* the tile kinds LQ_* and their layout: htp_internal.h */

/* 16 + the nibbles whose fifth bit is set: `words` the 4 rows' fifth-bit words, `byte` the byte
 * holding the lane's columns, from bit 4 x `odd` */
HTP_T_DOTPROD static inline __attribute__((always_inline)) int8x16_t lq_fifth_neon(
    uint8x16_t nib, uint8x16_t words, int byte, int odd) {
    const uint8_t idx[16] = {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12};
    const uint8x16_t sel = vqtbl1q_u8(words, vaddq_u8(vld1q_u8(idx), vdupq_n_u8((uint8_t)byte)));
    const uint8x16_t bit = vreinterpretq_u8_u32(vdupq_n_u32(odd ? 0x80402010u : 0x08040201u));
    return vreinterpretq_s8_u8(vaddq_u8(nib, vandq_u8(vtstq_u8(sel, bit), vdupq_n_u8(16))));
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lq_half_neon(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, int half, const int NT, const int K) {
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t kv = vld1q_s8(htp_iq4nl_kvalues);
    float32x4_t acc[2][4];
    for (int u = 0; u < NT; u++)
        for (int i = 0; i < 4; i++) acc[u][i] = vdupq_n_f32(0.0f);
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * LQ_BYTES(K);
        int32x4_t ia[2][4];
        int8x16_t a0[2], a1[2];
        for (int u = 0; u < NT; u++) {
            const int32_t start = K == LQ_Q50 ? -16 * s[(size_t)u * kb + j] : 0;
            for (int i = 0; i < 4; i++) ia[u][i] = vdupq_n_s32(start);
            a0[u] = vld1q_s8(q + (size_t)u * k + 32 * j);
            a1[u] = vld1q_s8(q + (size_t)u * k + 32 * j + 16);
        }
#define LQ_NEON_GROUP(G)                                                                          \
    do {                                                                                          \
        const uint8_t *gp = tile + LQ_NIB(K) + 128 * (G) + 64 * half;                             \
        for (int i = 0; i < 4; i++) {                                                             \
            const uint8x16_t v = vld1q_u8(gp + 16 * i);                                           \
            const uint8x16_t nl = vandq_u8(v, m4), nh = vshrq_n_u8(v, 4);                         \
            int8x16_t lo, hi;                                                                     \
            if (LQ_IQ4(K)) {                                                                      \
                lo = vqtbl1q_s8(kv, nl), hi = vqtbl1q_s8(kv, nh);                                 \
            } else if (LQ_Q5(K)) {                                                                \
                const uint8x16_t w = vld1q_u8(tile + LQ_QH(K) + 64 * half + 16 * i);              \
                lo = lq_fifth_neon(nl, w, (G) / 2, (G) % 2);                                      \
                hi = lq_fifth_neon(nh, w, 2 + (G) / 2, (G) % 2);                                  \
            } else {                                                                              \
                lo = vreinterpretq_s8_u8(nl), hi = vreinterpretq_s8_u8(nh);                       \
            }                                                                                     \
            for (int u = 0; u < NT; u++) {                                                        \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], lo, a0[u], (G));                             \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], hi, a1[u], (G));                             \
            }                                                                                     \
        }                                                                                         \
    } while (0)
        LQ_NEON_GROUP(0);
        LQ_NEON_GROUP(1);
        LQ_NEON_GROUP(2);
        LQ_NEON_GROUP(3);
#undef LQ_NEON_GROUP
        float32x4_t dw[4], mw[4];
        int32x4_t sc[4];
        for (int i = 0; i < 4; i++) {
            if (LQ_HASM(K)) { /* (d, m) pairs at 4r */
                const uint16x4x2_t dm = vld2_u16((const uint16_t *)(tile + 64 * half + 16 * i));
                dw[i] = vcvt_f32_f16(vreinterpret_f16_u16(dm.val[0]));
                mw[i] = vcvt_f32_f16(vreinterpret_f16_u16(dm.val[1]));
            } else {
                dw[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(tile + 32 * half + 8 * i))));
            }
            if (K == LQ_IQ4XS) {
                int8_t b8[8] = {0};
                memcpy(b8, tile + 64 + 16 * half + 4 * i, 4);
                sc[i] = vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(b8))));
            }
        }
        for (int u = 0; u < NT; u++) {
            const float da = d[(size_t)u * kb + j];
            const float sa = (float)s[(size_t)u * kb + j];
            for (int i = 0; i < 4; i++) {
                const int32x4_t dot = K == LQ_IQ4XS ? vmulq_s32(sc[i], ia[u][i]) : ia[u][i];
                float32x4_t v = vmulq_f32(vcvtq_f32_s32(dot), vmulq_n_f32(dw[i], da));
                if (LQ_HASM(K)) v = vaddq_f32(v, vmulq_f32(vdupq_n_f32(sa), vmulq_n_f32(mw[i], da)));
                acc[u][i] = vaddq_f32(acc[u][i], v);
            }
        }
    }
    for (int u = 0; u < NT; u++) neon_store_half(out + (size_t)u * ldo, rows, half, acc[u]);
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lq_strip_neon(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int K) {
    NEON_STRIP2(lq_half_neon, K);
}
LQ_ENTRIES(neon, HTP_T_DOTPROD HTP_NO_CONTRACT, lq_strip_neon)

/* Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 x Q8 tile kernel (F: the KN_* format, a compile-time
 * constant), the Q4_0 kernel's scheme: for each group G and 16-byte register (4 rows x 4 bytes)
 * an int8 operand for the activation block's columns 4G..4G+3 (lane G of its first 16 bytes)
 * and one for 16+4G..16+4G+3 (lane G of the last 16): Q8_0's and Q6_K's int8 groups G and G + 4,
 * the Q4_K nibbles (Q5_K: plus 16 x the fifth bit, lq_fifth_neon on the row's word at 704 + 4r),
 * the MXFP4 codes' doubled E2M1 values through one vqtbl1q_s8. The integer sums are the
 * portable bodies' exact dots (Q6_K's two halves apart, then sc0 x lo + sc1 x hi), and the fp32
 * epilogue is the portable body's, operation for operation: htp_q45k_epilogue for Q4_K / Q5_K
 * (FMLA, then FMLS: fma(-dm, sa·da, acc)), d·da then one FMLA for Q8_0 and Q6_K, MXFP4's
 * product then sum (HTP_NO_CONTRACT: no fused multiply-add the portable body does not do). */
enum { KN_Q8 = 0, KN_Q4K, KN_Q5K, KN_Q6K, KN_MX };
#define KN_BYTES(F)                                                                               \
    ((F) == KN_Q8    ? HTP_Q8_TILE_BYTES                                                          \
     : (F) == KN_Q4K ? HTP_Q4K_TILE_BYTES                                                         \
     : (F) == KN_Q5K ? HTP_Q5K_TILE_BYTES                                                         \
     : (F) == KN_Q6K ? HTP_Q6K_TILE_BYTES                                                         \
                     : HTP_MXFP4_TILE_BYTES)
/* the byte of the first value group (Q8_0 / Q6_K: of int8 group 0; the others: of nibble group 0) */
#define KN_VALUES(F) ((F) == KN_Q8 ? 64 : (F) == KN_Q6K ? 128 : (F) == KN_MX ? 32 : 192)

/* 16 consecutive uint8 of p as uint32 lanes, 4 a register */
HTP_T_DOTPROD static inline __attribute__((always_inline)) void kn_u8x16(const uint8_t *p,
                                                                         uint32x4_t out[4]) {
    const uint8x16_t b = vld1q_u8(p);
    const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
    out[0] = vmovl_u16(vget_low_u16(lo)), out[1] = vmovl_u16(vget_high_u16(lo));
    out[2] = vmovl_u16(vget_low_u16(hi)), out[3] = vmovl_u16(vget_high_u16(hi));
}
/* four fp16 of p as fp32 lanes */
HTP_T_DOTPROD static inline __attribute__((always_inline)) float32x4_t kn_f16x4(const uint8_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
}
/* htp_e8m0_half lane-wise: 2^(e - 128), the bits (e - 1) << 23, or 0x00200000 << e below e = 2 */
HTP_T_DOTPROD static inline __attribute__((always_inline)) float32x4_t kn_e8m0_half(uint32x4_t e) {
    const uint32x4_t normal = vshlq_n_u32(vsubq_u32(e, vdupq_n_u32(1)), 23);
    const uint32x4_t sub = vshlq_u32(vdupq_n_u32(0x00200000u), vreinterpretq_s32_u32(e));
    return vreinterpretq_f32_u32(vbslq_u32(vcgeq_u32(e, vdupq_n_u32(2)), normal, sub));
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void kn_half_neon(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, int half, const int NT, const int F) {
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t kv = vld1q_s8(htp_mxfp4_kvalues);
    float32x4_t acc[2][4];
    for (int u = 0; u < NT; u++)
        for (int i = 0; i < 4; i++) acc[u][i] = vdupq_n_f32(0.0f);
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * KN_BYTES(F);
        int32x4_t ia[2][4], ib[2][4]; /* ib: Q6_K's columns 16..31 */
        int8x16_t a0[2], a1[2];
        for (int u = 0; u < NT; u++) {
            for (int i = 0; i < 4; i++) ia[u][i] = ib[u][i] = vdupq_n_s32(0);
            a0[u] = vld1q_s8(q + (size_t)u * k + 32 * j);
            a1[u] = vld1q_s8(q + (size_t)u * k + 32 * j + 16);
        }
#define KN_NEON_GROUP(G)                                                                          \
    do {                                                                                          \
        const uint8_t *gp = tile + KN_VALUES(F) + 128 * (G) + 64 * half;                          \
        for (int i = 0; i < 4; i++) {                                                             \
            int8x16_t lo, hi;                                                                     \
            if (F == KN_Q8 || F == KN_Q6K) {                                                      \
                lo = vld1q_s8((const int8_t *)gp + 16 * i);                                       \
                hi = vld1q_s8((const int8_t *)gp + 512 + 16 * i);                                 \
            } else {                                                                              \
                const uint8x16_t v = vld1q_u8(gp + 16 * i);                                       \
                const uint8x16_t nl = vandq_u8(v, m4), nh = vshrq_n_u8(v, 4);                     \
                if (F == KN_MX) {                                                                 \
                    lo = vqtbl1q_s8(kv, nl), hi = vqtbl1q_s8(kv, nh);                             \
                } else if (F == KN_Q5K) {                                                         \
                    const uint8x16_t w = vld1q_u8(tile + 704 + 64 * half + 16 * i);               \
                    lo = lq_fifth_neon(nl, w, (G) / 2, (G) % 2);                                  \
                    hi = lq_fifth_neon(nh, w, 2 + (G) / 2, (G) % 2);                              \
                } else {                                                                          \
                    lo = vreinterpretq_s8_u8(nl), hi = vreinterpretq_s8_u8(nh);                   \
                }                                                                                 \
            }                                                                                     \
            for (int u = 0; u < NT; u++) {                                                        \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], lo, a0[u], (G));                             \
                if (F == KN_Q6K)                                                                  \
                    ib[u][i] = vdotq_laneq_s32(ib[u][i], hi, a1[u], (G));                         \
                else                                                                              \
                    ia[u][i] = vdotq_laneq_s32(ia[u][i], hi, a1[u], (G));                         \
            }                                                                                     \
        }                                                                                         \
    } while (0)
        KN_NEON_GROUP(0);
        KN_NEON_GROUP(1);
        KN_NEON_GROUP(2);
        KN_NEON_GROUP(3);
#undef KN_NEON_GROUP
        /* the rows' scales, 4 rows a register: dw = d (Q8_0, Q6_K) or d·sc (Q4_K, Q5_K, exact) or
         * the E8M0 half scale (MXFP4); dm = dmin·m (exact); Q6_K's int8 scale pairs */
        float32x4_t dw[4], dm[4];
        int32x4_t sc0[4], sc1[4];
        uint32x4_t u8a[4], u8b[4]; /* Q4_K / Q5_K: sc and m of the 16 rows; MXFP4: e */
        if (F == KN_Q4K || F == KN_Q5K) {
            kn_u8x16(tile + 128 + 16 * half, u8a);
            kn_u8x16(tile + 160 + 16 * half, u8b);
        } else if (F == KN_MX) {
            kn_u8x16(tile + 16 * half, u8a);
        }
        for (int i = 0; i < 4; i++) {
            const uint32_t r = 16u * (uint32_t)half + 4u * (uint32_t)i;
            if (F == KN_MX) {
                dw[i] = kn_e8m0_half(u8a[i]);
            } else {
                dw[i] = kn_f16x4(tile + 2 * r);
            }
            if (F == KN_Q4K || F == KN_Q5K) {
                dw[i] = vmulq_f32(dw[i], vcvtq_f32_u32(u8a[i]));
                dm[i] = vmulq_f32(kn_f16x4(tile + 64 + 2 * r), vcvtq_f32_u32(u8b[i]));
            }
            if (F == KN_Q6K) { /* (sc0, sc1) pairs at 64 + 2r */
                const int16x8_t p = vmovl_s8(vld1_s8((const int8_t *)tile + 64 + 2 * r));
                sc0[i] = vmovl_s16(vuzp1_s16(vget_low_s16(p), vget_high_s16(p)));
                sc1[i] = vmovl_s16(vuzp2_s16(vget_low_s16(p), vget_high_s16(p)));
            }
        }
        for (int u = 0; u < NT; u++) {
            const float da = d[(size_t)u * kb + j];
            const float sada = (float)s[(size_t)u * kb + j] * da;
            for (int i = 0; i < 4; i++) {
                const int32x4_t dot =
                    F == KN_Q6K ? vmlaq_s32(vmulq_s32(sc0[i], ia[u][i]), sc1[i], ib[u][i]) : ia[u][i];
                const float32x4_t f = vcvtq_f32_s32(dot), sw = vmulq_n_f32(dw[i], da);
                if (F == KN_MX) {
                    acc[u][i] = vaddq_f32(acc[u][i], vmulq_f32(f, sw));
                } else {
                    acc[u][i] = vfmaq_f32(acc[u][i], f, sw);
                    if (F == KN_Q4K || F == KN_Q5K) acc[u][i] = vfmsq_f32(acc[u][i], dm[i], vdupq_n_f32(sada));
                }
            }
        }
    }
    for (int u = 0; u < NT; u++) neon_store_half(out + (size_t)u * ldo, rows, half, acc[u]);
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void kn_strip_neon(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int F) {
    NEON_STRIP2(kn_half_neon, F);
}
#define KN_ENTRY(NAME, F)                                                                         \
    HTP_T_DOTPROD HTP_NO_CONTRACT static void NAME(const uint8_t *strip, uint32_t kb,             \
                                                   const htp_act_q8 *a, uint32_t nt, float *out,  \
                                                   uint32_t ldo, uint32_t rows) {                 \
        kn_strip_neon(strip, kb, a, nt, out, ldo, rows, F);                                       \
    }
KN_ENTRY(q8q8_strip_neon, KN_Q8)
KN_ENTRY(q4kq8_strip_neon, KN_Q4K)
KN_ENTRY(q5kq8_strip_neon, KN_Q5K)
KN_ENTRY(q6kq8_strip_neon, KN_Q6K)
KN_ENTRY(mxq8_strip_neon, KN_MX)
#undef KN_ENTRY

/* The portable table with the dot-product strip kernels and the NEON attention tasks. */
const htp_isa htp_isa_neon = {
    .level = HTP_SIMD_NEON,
    .q4q8_strip = q4q8_strip_neon,
    .q4q8_nt = 2,
    .q8q8_strip = q8q8_strip_neon,
    .q8q8_nt = 64, /* (the strips take any token count, 2 at a time) */
    .q4kq8_strip = q4kq8_strip_neon,
    .q6kq8_strip = q6kq8_strip_neon,
    .kq8_nt = 64,
    .q5kq8_strip = q5kq8_strip_neon,
    .nlq8_strip = nlq8_strip_neon,
    .xsq8_strip = xsq8_strip_neon,
    .affq8_strip = affq8_strip_neon,
    .mxq8_strip = mxq8_strip_neon,
    .mxq8_nt = 64,
    .dequant_tile = htp_dequant_portable,
    .f32_strip = htp_f32_strip_portable,
    .f32_nt = 4,
    .quantize_row_q8 = htp_quantize_q8_portable,
    .attention_task = htp_attn_task_neon,
    .attention_kt_cols = HTP_ATTN_COLS_NEON,
    .attention_bf16_pack = htp_attn_bf16_pack_scalar, /* on FEAT_BF16 CPUs (htp_cpu_bf16) */
    .attention_bf16_task = htp_attn_bf16_task_neon,
    .swiglu = htp_swiglu_portable,
    .rms_rows = htp_rms_rows_portable,
    .matmul_f32 = htp_matmul_f32_portable,
    .dot_peak = NULL,
    .dot_macs_per_iter = 0,
};
#endif
