/* arm64 inner-loop table: the portable kernels (which the compiler vectorises with baseline NEON)
 * plus a Q4_0 x Q8 tile kernel on the dot-product extension (SDOT, armv8.2-a+dotprod).
 *
 * A 128-byte group of a tile is eight 16-byte registers, each holding 4 rows x 4 bytes; one
 * `vdotq_laneq_s32` multiplies 4 rows by a broadcast 4-byte lane of the activation block.
 * Tested only under qemu-aarch64 (tools/neon_selftest.c), never on arm64 hardware. */
#include "htp_internal.h"

#if defined(__aarch64__) && !defined(HTP_NO_SIMD)
#include <arm_neon.h>
#include <sys/auxv.h>

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

int htp_neon_dotprod_supported(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }

#define HTP_T_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

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
    for (int u = 0; u < NT; u++) {
        float tmp[16];
        for (int i = 0; i < 4; i++) vst1q_f32(tmp + 4 * i, acc[u][i]);
        const uint32_t r0 = 16u * (uint32_t)half;
        for (uint32_t r = 0; r < 16 && r0 + r < rows; r++) out[(size_t)u * ldo + r0 + r] = tmp[r];
    }
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

/* The portable table with the dot-product Q4 x Q8 strip kernel. */
const htp_isa htp_isa_neon = {
    .level = HTP_SIMD_NEON,
    .q4q8_strip = q4q8_strip_neon,
    .q4q8_nt = 2,
    .q8q8_strip = htp_q8q8_strip_portable,
    .q8q8_nt = 64,
    .dequant_tile = htp_dequant_portable,
    .f32_strip = htp_f32_strip_portable,
    .f32_nt = 4,
    .quantize_row_q8 = htp_quantize_q8_portable,
    .attention_task = htp_attn_task_portable,
    .attention_kt_cols = 0,
    .swiglu = htp_swiglu_portable,
    .matmul_f32 = htp_matmul_f32_portable,
    .dot_peak = NULL,
    .dot_macs_per_iter = 0,
};
#endif
