/* NEON attention tasks (the body is htp_attn_task.h), the arm64 table's: fp32 products with
 * a register block of 4 query rows x 16 columns (16 q-register accumulators, 4 column loads, 1
 * broadcast) and the shared vector exp (htp_attn_vexp.h) with 2^n built in the exponent field,
 * K laid in 16-column panels once per call; and, on CPUs with FEAT_BF16 (Armv8.6's BFloat16
 * extension, optional from Armv8.2), bf16 products with BFMLALT / BFMLALB on K and V packed once
 * per call as bf16 pairs. Head dims must be multiples of 16 (else the generic body runs).
 *
 * The bf16 task gives the bits of the portable bf16 body (htp_attn_task_bf16_body, the
 * emulation of AVX512_BF16's vdpbf16ps): per lane acc = ftz(fma(odd pair element)) then
 * acc = ftz(fma(even)), i.e. BFMLALT then BFMLALB, each an IEEE fused multiply-add when FPCR.FZ
 * is clear (the Linux default; the portable body's fmaf assumes the same), followed by an
 * explicit flush of results below FLT_MIN to zero, sign kept. FPCR.FZ is not used for that
 * flush: Arm flushes a result whose exact value is below 2^-126 before rounding, so an exact
 * sum just under 2^-126 that rounds up to it would read 0 where fmaf and htp_ftz keep 2^-126,
 * and FZ also flushes subnormal accumulator inputs, which htp_dpbf16 adds as they are.
 * bfloat16 rounding is htp_bf16_bits in integer operations (nearest even, subnormals to signed
 * zero, NaN quieted), so it depends on no FPCR mode either (BFCVTN under FZ = 0 would keep
 * subnormals). Tested only under qemu-aarch64 (tools/neon_selftest.c). */
#include "htp_internal.h"

#ifdef HTP_ARM64
#include <arm_neon.h>
#include <sys/auxv.h>

#include "htp_attn_body.h"

#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif

int htp_neon_bf16_supported(void) { return (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0; }

/* lanes 0..n-1 set (all bits), the rest clear; any n */
static inline uint32x4_t first_f4(int n) {
    const int32x4_t idx = {0, 1, 2, 3};
    return vcgtq_s32(vdupq_n_s32(n), idx);
}

/* the last two steps of the 16-lane tree: (v0 + v2) + (v1 + v3) */
static inline float radd_f4(float32x4_t x) {
    const float32x2_t t = vadd_f32(vget_low_f32(x), vget_high_f32(x));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

/* p·2^n for integral n >= -126 (the exp's clamp): 2^n built in the exponent field */
static inline float32x4_t scale2_f4(float32x4_t p, float32x4_t n) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* The NEON vector vocabulary of htp_attn_task.h. The maxima are FMAXNM (a NaN operand loses),
 * as the portable body's comparisons and the exp's clamp (NaN becomes -87). */
#define VF float32x4_t
#define VW 4
#define V_LOAD(p) vld1q_f32(p)
#define V_STORE(p, x) vst1q_f32((p), (x))
#define V_SET1(x) vdupq_n_f32(x)
#define V_ZERO() vdupq_n_f32(0.0f)
#define V_FMA(a, b, c) vfmaq_f32((c), (a), (b))
#define V_MUL(a, b) vmulq_f32((a), (b))
#define V_SUB(a, b) vsubq_f32((a), (b))
#define V_ADD(a, b) vaddq_f32((a), (b))
#define V_EXPNEG(x) htp_vexp_neg(x)
#define V_RMAX(x) vmaxnmvq_f32(x)
#define V_RADD(x) radd_f4(x)
#define V_FIRST(n) first_f4(n)
#define V_MASK_ANDNOT(a, b) vbicq_u32((b), (a))
#define V_MAXM(a, m, x) vbslq_f32((m), vmaxnmq_f32((a), (x)), (a))
#define V_ANDM(m, x) vreinterpretq_f32_u32(vandq_u32((m), vreinterpretq_u32_f32(x)))
#define ATTN_MR 4
#define ATTN_MC 4
_Static_assert(ATTN_MC * VW == HTP_ATTN_COLS_NEON, "the K panels the table asks for are the register block's columns");
#define V_MAX(a, b) vmaxnmq_f32((a), (b))
#define V_ROUND(x) vrndnq_f32(x)
#define V_FNMADD(a, b, c) vfmsq_f32((c), (a), (b))
#define V_SCALE2(p, n) scale2_f4((p), (n))
#define VEXP_TARGET
#include "htp_attn_vexp.h"

/* the SwiGLU and SwiGLU-OAI bodies (htp_vswiglu.h) on the same vocabulary */
#define V_DIV(a, b) vdivq_f32((a), (b))
#define V_SEL_GE0(x, a, b) vbslq_f32(vcgeq_f32((x), vdupq_n_f32(0.0f)), (a), (b))
#define V_SEL_GT(a, b, x, y) vbslq_f32(vcgtq_f32((a), (b)), (x), (y))
#define VSWIGLU_NAME htp_swiglu_neon
#define VSWIGLU_OAI_NAME htp_swiglu_oai_neon
#include "htp_vswiglu.h"

#define ATTN_NAME htp_attn_task_neon
#define ATTN_TARGET
#define ATTN_BF16 0
#include "htp_attn_task.h"

/* ---- bf16 products (FEAT_BF16) ---- */
#define HTP_T_NEON_BF16 __attribute__((target("arch=armv8.2-a+bf16")))

/* 4 floats -> 4 bf16, htp_bf16_bits lane by lane */
static inline uint16x4_t bf16_bits_f4(float32x4_t x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t rne = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fffu)), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)));
    const uint32x4_t sign = vandq_u32(u, vdupq_n_u32(0x80000000u));
    const uint32x4_t normal = vtstq_u32(u, vdupq_n_u32(0x7f800000u)); /* exponent not zero */
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
    uint32x4_t v = vbslq_u32(normal, rne, sign);
    v = vbslq_u32(nan, vorrq_u32(u, vdupq_n_u32(0x00400000u)), v);
    return vshrn_n_u32(v, 16);
}
/* the template's V_BF16_STORE: 4 lanes stored as bf16, returned as the floats they round to */
static inline float32x4_t bf16_store_f4(uint16_t *p, float32x4_t x) {
    const uint16x4_t h = bf16_bits_f4(x);
    vst1_u16(p, h);
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}
#define V_BF16_STORE(p, x) bf16_store_f4((p), (x))

