/* The SIMD attention task, written once for every vector width: one (head, query block) with an
 * online softmax over key blocks of HTP_ATTN_BK. Included once per (instruction set, product
 * kind) by htp_attn_avx512.c, htp_attn_avx2.c and htp_attn_neon.c, with
 *   ATTN_NAME    the function's name,
 *   ATTN_TARGET  its target attribute,
 *   ATTN_BF16    0: fp32 products (q·scale and K pre-transposed as floats, P·V in fp32);
 *                1: bf16 products (AVX512_BF16's vdpbf16ps, NEON's BFMLALT / BFMLALB: q·scale,
 *                   K, V and the softmax weights rounded to bfloat16, fp32 sums; the row sums
 *                   add the weights actually applied; the includer supplies qk_bf16_4x64,
 *                   pv_bf16_4x64 and V_BF16_STORE(p, x), which stores the VW lanes of x rounded
 *                   to bfloat16 at the uint16_t pointer p and returns them as floats);
 *                2: bf16 P·V only (HTP_PRODUCTS_BF16_PV): S as with 0, P and V as with 1
 *                   (pv_bf16_4x64 and V_BF16_STORE),
 *   ATTN_MR, ATTN_MC  the fp32 register block: MR query rows x MC vectors of columns,
 * and the vector vocabulary of its instruction set:
 *   VF (the float vector type), VW (its lanes), V_LOAD, V_STORE, V_SET1,
 *   V_ZERO, V_FMA(a, b, c) = a·b + c, V_MUL, V_SUB, V_ADD, V_EXPNEG (exp of lanes <= 0),
 *   V_RMAX, V_RADD (horizontal max and sum), V_FIRST(n) (mask of the first n lanes; n may be
 *   <= 0 or >= VW), V_MASK_ANDNOT(a, b) (b and not a, on masks), V_MAX(a, x), V_MAXM(a, m, x)
 *   (max(a, x) where m, else a; the same max), V_ANDM(m, x) (x where m, else 0).
 * Everything else — the block loop, the key limits of causal, context and sliding-window
 * attention, the sinks, the running max and sum, the rescaling of O, the final normalisation
 * and the fp32 register block for both products — is shared. Each output element sums its products in one fixed order
 * (over d for S, over keys for O, fused multiply-adds), whatever the block shape, and a row's
 * softmax weights are summed in 16 lanes (key j in lane j % 16: 16 / VW vectors, halved
 * pairwise down to one, then V_RADD's tree over its VW lanes) reduced in one tree: the
 * portable body (htp_attn_body.h) follows the same operations, so every table gives the same
 * bits. */

/* C[MR][MC·VW] (+)= A[MR][kd] · B[kd][MC·VW]: A rows broadcast lane by lane, B rows loaded as
 * vectors (row stride ldb); nr rows and nc vectors are live. acc != 0 adds to C. */
#define ATTN_CAT2(a, b) a##b
#define ATTN_CAT(a, b) ATTN_CAT2(a, b)
#define ATTN_MK ATTN_CAT(ATTN_NAME, _mk)

#if ATTN_BF16 != 1
ATTN_TARGET static inline __attribute__((always_inline)) void ATTN_MK(
    const float *a, size_t lda, uint32_t kd, const float *b, size_t ldb, float *cm, size_t ldc,
    int nr, int nc, int acc_in) {
    VF acc[ATTN_MR][ATTN_MC];
    for (int r = 0; r < ATTN_MR; r++)
        for (int q = 0; q < ATTN_MC; q++)
            acc[r][q] = (acc_in && r < nr && q < nc) ? V_LOAD(cm + (size_t)r * ldc + VW * q) : V_ZERO();
    for (uint32_t d = 0; d < kd; d++) {
        const float *br = b + (size_t)d * ldb;
        VF bv[ATTN_MC];
        for (int q = 0; q < ATTN_MC; q++) bv[q] = q < nc ? V_LOAD(br + VW * q) : V_ZERO();
        for (int r = 0; r < ATTN_MR; r++) {
            const VF x = V_SET1(a[(size_t)(r < nr ? r : 0) * lda + d]);
            for (int q = 0; q < ATTN_MC; q++) acc[r][q] = V_FMA(x, bv[q], acc[r][q]);
        }
    }
    /* constant bounds: fully unrolled, the accumulators stay in registers (GCC keeps a copy
     * of them on the stack, stored every step, when the loops run to nr and nc) */
    for (int r = 0; r < ATTN_MR; r++)
        for (int q = 0; q < ATTN_MC; q++)
            if (r < nr && q < nc) V_STORE(cm + (size_t)r * ldc + VW * q, acc[r][q]);
}
#endif

