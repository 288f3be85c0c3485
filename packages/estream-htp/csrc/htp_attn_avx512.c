/* AVX-512 attention tasks: register-blocked QKᵀ (4 query rows x 64 keys) and PV (4 rows x 64
 * value dims), vector exp via scalef, K pre-transposed once per call. Head dims must be
 * multiples of 16 (else the generic body runs). The bf16 variant (AVX512_BF16) does both
 * products with vdpbf16ps on K and V packed once per call as bf16 pairs: two multiply-adds per
 * 32-bit lane, twice the fp32 FMA rate. */
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
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = 0; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0);
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            qk_4x64(qs + (size_t)i * dk, dk, kt_head + (size_t)(j0 / BK) * dk * BK, ldk, s + (size_t)i * BK, nr);
        }
        for (uint32_t i = 0; i < ni; i++) {
            const uint32_t lim = htp_attn_key_lim(c, i0 + i, j0, nj);
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
        const float *vb = c->vp + ((size_t)hk * c->tk + j0) * dv;
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

/* ---- bf16 products ---- */
/* 16 floats -> 16 bf16 (vcvtneps2bf16: nearest even, subnormals to zero, as htp_bf16_bits). */
HTP_T_BF16 static inline __m256i bf16_of(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
/* 16 bf16 -> 16 floats */
HTP_T_BF16 static inline __m512 f32_of(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* K and V of every KV head into bf16 pairs (see htp_attn_ctx), rows split across threads. */
HTP_T_BF16 void htp_attn_bf16_pack_avx512(const htp_attn_ctx *c, uint32_t ith, uint32_t nth) {
    const uint32_t BK = HTP_ATTN_BK, dk = c->dk, dv = c->dv, t = c->tk; /* key rows */
    const uint32_t dp = dk / 2;
    const size_t ks = (size_t)c->hkv * dk, vs = (size_t)c->hkv * dv;
    const uint32_t nblk = (uint32_t)c->kt_ld;
    uint32_t b, e;
    /* K: one (head, key block) per step; each key row becomes dp words, stored transposed */
    htp_split(c->hkv * nblk, ith, nth, &b, &e);
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr / nblk, kb = rr % nblk;
        uint32_t *dst = c->kw + ((size_t)hk * nblk + kb) * dp * BK;
        for (uint32_t jj = 0; jj < BK; jj++) {
            const uint32_t j = kb * BK + jj;
            uint32_t row[HTP_ATTN_BK * 4]; /* up to dk = 512 */
            if (j < t && dk <= 512) {
                const float *src = c->k + (size_t)j * ks + (size_t)hk * dk;
                for (uint32_t d = 0; d < dk; d += 16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)row + d), bf16_of(_mm512_loadu_ps(src + d)));
                for (uint32_t p = 0; p < dp; p++) dst[(size_t)p * BK + jj] = row[p];
            } else if (j < t) {
                const float *src = c->k + (size_t)j * ks + (size_t)hk * dk;
                for (uint32_t p = 0; p < dp; p++)
                    dst[(size_t)p * BK + jj] = (uint32_t)htp_bf16_bits(src[2 * p]) |
                                               (uint32_t)htp_bf16_bits(src[2 * p + 1]) << 16;
            } else {
                for (uint32_t p = 0; p < dp; p++) dst[(size_t)p * BK + jj] = 0;
            }
        }
    }
    /* V: one (head, key pair) per step */
    const uint32_t npair = nblk * (BK / 2);
    htp_split(c->hkv * npair, ith, nth, &b, &e);
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr / npair, jp = rr % npair;
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
HTP_T_BF16 static inline void qk_bf16_4x64(const uint32_t *qw, uint32_t dp, const uint32_t *kw,
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
HTP_T_BF16 static inline void pv_bf16_4x64(const uint32_t *pw, uint32_t njp, const uint32_t *vw,
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

HTP_T_BF16 void htp_attn_bf16_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv, t = c->t, dp = dk / 2;
    const uint32_t i0 = qb * BQ, ni = HTP_MIN(BQ, t - i0);
    const size_t qstride = (size_t)c->hq * dk, ostride = (size_t)c->hq * dv;
    const uint32_t nblk = (uint32_t)c->kt_ld;
    const uint32_t *kw_head = c->kw + (size_t)hk * nblk * dp * BK;       /* [kblk][dp][BK] */
    const uint32_t *vw_head = c->vw + (size_t)hk * nblk * (BK / 2) * dv; /* [kblk][BK/2][dv] */
    float *s = scratch;                               /* [BQ][BK] scores */
    float *o = s + (size_t)BQ * BK;                   /* [BQ][dv] */
    uint32_t *qw = (uint32_t *)(o + (size_t)BQ * dv); /* [BQ][dp] */
    uint32_t *pw = qw + (size_t)BQ * dp;              /* [BQ][BK/2] */
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    const __m512 vscale = _mm512_set1_ps(c->scale);
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        uint16_t *qh = (uint16_t *)(qw + (size_t)i * dp);
        for (uint32_t d = 0; d < dk; d += 16)
            _mm256_storeu_si256((__m256i *)(qh + d), bf16_of(_mm512_mul_ps(_mm512_loadu_ps(qi + d), vscale)));
        for (uint32_t d = 0; d < dv; d += 16) _mm512_storeu_ps(o + (size_t)i * dv + d, _mm512_setzero_ps());
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = 0; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0);
        const uint32_t kb = j0 / BK;
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            qk_bf16_4x64(qw + (size_t)i * dp, dp, kw_head + (size_t)kb * dp * BK, s + (size_t)i * BK, nr);
        }
        for (uint32_t i = 0; i < ni; i++) {
            const uint32_t lim = htp_attn_key_lim(c, i0 + i, j0, nj);
            const uint64_t bits = lim >= 64 ? ~0ull : ((1ull << lim) - 1ull);
            const float *sr = s + (size_t)i * BK;
            uint16_t *ph = (uint16_t *)(pw + (size_t)i * (BK / 2));
            __m512 vmx = _mm512_set1_ps(m[i]);
            for (int cc = 0; cc < 4; cc++)
                vmx = _mm512_mask_max_ps(vmx, (__mmask16)(bits >> (16 * cc)), vmx, _mm512_loadu_ps(sr + 16 * cc));
            const float mx = _mm512_reduce_max_ps(vmx);
            const __m512 vm = _mm512_set1_ps(mx);
            __m512 vsum = _mm512_setzero_ps();
            for (int cc = 0; cc < 4; cc++) {
                const __mmask16 km = (__mmask16)(bits >> (16 * cc));
                const __m512 pv = _mm512_maskz_mov_ps(km, exp_neg_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * cc), vm)));
                const __m256i pb = bf16_of(pv);
                _mm256_storeu_si256((__m256i *)(ph + 16 * cc), pb);
                vsum = _mm512_add_ps(vsum, f32_of(pb)); /* the weights actually applied */
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
        const uint32_t *vb = vw_head + (size_t)kb * (BK / 2) * dv;
        const uint32_t njp = (nj + 1) / 2;
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            for (uint32_t d0 = 0; d0 < dv; d0 += 64)
                pv_bf16_4x64(pw + (size_t)i * (BK / 2), njp, vb + d0, dv, o + (size_t)i * dv + d0, dv, nr,
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
