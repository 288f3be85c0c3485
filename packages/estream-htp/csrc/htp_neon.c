/* arm64 inner-loop tables: the portable kernels (which the compiler vectorises with baseline NEON)
 * plus an int8 x Q8 tile kernel for every weight format (Q4_0; IQ4_NL / IQ4_XS / Q4_1 / Q5_0 /
 * Q5_1; Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4) on the dot-product extension (SDOT,
 * armv8.2-a+dotprod) and the NEON attention tasks of htp_attn_neon.c (fp32 products, and bf16
 * products on FEAT_BF16 CPUs). On CPUs with the int8 matrix-multiply extension (FEAT_I8MM) the
 * same kernels take tokens in pairs through SMMLA (htp_isa_neon_i8mm; the level stays NEON).
 *
 * A 128-byte group of a tile is eight 16-byte registers, each holding 4 rows x 4 bytes; one
 * `vdotq_laneq_s32` multiplies 4 rows by a broadcast 4-byte lane of the activation block. For
 * SMMLA two groups' registers are zipped into 2 rows x 8 bytes, and one instruction multiplies
 * them by the two tokens' 8 columns (32 MACs against SDOT's 16). The integer sums are exact
 * either way, so both tables give the portable table's bits.
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

#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif

int htp_neon_i8mm_supported(void) {
    return htp_neon_dotprod_supported() && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
}

#define HTP_T_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

/* SMMLA: acc += a · bᵀ for a, b of 2 rows x 8 int8 and acc of 2 x 2 int32 (row-major). One
 * instruction of inline assembly, so the kernel bodies stay dot-product code the compiler may
 * not fill with i8mm instructions of its own (USDOT): only the i8mm table's instantiations
 * (MM = 1) issue it, and only on CPUs with FEAT_I8MM (htp_isa_for). */