/* htp_ftz on 4 lanes: |x| < FLT_MIN becomes zero of x's sign (NaN kept) */
static inline __attribute__((always_inline)) float32x4_t ftz_f4(float32x4_t x) {
    const uint32x4_t tiny = vcaltq_f32(x, vdupq_n_f32(1.17549435e-38f));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(x), vshrq_n_u32(tiny, 1)));
}
/* htp_dpbf16 on 4 lanes of bf16 pairs: the odd elements' product first (BFMLALT), then the
 * even ones' (BFMLALB), each result flushed */
HTP_T_NEON_BF16 static inline __attribute__((always_inline)) float32x4_t dpbf16_f4(
    float32x4_t acc, bfloat16x8_t a, bfloat16x8_t b) {
    acc = ftz_f4(vbfmlaltq_f32(acc, a, b));
    return ftz_f4(vbfmlalbq_f32(acc, a, b));
}
HTP_T_NEON_BF16 static inline bfloat16x8_t bf16_pair_bcast(uint32_t w) { return vreinterpretq_bf16_u32(vdupq_n_u32(w)); }

/* S[4][64] = Qw[4][dp] · Kw[dp][64] (bf16 pairs, fp32 sums), 16 columns at a time */
HTP_T_NEON_BF16 static inline __attribute__((always_inline)) void qk_bf16_4x64(const uint32_t *qw, uint32_t dp, const uint32_t *kw,
                                                float *s, int nr) {
    for (uint32_t c0 = 0; c0 < HTP_ATTN_BK; c0 += 16) {
        float32x4_t acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int cc = 0; cc < 4; cc++) acc[r][cc] = vdupq_n_f32(0.0f);
        for (uint32_t p = 0; p < dp; p++) {
            const uint32_t *kr = kw + (size_t)p * HTP_ATTN_BK + c0;
            bfloat16x8_t kv[4];
            for (int cc = 0; cc < 4; cc++) kv[cc] = vreinterpretq_bf16_u32(vld1q_u32(kr + 4 * cc));
            for (int r = 0; r < 4; r++) {
                const bfloat16x8_t q = bf16_pair_bcast(qw[(size_t)(r < nr ? r : 0) * dp + p]);
                for (int cc = 0; cc < 4; cc++) acc[r][cc] = dpbf16_f4(acc[r][cc], q, kv[cc]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int cc = 0; cc < 4; cc++) vst1q_f32(s + r * HTP_ATTN_BK + c0 + 4 * cc, acc[r][cc]);
    }
}

/* O[4][ncol dims] += P[4][2 njp] · V (pairs of keys per word; P rows of 32 words), 16 dims at
 * a time (ncol a multiple of 16) */
HTP_T_NEON_BF16 static inline __attribute__((always_inline)) void pv_bf16_4x64(const uint32_t *pw, uint32_t njp, const uint32_t *vw,
                                                size_t ldv, float *o, uint32_t ldo, int nr, int ncol) {
    for (int c0 = 0; c0 < ncol; c0 += 16) {
        float32x4_t acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int cc = 0; cc < 4; cc++)
                acc[r][cc] = r < nr ? vld1q_f32(o + (size_t)r * ldo + c0 + 4 * cc) : vdupq_n_f32(0.0f);
        for (uint32_t jp = 0; jp < njp; jp++) {
            const uint32_t *vr = vw + (size_t)jp * ldv + c0;
            bfloat16x8_t vv[4];
            for (int cc = 0; cc < 4; cc++) vv[cc] = vreinterpretq_bf16_u32(vld1q_u32(vr + 4 * cc));
            for (int r = 0; r < 4; r++) {
                const bfloat16x8_t p = bf16_pair_bcast(pw[(r < nr ? r : 0) * (HTP_ATTN_BK / 2) + jp]);
                for (int cc = 0; cc < 4; cc++) acc[r][cc] = dpbf16_f4(acc[r][cc], p, vv[cc]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int cc = 0; cc < 4; cc++) vst1q_f32(o + (size_t)r * ldo + c0 + 4 * cc, acc[r][cc]);
    }
}

#define ATTN_NAME htp_attn_bf16_task_neon
#define ATTN_TARGET HTP_T_NEON_BF16
#define ATTN_BF16 1
#include "htp_attn_task.h"
#endif
