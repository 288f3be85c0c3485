/* AVX-512 attention task: register-blocked QKᵀ (4 query rows x 64 keys) and PV (4 rows x 64
 * value dims), vector exp via scalef, K pre-transposed once per call. Head dims must be
 * multiples of 16 (else the generic body runs). */
#include "htp_internal.h"

#ifdef HTP_X86
#include <immintrin.h>

#include "htp_attn_body.h"

HTP_T_AVX512 static inline __m512 exp_neg_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* S[4][64] = Qs[4][dk] · Kt[dk][j0..j0+64) ; kt row stride ldk. */
HTP_T_AVX512 static inline void qk_4x64(const float *qs, uint32_t dk, const float *kt, size_t ldk,
                                        float *s, int nr) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (uint32_t d = 0; d < dk; d++) {
        const float *kr = kt + (size_t)d * ldk;
        const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16);
        const __m512 k2 = _mm512_loadu_ps(kr + 32), k3 = _mm512_loadu_ps(kr + 48);
        for (int r = 0; r < 4; r++) {
            const __m512 b = _mm512_set1_ps(qs[(size_t)(r < nr ? r : 0) * dk + d]);
            acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * 64 + 16 * c, acc[r][c]);
}

/* O[4][64 dims at dv0] += P[4][nj] · V[nj][dv0..dv0+64) */
HTP_T_AVX512 static inline void pv_4x64(const float *p, uint32_t nj, const float *v, size_t ldv,
                                        float *o, uint32_t ldo, int nr, int ncol) {
    __m512 acc[4][4];
    const int nc = ncol / 16;
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = (r < nr && c < nc) ? _mm512_loadu_ps(o + (size_t)r * ldo + 16 * c) : _mm512_setzero_ps();
    for (uint32_t j = 0; j < nj; j++) {
        const float *vr = v + (size_t)j * ldv;
        __m512 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = c < nc ? _mm512_loadu_ps(vr + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < 4; r++) {
            const __m512 b = _mm512_set1_ps(p[(r < nr ? r : 0) * 64 + j]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(b, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(o + (size_t)r * ldo + 16 * c, acc[r][c]);
}

HTP_T_AVX512 void htp_attn_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    if (c->dk % 16 || c->dv % 16 || !c->kt) {
        htp_attn_task_body(c, task, scratch);
        return;
    }
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv, t = c->t;
    const uint32_t i0 = qb * BQ, ni = HTP_MIN(BQ, t - i0);
    const size_t qstride = (size_t)c->hq * dk, vstride = dv, ostride = (size_t)c->hq * dv;
    const size_t ldk = BK;
    const float *kt_head = c->kt + (size_t)hk * c->kt_ld * dk * BK; /* [kblk][dk][BK] */
    float *s = scratch;                    /* [BQ][64] */
    float *o = s + (size_t)BQ * BK;        /* [BQ][dv] */
    float *qs = o + (size_t)BQ * dv;       /* [BQ][dk] */
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    const __m512 vscale = _mm512_set1_ps(c->scale);
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        for (uint32_t d = 0; d < dk; d += 16)
            _mm512_storeu_ps(qs + (size_t)i * dk + d, _mm512_mul_ps(_mm512_loadu_ps(qi + d), vscale));
        for (uint32_t d = 0; d < dv; d += 16) _mm512_storeu_ps(o + (size_t)i * dv + d, _mm512_setzero_ps());
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const uint32_t kend = c->causal ? i0 + ni : t;
    for (uint32_t j0 = 0; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0);
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            qk_4x64(qs + (size_t)i * dk, dk, kt_head + (size_t)(j0 / BK) * dk * BK, ldk, s + (size_t)i * BK, nr);
        }
        for (uint32_t i = 0; i < ni; i++) {
            const uint32_t lim = c->causal ? HTP_MIN(nj, (i0 + i + 1 > j0) ? i0 + i + 1 - j0 : 0) : nj;
            const uint64_t bits = lim >= 64 ? ~0ull : ((1ull << lim) - 1ull);
            float *sr = s + (size_t)i * BK;
            __m512 vmx = _mm512_set1_ps(m[i]);
            for (int cc = 0; cc < 4; cc++)
                vmx = _mm512_mask_max_ps(vmx, (__mmask16)(bits >> (16 * cc)), vmx, _mm512_loadu_ps(sr + 16 * cc));
            const float mx = _mm512_reduce_max_ps(vmx);
            const __m512 vm = _mm512_set1_ps(mx);
            __m512 vsum = _mm512_setzero_ps();
            for (int cc = 0; cc < 4; cc++) {
                const __mmask16 km = (__mmask16)(bits >> (16 * cc));
                const __m512 pv = _mm512_maskz_mov_ps(km, exp_neg_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * cc), vm)));
                _mm512_storeu_ps(sr + 16 * cc, pv);
                vsum = _mm512_add_ps(vsum, pv);
            }
            const float corr = m[i] == -INFINITY ? 0.0f : htp_exp_neg(m[i] - mx);
            l[i] = l[i] * corr + _mm512_reduce_add_ps(vsum);
            m[i] = mx;
            if (corr != 1.0f) {
                const __m512 vc = _mm512_set1_ps(corr);
                float *oi = o + (size_t)i * dv;
                for (uint32_t d = 0; d < dv; d += 16) _mm512_storeu_ps(oi + d, _mm512_mul_ps(_mm512_loadu_ps(oi + d), vc));
            }
        }
        const float *vb = c->vp + ((size_t)hk * t + j0) * dv;
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            for (uint32_t d0 = 0; d0 < dv; d0 += 64)
                pv_4x64(s + (size_t)i * BK, nj, vb + d0, vstride, o + (size_t)i * dv + d0, dv, nr,
                        (int)HTP_MIN(64u, dv - d0));
        }
    }
    for (uint32_t i = 0; i < ni; i++) {
        float *dst = c->out + (size_t)(i0 + i) * ostride + (size_t)h * dv;
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (uint32_t d = 0; d < dv; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)i * dv + d), inv));
    }
}
#endif