static inline __attribute__((always_inline)) int32x4_t neon_smmla(int32x4_t acc, int8x16_t a,
                                                                  int8x16_t b) {
    __asm__(".arch_extension i8mm\n\tsmmla %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}

/* The int8 products of one tile's part (NR registers of 4 rows) for NT tokens, shared by the
 * kernel bodies below. DECODE(G, i, lo, hi) gives the part's register i's int8 operands of group G: the values
 * of the block's columns 4G..4G+3 (lo) and 16+4G..16+4G+3 (hi). They add into ia[u][i] (hi
 * into ib[u][i] where SPLIT) for each token u: by SDOT with lane G of the token's activation
 * halves a0[u], a1[u]; or, where MM and NT even, by SMMLA: groups 2P, 2P+1 zipped to 2 rows x
 * 8 columns (once for all tokens) against each token pair's columns 8P..8P+7 (c[pair][P], hi:
 * c[pair][2 + P]), whose 2 x 2 results (rows x tokens) unzip to the tokens' 4-row sums
 * (replacing ia / ib: they start at 0). */
#define NEON_DOT_GROUP(DECODE, SPLIT, G)                                                          \
    for (int i = 0; i < NR; i++) {                                                                 \
        int8x16_t lo, hi;                                                                         \
        DECODE(G, i, lo, hi);                                                                     \
        for (int u = 0; u < NT; u++) {                                                            \
            ia[u][i] = vdotq_laneq_s32(ia[u][i], lo, a0[u], (G));                                 \
            if (SPLIT)                                                                            \
                ib[u][i] = vdotq_laneq_s32(ib[u][i], hi, a1[u], (G));                             \
            else                                                                                  \
                ia[u][i] = vdotq_laneq_s32(ia[u][i], hi, a1[u], (G));                             \
        }                                                                                         \
    }
#define NEON_MM_ZIP(A, B, Z) vreinterpretq_s8_s32(Z(vreinterpretq_s32_s8(A), vreinterpretq_s32_s8(B)))
#define NEON_MM_GROUPS(DECODE, SPLIT, P)                                                          \
    for (int i = 0; i < NR; i++) {                                                                 \
        int8x16_t l0, h0, l1, h1;                                                                 \
        DECODE(2 * (P), i, l0, h0);                                                               \
        DECODE(2 * (P) + 1, i, l1, h1);                                                           \
        const int8x16_t l01 = NEON_MM_ZIP(l0, l1, vzip1q_s32), l23 = NEON_MM_ZIP(l0, l1, vzip2q_s32); \
        const int8x16_t h01 = NEON_MM_ZIP(h0, h1, vzip1q_s32), h23 = NEON_MM_ZIP(h0, h1, vzip2q_s32); \
        for (int p = 0; p < NT / 2; p++) {                                                        \
            ml[p][i][0] = neon_smmla(ml[p][i][0], l01, c[p][(P)]);                                \
            ml[p][i][1] = neon_smmla(ml[p][i][1], l23, c[p][(P)]);                                \
            if (SPLIT) {                                                                          \
                mh[p][i][0] = neon_smmla(mh[p][i][0], h01, c[p][2 + (P)]);                        \
                mh[p][i][1] = neon_smmla(mh[p][i][1], h23, c[p][2 + (P)]);                        \
            } else {                                                                              \
                ml[p][i][0] = neon_smmla(ml[p][i][0], h01, c[p][2 + (P)]);                        \
                ml[p][i][1] = neon_smmla(ml[p][i][1], h23, c[p][2 + (P)]);                        \
            }                                                                                     \
        }                                                                                         \
    }
#define NEON_MM_UNZIP(ACC, M)                                                                     \
    for (int p = 0; p < NT / 2; p++)                                                              \
        for (int i = 0; i < NR; i++) {                                                            \
            ACC[2 * p][i] = vuzp1q_s32(M[p][i][0], M[p][i][1]);                                   \
            ACC[2 * p + 1][i] = vuzp2q_s32(M[p][i][0], M[p][i][1]);                               \
        }
#define NEON_TILE_PRODUCTS(DECODE, SPLIT)                                                         \
    do {                                                                                          \
        if (MM && NT % 2 == 0) {                                                                  \
            int32x4_t ml[NEON_NT / 2][4][2], mh[NEON_NT / 2][4][2];                               \
            int8x16_t c[NEON_NT / 2][4];                                                          \
            for (int p = 0; p < NT / 2; p++) {                                                    \
                for (int h = 0; h < 2; h++) {                                                     \
                    const int64x2_t x = vreinterpretq_s64_s8(h ? a1[2 * p] : a0[2 * p]);          \
                    const int64x2_t y = vreinterpretq_s64_s8(h ? a1[2 * p + 1] : a0[2 * p + 1]);  \
                    c[p][2 * h] = vreinterpretq_s8_s64(vzip1q_s64(x, y));                         \
                    c[p][2 * h + 1] = vreinterpretq_s8_s64(vzip2q_s64(x, y));                     \
                }                                                                                 \
                for (int i = 0; i < NR; i++)                                                      \
                    ml[p][i][0] = ml[p][i][1] = mh[p][i][0] = mh[p][i][1] = vdupq_n_s32(0);       \
            }                                                                                     \
            NEON_MM_GROUPS(DECODE, SPLIT, 0)                                                      \
            NEON_MM_GROUPS(DECODE, SPLIT, 1)                                                      \
            NEON_MM_UNZIP(ia, ml)                                                                 \
            if (SPLIT) NEON_MM_UNZIP(ib, mh)                                                      \
        } else {                                                                                  \
            NEON_DOT_GROUP(DECODE, SPLIT, 0)                                                      \
            NEON_DOT_GROUP(DECODE, SPLIT, 1)                                                      \
            NEON_DOT_GROUP(DECODE, SPLIT, 2)                                                      \
            NEON_DOT_GROUP(DECODE, SPLIT, 3)                                                      \
        }                                                                                         \
    } while (0)

/* One token's outputs of a part of a strip (NR registers from register rb: rows 4rb..4(rb+NR)-1)
 * from its accumulators, the rows past `rows` left alone. */
HTP_T_DOTPROD static inline __attribute__((always_inline)) void neon_store_part(
    float *out, uint32_t rows, int rb, const int NR, const float32x4_t acc[4]) {
    float tmp[16];
    for (int i = 0; i < NR; i++) vst1q_f32(tmp + 4 * i, acc[i]);
    const uint32_t r0 = 4u * (uint32_t)rb;
    for (uint32_t r = 0; r < 4u * (uint32_t)NR && r0 + r < rows; r++) out[r0 + r] = tmp[r];
}

/* The most tokens a kernel pass takes (the SMMLA form; the SDOT form takes 2), and the registers
 * of 4 rows a pass takes: 4 (16 rows), 2 for 4 tokens (their 16 accumulators, 16 SMMLA sums and
 * 8 activation registers would not fit the 32 vector registers) */
#define NEON_NT 4
#define NEON_NR(NT, MM) ((MM) && (NT) == 4 ? 2 : 4)

/* The strip driver of the kernels below: PART(strip, kb, q, d, s, k, out, ldo, rows, part, NT,
 * KIND, MM) for each part of the strip's rows (NEON_NR(NT, MM) registers of 4 rows) and each
 * block of tokens: NT a constant 2 (MM: 4, SMMLA on token pairs) while that many remain, then
 * the rest (MM: 2, then 1; else 1). */
#define NEON_CALL(PART, KIND, MM, NT, P) PART(strip, kb, q, d, s, k, o, ldo, rows, P, NT, KIND, MM)
#define NEON_STRIP(PART, KIND, MM)                                                                \
    do {                                                                                          \
        const uint32_t k = kb * 32;                                                               \
        for (uint32_t t0 = 0; t0 < nt;) {                                                         \
            const uint32_t left = nt - t0, step = (MM) && left >= 4 ? 4 : left >= 2 ? 2 : 1;      \
            const int8_t *q = a->q + (size_t)t0 * k;                                              \
            const float *d = a->d + (size_t)t0 * kb;                                              \
            const int32_t *s = a->s + (size_t)t0 * kb;                                            \
            float *o = out + (size_t)t0 * ldo;                                                    \
            if ((MM) && step == 4) { /* parts of 8 rows */                                        \
                NEON_CALL(PART, KIND, MM, 4, 0);                                                  \
                if (rows > 8) NEON_CALL(PART, KIND, MM, 4, 1);                                    \
                if (rows > 16) NEON_CALL(PART, KIND, MM, 4, 2);                                   \
                if (rows > 24) NEON_CALL(PART, KIND, MM, 4, 3);                                   \
            } else if (step == 2) { /* parts of 16 rows */                                        \
                NEON_CALL(PART, KIND, MM, 2, 0);                                                  \
                if (rows > 16) NEON_CALL(PART, KIND, MM, 2, 1);                                   \
            } else {                                                                              \
                NEON_CALL(PART, KIND, MM, 1, 0);                                                  \
                if (rows > 16) NEON_CALL(PART, KIND, MM, 1, 1);                                   \
            }                                                                                     \
            t0 += step;                                                                           \
        }                                                                                         \
    } while (0)

/* IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 x Q8 tile kernel (K: the LQ_* kind, a compile-time
 * constant): the nibbles of a 16-byte register (4 rows x 4 bytes) as int8, IQ4 codes through one vqtbl1q_s8 of kvalues_iq4nl, Q5 values plus 16 x the
 * fifth bit (the row's word at 64 + 4r / 128 + 4r, bit c = column c: vqtbl1q_u8 copies the
 * byte of the lane's four columns to its 4 bytes, vtstq_u8 picks bit b for byte b). The integer
 * sums are the portable body's exact dots (Q5_0's plus -16 x the block's activation sum),
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

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lq_part_neon(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, int part, const int NT, const int K, const int MM) {
    const int NR = NEON_NR(NT, MM), rb = NR * part; /* the part's registers of 4 rows */
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t kv = vld1q_s8(htp_iq4nl_kvalues);
    float32x4_t acc[NEON_NT][4];
    for (int u = 0; u < NT; u++)
        for (int i = 0; i < NR; i++) acc[u][i] = vdupq_n_f32(0.0f);
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * LQ_BYTES(K);
        int32x4_t ia[NEON_NT][4], ib[NEON_NT][4];
        int8x16_t a0[NEON_NT], a1[NEON_NT];
        for (int u = 0; u < NT; u++) {
            for (int i = 0; i < NR; i++) ia[u][i] = ib[u][i] = vdupq_n_s32(0);
            a0[u] = vld1q_s8(q + (size_t)u * k + 32 * j);
            a1[u] = vld1q_s8(q + (size_t)u * k + 32 * j + 16);
        }
#define LQ_DECODE(G, i, lo, hi)                                                                   \
    do {                                                                                          \
        const uint8x16_t v_ = vld1q_u8(tile + LQ_NIB(K) + 128 * (G) + 16 * (rb + (i)));           \
        const uint8x16_t nl_ = vandq_u8(v_, m4), nh_ = vshrq_n_u8(v_, 4);                         \
        if (LQ_IQ4(K)) {                                                                          \
            lo = vqtbl1q_s8(kv, nl_), hi = vqtbl1q_s8(kv, nh_);                                   \
        } else if (LQ_Q5(K)) {                                                                    \
            const uint8x16_t w_ = vld1q_u8(tile + LQ_QH(K) + 16 * (rb + (i)));                    \
            lo = lq_fifth_neon(nl_, w_, (G) / 2, (G) % 2);                                        \
            hi = lq_fifth_neon(nh_, w_, 2 + (G) / 2, (G) % 2);                                    \
        } else {                                                                                  \
            lo = vreinterpretq_s8_u8(nl_), hi = vreinterpretq_s8_u8(nh_);                         \
        }                                                                                         \
    } while (0)
        NEON_TILE_PRODUCTS(LQ_DECODE, 0);
#undef LQ_DECODE
        (void)ib;
        float32x4_t dw[4], mw[4];
        int32x4_t sc[4];
        for (int i = 0; i < NR; i++) {
            if (LQ_HASM(K)) { /* (d, m) pairs at 4r */
                const uint16x4x2_t dm = vld2_u16((const uint16_t *)(tile + 16 * (rb + i)));
                dw[i] = vcvt_f32_f16(vreinterpret_f16_u16(dm.val[0]));
                mw[i] = vcvt_f32_f16(vreinterpret_f16_u16(dm.val[1]));
            } else {
                dw[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(tile + 8 * (rb + i)))));
            }
            if (K == LQ_IQ4XS) {
                int8_t b8[8] = {0};
                memcpy(b8, tile + 64 + 4 * (rb + i), 4);
                sc[i] = vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(b8))));
            }
        }
        for (int u = 0; u < NT; u++) {
            const float da = d[(size_t)u * kb + j];
            const float sa = (float)s[(size_t)u * kb + j];
            for (int i = 0; i < NR; i++) {
                const int32x4_t dot = K == LQ_IQ4XS ? vmulq_s32(sc[i], ia[u][i])
                                      : K == LQ_Q50 ? vaddq_s32(ia[u][i], vdupq_n_s32(-16 * s[(size_t)u * kb + j]))
                                                    : ia[u][i];
                float32x4_t v = vmulq_f32(vcvtq_f32_s32(dot), vmulq_n_f32(dw[i], da));
                if (LQ_HASM(K)) v = vaddq_f32(v, vmulq_f32(vdupq_n_f32(sa), vmulq_n_f32(mw[i], da)));
                acc[u][i] = vaddq_f32(acc[u][i], v);
            }
        }
    }
    for (int u = 0; u < NT; u++) neon_store_part(out + (size_t)u * ldo, rows, rb, NR, acc[u]);
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lq_strip_neon(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int K) {
    NEON_STRIP(lq_part_neon, K, 0);
}
LQ_ENTRIES(neon, HTP_T_DOTPROD HTP_NO_CONTRACT, lq_strip_neon)
HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void lq_strip_i8mm(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int K) {
    NEON_STRIP(lq_part_neon, K, 1);
}
LQ_ENTRIES(i8mm, HTP_T_DOTPROD HTP_NO_CONTRACT, lq_strip_i8mm)

/* Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 x Q8 tile kernel (F: the KN_* format, a compile-time
 * constant): for each group G and 16-byte register (4 rows x 4 bytes) an int8 operand for the
 * activation block's columns 4G..4G+3 and one for 16+4G..16+4G+3 (NEON_TILE_PRODUCTS): Q8_0's
 * and Q6_K's int8 groups G and G + 4, the Q4_0 and Q4_K nibbles (Q4_0: 0..15, minus 8 x the
 * block's activation sum after the products) (Q5_K: plus 16 x the fifth bit, lq_fifth_neon on the row's word at 704 + 4r),
 * the MXFP4 codes' doubled E2M1 values through one vqtbl1q_s8. The integer sums are the
 * portable bodies' exact dots (Q6_K's two halves apart, then sc0 x lo + sc1 x hi), and the fp32
 * epilogue is the portable body's, operation for operation: htp_q45k_epilogue for Q4_K / Q5_K
 * (FMLA, then FMLS: fma(-dm, sa·da, acc)), d·da then one FMLA for Q4_0, Q8_0 and Q6_K, MXFP4's
 * product then sum (HTP_NO_CONTRACT: no fused multiply-add the portable body does not do). */
enum { KN_Q8 = 0, KN_Q4K, KN_Q5K, KN_Q6K, KN_MX, KN_Q40 };
#define KN_BYTES(F)                                                                               \
    ((F) == KN_Q8    ? HTP_Q8_TILE_BYTES                                                          \
     : (F) == KN_Q40 ? HTP_Q4_TILE_BYTES                                                          \
     : (F) == KN_Q4K ? HTP_Q4K_TILE_BYTES                                                         \
     : (F) == KN_Q5K ? HTP_Q5K_TILE_BYTES                                                         \
     : (F) == KN_Q6K ? HTP_Q6K_TILE_BYTES                                                         \
                     : HTP_MXFP4_TILE_BYTES)
