/* AVX-512 attention tasks (the body is htp_attn_task.h): register-blocked QKᵀ (4 query rows x
 * 64 keys) and PV (4 rows x 64 value dims), the shared vector exp (htp_attn_vexp.h) with
 * scalef, K pre-transposed once per call. Head dims must be multiples of 16 (else the generic
 * body runs). The bf16 variant (AVX512_BF16) does both products with vdpbf16ps on K and V packed
 * once per call as bf16 pairs: two multiply-adds per 32-bit lane, twice the fp32 FMA rate.
 * The same vocabulary and exp give the AVX-512 SwiGLU (htp_vswiglu.h). */
#include "htp_internal.h"

#ifdef HTP_X86
#include <immintrin.h>

#include "htp_attn_body.h"

/* The sum of 16 lanes in one fixed tree (upper half + lower, twice, then the two pairs), written
 * out rather than left to the compiler's _mm512_reduce_add_ps: the portable bf16 body
 * (htp_radd16) adds its row sums in the same order. */
HTP_T_AVX512 static inline float radd_ps16(__m512 x) {
    const __m256 t3 = _mm256_add_ps(_mm512_extractf32x8_ps(x, 1), _mm512_castps512_ps256(x));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6)); /* t6[0] + t6[2], t6[1] + t6[3] */
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

/* The AVX-512 vector vocabulary of htp_attn_task.h; the fp32 register block is 4 query rows
 * x 64 columns. */
#define VF __m512
#define VW 16
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, x) _mm512_storeu_ps((p), (x))
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_EXPNEG(x) htp_vexp_neg(x)
#define V_RMAX(x) _mm512_reduce_max_ps(x)
#define V_RADD(x) radd_ps16(x)
#define V_FIRST(n) ((n) >= 16 ? (__mmask16)0xffff : (n) <= 0 ? (__mmask16)0 : (__mmask16)((1u << (n)) - 1u))
#define V_MASK_ANDNOT(a, b) ((__mmask16)((b) & ~(a)))
#define V_MAXM(a, m, x) _mm512_mask_max_ps((a), (m), (a), (x))
#define V_ANDM(m, x) _mm512_maskz_mov_ps((m), (x))
#define ATTN_MR 4
#define ATTN_MC 4
_Static_assert(ATTN_MC * VW == HTP_ATTN_COLS_AVX512, "the K panels the table asks for are the register block's columns");
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_ROUND(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_FNMADD(a, b, c) _mm512_fnmadd_ps((a), (b), (c))
#define V_SCALE2(p, n) _mm512_scalef_ps((p), (n))
#define VEXP_TARGET HTP_T_AVX512
#include "htp_attn_vexp.h"

#define V_DIV(a, b) _mm512_div_ps((a), (b))
#define V_SEL_GE0(x, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), _mm512_setzero_ps(), _CMP_GE_OQ), (b), (a))
#define V_SEL_GT(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((a), (b), _CMP_GT_OQ), (y), (x))
#define VSWIGLU_NAME htp_swiglu_avx512
#define VSWIGLU_OAI_NAME htp_swiglu_oai_avx512
#include "htp_vswiglu.h"

/* ---- bf16 products ---- */
/* 16 floats -> 16 bf16 (vcvtneps2bf16: nearest even, subnormals to zero, as htp_bf16_bits). */
HTP_T_BF16 static inline __m256i bf16_of(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
/* 16 bf16 -> 16 floats */
HTP_T_BF16 static inline __m512 f32_of(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* r[i] lane j <- r[j] lane i: a 16 x 16 transpose of 32-bit words (pairs within 128-bit lanes,
 * then quads, then the lanes across two shuffles) */
HTP_T_BF16 static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + c], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + c */
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}

/* K and V of every KV head into bf16 pairs (see htp_attn_ctx), rows split across threads. */
HTP_T_BF16 void htp_attn_bf16_pack_avx512(const htp_attn_ctx *c, uint32_t ith, uint32_t nth) {
    const uint32_t BK = HTP_ATTN_BK, dk = c->dk, dv = c->dv, t = c->tk; /* key rows */
    const uint32_t dp = dk / 2;
    const size_t ks = (size_t)c->hkv * dk, vs = (size_t)c->hkv * dv;
    const uint32_t nblk = (uint32_t)c->kt_ld;
    uint32_t b, e;
    /* K: one (head, key block) per step; each key row becomes dp words, stored transposed
     * (not under BF16_PV, whose K is fp32): 16 keys x 16 words at a time through a register
     * transpose, 8-word tails (dk is a multiple of 16) through a small buffer */
    htp_split(c->kw ? c->hkv * nblk : 0, ith, nth, &b, &e);
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr % c->hkv, kb = rr / c->hkv; /* the heads of a block together: the rows they read are adjacent */
        uint32_t *dst = c->kw + ((size_t)hk * nblk + kb) * dp * BK;
        for (uint32_t jj0 = 0; jj0 < BK; jj0 += 16) {
            const uint32_t j0 = kb * BK + jj0; /* key rows j0 .. j0 + 15; those from t on are 0 */
#define KROW(r) (c->k + (size_t)(j0 + (uint32_t)(r)) * ks + (size_t)hk * dk)
            uint32_t p0 = 0;
            for (; p0 + 16 <= dp; p0 += 16) {
                __m512i w[16];
                for (int r = 0; r < 16; r++) {
                    w[r] = j0 + (uint32_t)r < t
                               ? _mm512_inserti64x4(_mm512_castsi256_si512(bf16_of(_mm512_loadu_ps(KROW(r) + 2 * p0))),
                                                    bf16_of(_mm512_loadu_ps(KROW(r) + 2 * p0 + 16)), 1)
                               : _mm512_setzero_si512();
                }
                transpose16_epi32(w);
                for (int p = 0; p < 16; p++) _mm512_storeu_si512((void *)(dst + (size_t)(p0 + p) * BK + jj0), w[p]);
            }
            for (; p0 < dp; p0 += 8) {
                uint32_t tail[16][8];
                for (int r = 0; r < 16; r++) {
                    if (j0 + (uint32_t)r < t)
                        _mm256_storeu_si256((__m256i *)tail[r], bf16_of(_mm512_loadu_ps(KROW(r) + 2 * p0)));
                    else
                        memset(tail[r], 0, sizeof tail[r]);
                }
                for (int p = 0; p < 8; p++)
                    for (int r = 0; r < 16; r++) dst[(size_t)(p0 + p) * BK + jj0 + r] = tail[r][p];
            }
#undef KROW
        }
    }
    /* V: one (head, key pair) per step */
    const uint32_t npair = nblk * (BK / 2);
    htp_split(c->hkv * npair, ith, nth, &b, &e);
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr % c->hkv, jp = rr / c->hkv; /* (as for K) */
        uint32_t *dst = c->vw + ((size_t)hk * npair + jp) * dv;
        const uint32_t j = 2 * jp;
        const float *v0 = c->v + (size_t)j * vs + (size_t)hk * dv;
        const float *v1 = v0 + vs;
        for (uint32_t d = 0; d < dv; d += 16) {
            const __m512i lo = j < t ? _mm512_cvtepu16_epi32(bf16_of(_mm512_loadu_ps(v0 + d))) : _mm512_setzero_si512();
            const __m512i hi = j + 1 < t ? _mm512_cvtepu16_epi32(bf16_of(_mm512_loadu_ps(v1 + d))) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(dst + d), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* S[4][64] = Qw[4][dp] · Kw[dp][64] (bf16 pairs, fp32 sums) */
HTP_T_BF16 static inline __attribute__((always_inline)) void qk_bf16_4x64(const uint32_t *qw, uint32_t dp, const uint32_t *kw,
                                           float *s, int nr) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int cc = 0; cc < 4; cc++) acc[r][cc] = _mm512_setzero_ps();
    for (uint32_t p = 0; p < dp; p++) {
        const uint32_t *kr = kw + (size_t)p * HTP_ATTN_BK;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)kr);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(kr + 16));
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512((const void *)(kr + 32));
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512((const void *)(kr + 48));
        for (int r = 0; r < 4; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)qw[(size_t)(r < nr ? r : 0) * dp + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, k3);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int cc = 0; cc < 4; cc++) _mm512_storeu_ps(s + r * 64 + 16 * cc, acc[r][cc]);
}

