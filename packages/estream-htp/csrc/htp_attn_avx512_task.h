/* The AVX-512 attention task, written once: one (head, query block) with an online softmax over
 * key blocks of HTP_ATTN_BK. Included by htp_attn_avx512.c once per product kind, with
 *   ATTN_NAME    the function's name,
 *   ATTN_TARGET  its target attribute,
 *   ATTN_BF16    0: fp32 products (q·scale and K pre-transposed as floats, P·V in fp32);
 *                1: bf16 products (q·scale, K, V and the softmax weights rounded to bfloat16,
 *                   vdpbf16ps with fp32 sums; the row sums add the weights actually applied).
 * Everything else — the block loop, the key limits of causal and context attention, the
 * running max and sum, the rescaling of O and the final normalisation — is shared. The
 * product kind only changes how q is staged, which tile kernels form S = Q·Kᵀ and O += P·V,
 * and how a row of P is stored for the second product. */

ATTN_TARGET void ATTN_NAME(const htp_attn_ctx *c, uint32_t task, float *scratch) {
#if !ATTN_BF16
    if (c->dk % 16 || c->dv % 16 || !c->kt) {
        htp_attn_task_body(c, task, scratch);
        return;
    }
#endif
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv, t = c->t;
    const uint32_t i0 = qb * BQ, ni = HTP_MIN(BQ, t - i0);
    const size_t qstride = (size_t)c->hq * dk, ostride = (size_t)c->hq * dv;
    float *s = scratch;             /* [BQ][BK] scores */
    float *o = s + (size_t)BQ * BK; /* [BQ][dv] unnormalised output rows */
#if ATTN_BF16
    const uint32_t dp = dk / 2, nblk = (uint32_t)c->kt_ld;
    const uint32_t *k_head = c->kw + (size_t)hk * nblk * dp * BK;       /* [kblk][dp][BK] pairs */
    const uint32_t *v_head = c->vw + (size_t)hk * nblk * (BK / 2) * dv; /* [kblk][BK/2][dv] pairs */
    uint32_t *qw = (uint32_t *)(o + (size_t)BQ * dv);                    /* [BQ][dp] q·scale pairs */
    uint32_t *pw = qw + (size_t)BQ * dp;                                 /* [BQ][BK/2] P pairs */
#else
    const float *k_head = c->kt + (size_t)hk * c->kt_ld * dk * BK; /* [kblk][dk][BK] */
    const float *v_head = c->vp + (size_t)hk * c->tk * dv;         /* [key][dv] */
    float *qs = o + (size_t)BQ * dv;                               /* [BQ][dk] q·scale */
#endif
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    const __m512 vscale = _mm512_set1_ps(c->scale);
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        for (uint32_t d = 0; d < dk; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qi + d), vscale);
#if ATTN_BF16
            _mm256_storeu_si256((__m256i *)((uint16_t *)(qw + (size_t)i * dp) + d), bf16_of(x));
#else
            _mm512_storeu_ps(qs + (size_t)i * dk + d, x);
#endif
        }
        for (uint32_t d = 0; d < dv; d += 16) _mm512_storeu_ps(o + (size_t)i * dv + d, _mm512_setzero_ps());
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = 0; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0), kb = j0 / BK;
        /* S = (q·scale) Kᵀ for the block, four query rows at a time */
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
#if ATTN_BF16
            qk_bf16_4x64(qw + (size_t)i * dp, dp, k_head + (size_t)kb * dp * BK, s + (size_t)i * BK, nr);
#else
            qk_4x64(qs + (size_t)i * dk, dk, k_head + (size_t)kb * dk * BK, BK, s + (size_t)i * BK, nr);
#endif
        }
        /* online softmax: new running max, P = exp(S - max) on the visible keys, rescale O */
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
#if ATTN_BF16
                const __m256i pb = bf16_of(pv);
                _mm256_storeu_si256((__m256i *)((uint16_t *)(pw + (size_t)i * (BK / 2)) + 16 * cc), pb);
                vsum = _mm512_add_ps(vsum, f32_of(pb)); /* the weights actually applied */
#else
                _mm512_storeu_ps(sr + 16 * cc, pv);
                vsum = _mm512_add_ps(vsum, pv);
#endif
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
        /* O += P V, four rows by 64 value dims at a time */
        for (uint32_t i = 0; i < ni; i += 4) {
            const int nr = (int)HTP_MIN(4u, ni - i);
            for (uint32_t d0 = 0; d0 < dv; d0 += 64) {
                const int ncol = (int)HTP_MIN(64u, dv - d0);
#if ATTN_BF16
                pv_bf16_4x64(pw + (size_t)i * (BK / 2), (nj + 1) / 2, v_head + (size_t)kb * (BK / 2) * dv + d0, dv,
                             o + (size_t)i * dv + d0, dv, nr, ncol);
#else
                pv_4x64(s + (size_t)i * BK, nj, v_head + (size_t)j0 * dv + d0, dv, o + (size_t)i * dv + d0, dv,
                        nr, ncol);
#endif
            }
        }
    }
    for (uint32_t i = 0; i < ni; i++) {
        float *dst = c->out + (size_t)(i0 + i) * ostride + (size_t)h * dv;
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (uint32_t d = 0; d < dv; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)i * dv + d), inv));
    }
}

#undef ATTN_NAME
#undef ATTN_TARGET
#undef ATTN_BF16