/* the byte of the first value group (Q8_0 / Q6_K: of int8 group 0; the others: of nibble group 0) */
#define KN_VALUES(F) ((F) == KN_Q8 || (F) == KN_Q40 ? 64 : (F) == KN_Q6K ? 128 : (F) == KN_MX ? 32 : 192)

/* 4 NR consecutive uint8 of p (NR 4 or 2) as uint32 lanes, 4 a register */
HTP_T_DOTPROD static inline __attribute__((always_inline)) void kn_u8_rows(const uint8_t *p,
                                                                           const int NR,
                                                                           uint32x4_t out[4]) {
    if (NR == 4) {
        const uint8x16_t b = vld1q_u8(p);
        const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
        out[0] = vmovl_u16(vget_low_u16(lo)), out[1] = vmovl_u16(vget_high_u16(lo));
        out[2] = vmovl_u16(vget_low_u16(hi)), out[3] = vmovl_u16(vget_high_u16(hi));
    } else {
        const uint16x8_t lo = vmovl_u8(vld1_u8(p));
        out[0] = vmovl_u16(vget_low_u16(lo)), out[1] = vmovl_u16(vget_high_u16(lo));
    }
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

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void kn_part_neon(
    const uint8_t *strip, uint32_t kb, const int8_t *q, const float *d, const int32_t *s, uint32_t k,
    float *out, uint32_t ldo, uint32_t rows, int part, const int NT, const int F, const int MM) {
    const int NR = NEON_NR(NT, MM), rb = NR * part; /* the part's registers of 4 rows */
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t kv = vld1q_s8(htp_mxfp4_kvalues);
    float32x4_t acc[NEON_NT][4];
    for (int u = 0; u < NT; u++)
        for (int i = 0; i < NR; i++) acc[u][i] = vdupq_n_f32(0.0f);
    for (uint32_t j = 0; j < kb; j++) {
        const uint8_t *tile = strip + (size_t)j * KN_BYTES(F);
        int32x4_t ia[NEON_NT][4], ib[NEON_NT][4]; /* ib: Q6_K's columns 16..31 */
        int8x16_t a0[NEON_NT], a1[NEON_NT];
        for (int u = 0; u < NT; u++) {
            for (int i = 0; i < NR; i++) ia[u][i] = ib[u][i] = vdupq_n_s32(0);
            a0[u] = vld1q_s8(q + (size_t)u * k + 32 * j);
            a1[u] = vld1q_s8(q + (size_t)u * k + 32 * j + 16);
        }
#define KN_DECODE(G, i, lo, hi)                                                                   \
    do {                                                                                          \
        const uint8_t *gp_ = tile + KN_VALUES(F) + 128 * (G) + 16 * (rb + (i));                   \
        if (F == KN_Q8 || F == KN_Q6K) {                                                          \
            lo = vld1q_s8((const int8_t *)gp_);                                                   \
            hi = vld1q_s8((const int8_t *)gp_ + 512);                                             \
        } else {                                                                                  \
            const uint8x16_t v_ = vld1q_u8(gp_);                                                  \
            const uint8x16_t nl_ = vandq_u8(v_, m4), nh_ = vshrq_n_u8(v_, 4);                     \
            if (F == KN_MX) {                                                                     \
                lo = vqtbl1q_s8(kv, nl_), hi = vqtbl1q_s8(kv, nh_);                               \
            } else if (F == KN_Q5K) {                                                             \
                const uint8x16_t w_ = vld1q_u8(tile + 704 + 16 * (rb + (i)));                     \
                lo = lq_fifth_neon(nl_, w_, (G) / 2, (G) % 2);                                    \
                hi = lq_fifth_neon(nh_, w_, 2 + (G) / 2, (G) % 2);                                \
            } else {                                                                              \
                lo = vreinterpretq_s8_u8(nl_), hi = vreinterpretq_s8_u8(nh_);                     \
            }                                                                                     \
        }                                                                                         \
    } while (0)
        NEON_TILE_PRODUCTS(KN_DECODE, F == KN_Q6K);
#undef KN_DECODE
        /* the rows' scales, 4 rows a register: dw = d (Q8_0, Q6_K) or d·sc (Q4_K, Q5_K, exact) or
         * the E8M0 half scale (MXFP4); dm = dmin·m (exact); Q6_K's int8 scale pairs */
        float32x4_t dw[4], dm[4];
        int32x4_t sc0[4], sc1[4];
        uint32x4_t u8a[4], u8b[4]; /* Q4_K / Q5_K: sc and m of the part's rows; MXFP4: e */
        if (F == KN_Q4K || F == KN_Q5K) {
            kn_u8_rows(tile + 128 + 4 * rb, NR, u8a);
            kn_u8_rows(tile + 160 + 4 * rb, NR, u8b);
        } else if (F == KN_MX) {
            kn_u8_rows(tile + 4 * rb, NR, u8a);
        }
        for (int i = 0; i < NR; i++) {
            const uint32_t r = 4u * (uint32_t)(rb + i);
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
            for (int i = 0; i < NR; i++) {
                const int32x4_t dot =
                    F == KN_Q6K   ? vmlaq_s32(vmulq_s32(sc0[i], ia[u][i]), sc1[i], ib[u][i])
                    : F == KN_Q40 ? vsubq_s32(ia[u][i], vdupq_n_s32(8 * s[(size_t)u * kb + j]))
                                  : ia[u][i];
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
    for (int u = 0; u < NT; u++) neon_store_part(out + (size_t)u * ldo, rows, rb, NR, acc[u]);
}

HTP_T_DOTPROD HTP_NO_CONTRACT static inline __attribute__((always_inline)) void kn_strip_neon(
    const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt, float *out, uint32_t ldo,
    uint32_t rows, const int F, const int MM) {
    NEON_STRIP(kn_part_neon, F, MM);
}
#define KN_ENTRY(NAME, F, MM)                                                                     \
    HTP_T_DOTPROD HTP_NO_CONTRACT static void NAME(const uint8_t *strip, uint32_t kb,             \
                                                   const htp_act_q8 *a, uint32_t nt, float *out,  \
                                                   uint32_t ldo, uint32_t rows) {                 \
        kn_strip_neon(strip, kb, a, nt, out, ldo, rows, F, MM);                                   \
    }
/* the six formats' entries of one table (SUF neon: SDOT, MM 0; i8mm: SMMLA, MM 1) */
#define KN_ENTRIES(SUF, MM)                                                                       \
    KN_ENTRY(q4q8_strip_##SUF, KN_Q40, MM)                                                        \
    KN_ENTRY(q8q8_strip_##SUF, KN_Q8, MM)                                                         \
    KN_ENTRY(q4kq8_strip_##SUF, KN_Q4K, MM)                                                       \
    KN_ENTRY(q5kq8_strip_##SUF, KN_Q5K, MM)                                                       \
    KN_ENTRY(q6kq8_strip_##SUF, KN_Q6K, MM)                                                       \
    KN_ENTRY(mxq8_strip_##SUF, KN_MX, MM)
KN_ENTRIES(neon, 0)
KN_ENTRIES(i8mm, 1)
#undef KN_ENTRIES
#undef KN_ENTRY

/* The portable table with the NEON strip kernels (SUF neon: SDOT; i8mm: SMMLA on token pairs,
 * for FEAT_I8MM CPUs) and the NEON attention tasks. */
#define HTP_NEON_TABLE(SUF)                                                                       \
    {                                                                                             \
        .level = HTP_SIMD_NEON,                                                                   \
        .q4q8_strip = q4q8_strip_##SUF,                                                           \
        .q4q8_nt = 64,                                                                            \
        .q8q8_strip = q8q8_strip_##SUF,                                                           \
        .q8q8_nt = 64, /* (the strips take any token count, NEON_NT at a time) */                 \
        .q4kq8_strip = q4kq8_strip_##SUF,                                                         \
        .q6kq8_strip = q6kq8_strip_##SUF,                                                         \
        .kq8_nt = 64,                                                                             \
        .q5kq8_strip = q5kq8_strip_##SUF,                                                         \
        .nlq8_strip = nlq8_strip_##SUF,                                                           \
        .xsq8_strip = xsq8_strip_##SUF,                                                           \
        .affq8_strip = affq8_strip_##SUF,                                                         \
        .mxq8_strip = mxq8_strip_##SUF,                                                           \
        .mxq8_nt = 64,                                                                            \
        .dequant_tile = htp_dequant_portable,                                                     \
        .f32_strip = htp_f32_strip_portable,                                                      \
        .f32_nt = 4,                                                                              \
        .quantize_row_q8 = htp_quantize_q8_portable,                                              \
        .attention_task = htp_attn_task_neon,                                                     \
        .attention_kt_cols = HTP_ATTN_COLS_NEON,                                                  \
        .attention_bf16_pack = htp_attn_bf16_pack_scalar, /* on FEAT_BF16 CPUs (htp_cpu_bf16) */  \
        .attention_bf16_task = htp_attn_bf16_task_neon,                                           \
        .swiglu = htp_swiglu_neon,                                                                \
        .swiglu_oai = htp_swiglu_oai_neon,                                                        \
        .rms_rows = htp_rms_rows_portable,                                                        \
        .matmul_f32 = htp_matmul_f32_portable,                                                    \
        .dot_peak = NULL,                                                                         \
        .dot_macs_per_iter = 0,                                                                   \
    }
const htp_isa htp_isa_neon = HTP_NEON_TABLE(neon);
const htp_isa htp_isa_neon_i8mm = HTP_NEON_TABLE(i8mm);
#undef HTP_NEON_TABLE
#endif