/* O[4][ncol dims] += P[4][2 njp] · V (pairs of keys per word; P rows of 32 words) */
HTP_T_BF16 static inline __attribute__((always_inline)) void pv_bf16_4x64(const uint32_t *pw, uint32_t njp, const uint32_t *vw,
                                           size_t ldv, float *o, uint32_t ldo, int nr, int ncol) {
    __m512 acc[4][4];
    const int nc = ncol / 16;
    for (int r = 0; r < 4; r++)
        for (int cc = 0; cc < 4; cc++)
            acc[r][cc] = (r < nr && cc < nc) ? _mm512_loadu_ps(o + (size_t)r * ldo + 16 * cc) : _mm512_setzero_ps();
    for (uint32_t jp = 0; jp < njp; jp++) {
        const uint32_t *vr = vw + (size_t)jp * ldv;
        __m512bh vv[4];
        for (int cc = 0; cc < 4; cc++)
            vv[cc] = (__m512bh)(cc < nc ? _mm512_loadu_si512((const void *)(vr + 16 * cc)) : _mm512_setzero_si512());
        for (int r = 0; r < 4; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pw[(r < nr ? r : 0) * (HTP_ATTN_BK / 2) + jp]);
            for (int cc = 0; cc < 4; cc++) acc[r][cc] = _mm512_dpbf16_ps(acc[r][cc], b, vv[cc]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int cc = 0; cc < nc; cc++) _mm512_storeu_ps(o + (size_t)r * ldo + 16 * cc, acc[r][cc]);
}

/* The two task kernels: one body (htp_attn_task.h), instantiated per product kind. */

#define ATTN_NAME htp_attn_task_avx512
#define ATTN_TARGET HTP_T_AVX512
#define ATTN_BF16 0
#include "htp_attn_task.h"

/* the template's V_BF16_STORE: 16 lanes stored as bf16, returned as the floats they round to */
HTP_T_BF16 static inline __m512 bf16_store(uint16_t *p, __m512 x) {
    const __m256i h = bf16_of(x);
    _mm256_storeu_si256((__m256i *)p, h);
    return f32_of(h);
}
#define V_BF16_STORE(p, x) bf16_store((p), (x))

#define ATTN_NAME htp_attn_bf16_task_avx512
#define ATTN_TARGET HTP_T_BF16
#define ATTN_BF16 1
#include "htp_attn_task.h"

#define ATTN_NAME htp_attn_bf16_pv_task_avx512
#define ATTN_TARGET HTP_T_BF16
#define ATTN_BF16 2
#include "htp_attn_task.h"
#endif