/* One row's step of the online softmax over a key block: the new running max *m of the row's
 * scores sr on its visible keys (the first lim of the block, from lo on when lo > 0), their
 * weights P = exp(S - max) (fp32 over sr, or bf16 at pr: the weights actually applied), the
 * running sum *l rescaled and added to, and the row oi of O (dv values) rescaled. full: every
 * key is visible (a constant at each call, so those blocks run without masks; the same
 * values). */
#define ATTN_ROW ATTN_CAT(ATTN_NAME, _row)
#if ATTN_BF16
#define ATTN_PR uint16_t
#else
#define ATTN_PR float
#endif
ATTN_TARGET static inline __attribute__((always_inline)) void ATTN_ROW(
    float *sr, ATTN_PR *pr, float *oi, uint32_t dv, int lim, int lo, float *m, float *l, const int full) {
    const uint32_t BK = HTP_ATTN_BK;
#define ATTN_VIS(cc) (lo ? V_MASK_ANDNOT(V_FIRST(lo - (int)(cc)), V_FIRST(lim - (int)(cc))) : V_FIRST(lim - (int)(cc)))
    VF vmx = V_SET1(*m);
    for (uint32_t cc = 0; cc < BK; cc += VW)
        vmx = full ? V_MAX(vmx, V_LOAD(sr + cc)) : V_MAXM(vmx, ATTN_VIS(cc), V_LOAD(sr + cc));
    const float mx = V_RMAX(vmx);
    const VF vm = V_SET1(mx);
    /* the row sum in 16 lanes, key j in lane j % 16: vector u of vsum holds lanes
     * u·VW .. u·VW + VW - 1 */
    VF vsum[16 / VW];
    for (int u = 0; u < 16 / VW; u++) vsum[u] = V_ZERO();
    for (uint32_t c16 = 0; c16 < BK; c16 += 16)
        for (int u = 0; u < 16 / VW; u++) {
            const uint32_t cc = c16 + (uint32_t)u * VW;
            const VF e = V_EXPNEG(V_SUB(V_LOAD(sr + cc), vm));
            const VF pv = full ? e : V_ANDM(ATTN_VIS(cc), e);
#if ATTN_BF16 /* the weights actually applied, as bf16 */
            vsum[u] = V_ADD(vsum[u], V_BF16_STORE(pr + cc, pv));
#else
            V_STORE(pr + cc, pv);
            vsum[u] = V_ADD(vsum[u], pv);
#endif
        }
    /* the 16-lane tree's first steps: upper half + lower half while wider than VW */
    for (int n = 16 / VW / 2; n >= 1; n /= 2)
        for (int u = 0; u < n; u++) vsum[u] = V_ADD(vsum[u + n], vsum[u]);
    /* (an unchanged max: exp(0) = 1 exactly, the scalar exp skipped) */
    const float corr = *m == -INFINITY ? 0.0f : *m == mx ? 1.0f : htp_exp_neg(*m - mx);
    *l = HTP_FMAF(*l, corr, V_RADD(vsum[0])); /* fused: no contraction can change it */
    *m = mx;
    if (corr != 1.0f) {
        const VF vc = V_SET1(corr);
        for (uint32_t d = 0; d < dv; d += VW) V_STORE(oi + d, V_MUL(V_LOAD(oi + d), vc));
    }
#undef ATTN_VIS
}
#undef ATTN_PR

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
#if ATTN_BF16 == 1
    const uint32_t dp = dk / 2, nblk = (uint32_t)c->kt_ld;
    const uint32_t *k_head = c->kw + (size_t)hk * nblk * dp * BK;       /* [kblk][dp][BK] pairs */
    const uint32_t *v_head = c->vw + (size_t)hk * nblk * (BK / 2) * dv; /* [kblk][BK/2][dv] pairs */
    uint32_t *qw = (uint32_t *)(o + (size_t)BQ * dv);                    /* [BQ][dp] q·scale pairs */
    uint32_t *pw = qw + (size_t)BQ * dp;                                 /* [BQ][BK/2] P pairs */
#elif ATTN_BF16 == 2
    const float *k_head = c->kt + (size_t)hk * c->kt_ld * dk * BK;                 /* as below */
    const uint32_t *v_head = c->vw + (size_t)hk * c->kt_ld * (BK / 2) * dv; /* [kblk][BK/2][dv] pairs */
    float *qs = o + (size_t)BQ * dv;                                        /* [BQ][dk] q·scale */
    uint32_t *pw = (uint32_t *)(qs + (size_t)BQ * dk);                      /* [BQ][BK/2] P pairs */
    const uint32_t CB = ATTN_MC * VW;
#else
    /* [kblk][BK / CB panels][dk][CB]: the driver lays K in panels of the table's
     * attention_kt_cols, which is this register block's CB */
    const float *k_head = c->kt + (size_t)hk * c->kt_ld * dk * BK;
    const float *v_head = c->vp + (size_t)hk * c->tk * dv;         /* [key][dv] */
    float *qs = o + (size_t)BQ * dv;                               /* [BQ][dk] q·scale */
    const uint32_t CB = ATTN_MC * VW;                              /* columns per register block */
#endif
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    const VF vscale = V_SET1(c->scale);
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        for (uint32_t d = 0; d < dk; d += VW) {
            const VF x = V_MUL(V_LOAD(qi + d), vscale);
#if ATTN_BF16 == 1
            (void)V_BF16_STORE((uint16_t *)(qw + (size_t)i * dp) + d, x);
#else
            V_STORE(qs + (size_t)i * dk + d, x);
#endif
        }
        for (uint32_t d = 0; d < dv; d += VW) V_STORE(o + (size_t)i * dv + d, V_ZERO());
        /* a sink is a key of logit sinks[h] and value 0: it starts the running max and sum */
        m[i] = c->sinks ? c->sinks[h] : -INFINITY;
        l[i] = c->sinks ? 1.0f : 0.0f;
    }
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = htp_attn_key_begin(c, i0) / BK * BK; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0), kb = j0 / BK;
        /* S = (q·scale) Kᵀ for the block */
#if ATTN_BF16 == 1
        /* (the full 4-row block a constant: a loop free of the partial block's tests) */
        for (uint32_t i = 0; i < ni; i += 4) {
            const uint32_t *kwb = k_head + (size_t)kb * dp * BK;
            if (ni - i >= 4) qk_bf16_4x64(qw + (size_t)i * dp, dp, kwb, s + (size_t)i * BK, 4);
            else qk_bf16_4x64(qw + (size_t)i * dp, dp, kwb, s + (size_t)i * BK, (int)(ni - i));
        }
#else
        /* column blocks outside: one block of K's columns stays in L1 for every row block */
        for (uint32_t c0 = 0; c0 < BK; c0 += CB)
            for (uint32_t i = 0; i < ni; i += ATTN_MR)
                ATTN_MK(qs + (size_t)i * dk, dk, dk, k_head + (size_t)kb * dk * BK + (size_t)c0 * dk, CB,
                        s + (size_t)i * BK + c0, BK, (int)HTP_MIN((uint32_t)ATTN_MR, ni - i), ATTN_MC, 0);
#endif
        /* online softmax: new running max, P = exp(S - max) on the visible keys, rescale O;
         * rows that see the whole block take the body without masks */
        for (uint32_t i = 0; i < ni; i++) {
            const int lim = (int)htp_attn_key_lim(c, i0 + i, j0, nj);
            const int lo = (int)htp_attn_key_lo(c, i0 + i, j0); /* > 0: a sliding window */
#if ATTN_BF16
            uint16_t *pr = (uint16_t *)(pw + (size_t)i * (BK / 2));
#else
            float *pr = s + (size_t)i * BK;
#endif
            if (!lo && lim >= (int)BK) ATTN_ROW(s + (size_t)i * BK, pr, o + (size_t)i * dv, dv, lim, lo, &m[i], &l[i], 1);
            else ATTN_ROW(s + (size_t)i * BK, pr, o + (size_t)i * dv, dv, lim, lo, &m[i], &l[i], 0);
        }
        /* O += P V */
#if ATTN_BF16
        for (uint32_t i = 0; i < ni; i += 4)
            for (uint32_t d0 = 0; d0 < dv; d0 += 64) {
                const uint32_t *pwi = pw + (size_t)i * (BK / 2), *vwb = v_head + (size_t)kb * (BK / 2) * dv + d0;
                float *oi = o + (size_t)i * dv + d0;
                if (ni - i >= 4 && dv - d0 >= 64) pv_bf16_4x64(pwi, (nj + 1) / 2, vwb, dv, oi, dv, 4, 64);
                else pv_bf16_4x64(pwi, (nj + 1) / 2, vwb, dv, oi, dv, (int)HTP_MIN(4u, ni - i), (int)HTP_MIN(64u, dv - d0));
            }
#else
        for (uint32_t d0 = 0; d0 < dv; d0 += CB)
            for (uint32_t i = 0; i < ni; i += ATTN_MR)
                ATTN_MK(s + (size_t)i * BK, BK, nj, v_head + (size_t)j0 * dv + d0, dv, o + (size_t)i * dv + d0,
                        dv, (int)HTP_MIN((uint32_t)ATTN_MR, ni - i), (int)(HTP_MIN(CB, dv - d0) / VW), 1);
#endif
    }
    for (uint32_t i = 0; i < ni; i++) {
        float *dst = c->out + (size_t)(i0 + i) * ostride + (size_t)h * dv;
        const VF inv = V_SET1(1.0f / l[i]);
        for (uint32_t d = 0; d < dv; d += VW) V_STORE(dst + d, V_MUL(V_LOAD(o + (size_t)i * dv + d), inv));
    }
}

#undef ATTN_ROW
#undef ATTN_MK
#undef ATTN_NAME
#undef ATTN_TARGET
#undef ATTN_BF16
