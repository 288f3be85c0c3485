/* Flash-style attention body (one query block of one head: key blocks from the first the
 * block's sliding window reaches to the last its causal rows see, an online softmax that starts
 * from the head's sink when there is one), instantiated per SIMD level. It follows the SIMD
 * tasks of htp_attn_task.h operation for operation, so every table (portable, AVX2, AVX-512,
 * NEON, HVX) gives the same bits: each score and output element sums its products in order
 * with fused multiply-adds, the exp is the vector one's, a row's softmax weights are summed in
 * 16 lanes (key j in lane j % 16) reduced in one tree (htp_radd16). With HTP_PRODUCTS_BF16 it
 * is htp_attn_task_bf16_body: the native AVX512_BF16 kernel's operations, emulated bit for bit;
 * with HTP_PRODUCTS_BF16_PV the fp32 scores of the fp32 body and that kernel's P·V. */
#ifndef ESTREAM_HTP_ATTN_BODY_H
#define ESTREAM_HTP_ATTN_BODY_H

#include "htp_internal.h"

#define HTP_INLINE static inline __attribute__((always_inline))

/* HTP_FMAF(a, b, c) = a*b + c rounded once (as in htp_gemm_body.h): Hexagon's sffma, elsewhere
 * the compiler's fmaf (one instruction in the FMA-targeted tables). In the attention and SwiGLU
 * bodies every product that feeds a sum is such a fused multiply-add, and every other product
 * feeds only a store, a call or another product, so no compiler contraction (GCC's default
 * -ffp-contract=fast in the FMA-targeted tables, none on Hexagon) can change their sequence. */
#ifndef HTP_FMAF
#if defined(__hexagon__)
#define HTP_FMAF(a, b, c) __builtin_HEXAGON_F2_sffma((c), (a), (b))
#else
#define HTP_FMAF(a, b, c) __builtin_fmaf((a), (b), (c))
#endif
#endif

/* exp(x) for x <= 0 (attention scores minus the running max); ~2 ulp. The vector exp of the
 * SIMD tables (htp_attn_vexp.h) operation for operation, so scalar and vector lanes give the
 * same bits: max(x, -87) (NaN becomes -87, as maxps), n = x*log2(e) rounded to the nearest
 * integer (ties to even, the default rounding mode), the two-constant reduction and the
 * degree-6 polynomial in fused multiply-adds, then p*2^n. */
HTP_INLINE float htp_exp_neg(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float n = nearbyintf(x * 1.44269504088896341f); /* |n| <= 126 */
    float r = HTP_FMAF(-n, 0.693145751953125f, x);
    r = HTP_FMAF(-n, 1.428606765330187045e-06f, r);
    float p = 1.0f / 720.0f;
    p = HTP_FMAF(p, r, 1.0f / 120.0f);
    p = HTP_FMAF(p, r, 1.0f / 24.0f);
    p = HTP_FMAF(p, r, 1.0f / 6.0f);
    p = HTP_FMAF(p, r, 0.5f);
    p = HTP_FMAF(p, r, 1.0f);
    p = HTP_FMAF(p, r, 1.0f);
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* out[i] = silu(g[i]) * (u ? u[i] : 1), vectorisable (sigmoid via exp(-|x|), no overflow). */
HTP_INLINE void htp_swiglu_body(const float *g, const float *u, uint64_t n, float *out) {
    for (uint64_t i = 0; i < n; i++) {
        const float x = g[i];
        const float e = htp_exp_neg(-fabsf(x));
        const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[i] = u ? x * sig * u[i] : x * sig;
    }
}

/* out[i] = gpt-oss's SwiGLU-OAI of g[i], u[i]: x = min(g, limit), v = u clamped to
 * [-limit, limit], x·sigmoid(alpha·x)·(v + 1), the sigmoid as htp_swiglu_body's. The clamps are
 * ordered compares, so a NaN passes through them (and out is NaN). out may be g or u. */
HTP_INLINE void htp_swiglu_oai_body(const float *g, const float *u, uint64_t n, float alpha,
                                    float limit, float *out) {
    for (uint64_t i = 0; i < n; i++) {
        const float x = g[i] > limit ? limit : g[i];
        const float v = u[i] > limit ? limit : (-limit > u[i] ? -limit : u[i]);
        const float z = alpha * x;
        const float e = htp_exp_neg(-fabsf(z));
        const float sig = (z >= 0.0f ? 1.0f : e) / (1.0f + e);
        const float s = x * sig;
        out[i] = s * (v + 1.0f);
    }
}

/* fp32 results flushed to zero below FLT_MIN (sign kept), as vdpbf16ps's FTZ output */
HTP_INLINE float htp_ftz(float x) { return fabsf(x) < 1.17549435e-38f ? x * 0.0f : x; }
/* acc + a1*b1, then + a0*b0, each one fused multiply-add flushed to zero: vdpbf16ps on one lane
 * (the odd bfloat16 of the pair first; products of bfloat16 values are exact in fp32) */
HTP_INLINE float htp_dpbf16(float acc, float a0, float b0, float a1, float b1) {
    acc = htp_ftz(HTP_FMAF(a1, b1, acc));
    return htp_ftz(HTP_FMAF(a0, b0, acc));
}
/* the sum of 16 lanes in _mm512_reduce_add_ps's tree (upper half + lower, twice, then the two
 * pairs), as the bf16 task of htp_attn_avx512.c adds its row sums */
HTP_INLINE float htp_radd16(const float *v) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = v[i + 8] + v[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[i + 4] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

/* O[dv] += P·V for one query row over a block's first nj keys from key j0 (KV head hk) with
 * bf16 products: key pairs (2jp, 2jp + 1), each a vdpbf16ps lane (the odd key first) on the
 * row's weights p (already bfloat16 values, BK of them, zero past the visible keys) and V
 * rounded to bfloat16; keys past the end of V are zero rows. */
HTP_INLINE void htp_attn_pv_bf16_row(const htp_attn_ctx *c, uint32_t hk, uint32_t j0, uint32_t nj,
                                     const float *p, float *oi) {
    const uint32_t dv = c->dv;
    const size_t vstride = (size_t)c->hkv * dv;
    for (uint32_t j = 0; j < nj; j += 2) {
        const float *v0 = c->v + (size_t)(j0 + j) * vstride + (size_t)hk * dv;
        const int has1 = j0 + j + 1 < c->tk;
        const float *v1 = has1 ? v0 + vstride : v0;
        for (uint32_t d = 0; d < dv; d++)
            oi[d] = htp_dpbf16(oi[d], p[j], htp_bf16_round(v0[d]), p[j + 1],
                               has1 ? htp_bf16_round(v1[d]) : 0.0f);
    }
}

/* One (head, query block) task with bf16 products, the AVX512_BF16 task of htp_attn_task.h and
 * htp_attn_avx512.c (vdpbf16ps, 16 lanes, HTP_ATTN_BK keys per block) operation for operation,
 * so every table gives its bits: q·scale, K, V and the softmax weights rounded to bfloat16;
 * S = sum over dimension pairs (odd first) as vdpbf16ps adds them; P = bf16(exp(S - max)) on the
 * visible keys, their sum in 16 lanes (key j in lane j % 16) reduced as htp_radd16; l = l·corr
 * + sum; O rescaled by corr, then O += P·V over key pairs (odd first) as vdpbf16ps; out = O·(1/l). */
HTP_INLINE void htp_attn_task_bf16_body(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv;
    const uint32_t i0 = qb * BQ, ni = HTP_MIN(BQ, c->t - i0);
    const size_t qstride = (size_t)c->hq * dk, kstride = (size_t)c->hkv * dk;
    const size_t ostride = (size_t)c->hq * dv;
    float *kt = scratch;              /* [dk][BK] bf16-rounded keys */
    float *s = kt + (size_t)dk * BK;  /* [BQ][BK] */
    float *o = s + (size_t)BQ * BK;   /* [BQ][dv] */
    float *qs = o + (size_t)BQ * dv;  /* [BQ][dk], pre-scaled bf16 queries */
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        for (uint32_t d = 0; d < dk; d++) qs[(size_t)i * dk + d] = htp_bf16_round(qi[d] * c->scale);
        for (uint32_t d = 0; d < dv; d++) o[(size_t)i * dv + d] = 0.0f;
        m[i] = c->sinks ? c->sinks[h] : -INFINITY;
        l[i] = c->sinks ? 1.0f : 0.0f;
    }
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = htp_attn_key_begin(c, i0) / BK * BK; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0);
        for (uint32_t j = 0; j < BK; j++) {
            const float *kj = c->k + (size_t)(j0 + j) * kstride + (size_t)hk * dk;
            for (uint32_t d = 0; d < dk; d++) kt[(size_t)d * BK + j] = j < nj ? htp_bf16_round(kj[d]) : 0.0f;
        }
        for (uint32_t i = 0; i < ni; i++) {
            float sr[HTP_ATTN_BK];
            for (uint32_t j = 0; j < BK; j++) sr[j] = 0.0f;
            const float *qi = qs + (size_t)i * dk;
            for (uint32_t d = 0; d < dk; d += 2) {
                const float q0 = qi[d], q1 = d + 1 < dk ? qi[d + 1] : 0.0f;
                const float *k0 = kt + (size_t)d * BK, *k1 = d + 1 < dk ? k0 + BK : k0;
                for (uint32_t j = 0; j < BK; j++) sr[j] = htp_dpbf16(sr[j], q0, k0[j], q1, d + 1 < dk ? k1[j] : 0.0f);
            }
            const uint32_t lim = htp_attn_key_lim(c, i0 + i, j0, nj), lo = htp_attn_key_lo(c, i0 + i, j0);
            float mx = m[i];
            for (uint32_t j = lo; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
            float *srow = s + (size_t)i * BK;
            float lane[16];
            for (uint32_t u = 0; u < 16; u++) lane[u] = 0.0f;
            for (uint32_t j = 0; j < BK; j++) {
                const float p = j >= lo && j < lim ? htp_bf16_round(htp_exp_neg(sr[j] - mx)) : 0.0f;
                srow[j] = p;
                lane[j % 16] += p;
            }
            const float corr = m[i] == -INFINITY ? 0.0f : htp_exp_neg(m[i] - mx);
            l[i] = HTP_FMAF(l[i], corr, htp_radd16(lane));
            m[i] = mx;
            float *oi = o + (size_t)i * dv;
            if (corr != 1.0f)
                for (uint32_t d = 0; d < dv; d++) oi[d] *= corr;
        }
        /* key pairs up to the block's last visible key */
        for (uint32_t i = 0; i < ni; i++)
            htp_attn_pv_bf16_row(c, hk, j0, nj, s + (size_t)i * BK, o + (size_t)i * dv);
    }
    for (uint32_t i = 0; i < ni; i++) {
        float *dst = c->out + (size_t)(i0 + i) * ostride + (size_t)h * dv;
        const float inv = 1.0f / l[i];
        for (uint32_t d = 0; d < dv; d++) dst[d] = o[(size_t)i * dv + d] * inv;
    }
}

HTP_INLINE void htp_attn_task_body(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    if (c->bf16 == HTP_PRODUCTS_BF16) {
        htp_attn_task_bf16_body(c, task, scratch);
        return;
    }
    const int pv16 = c->bf16 == HTP_PRODUCTS_BF16_PV; /* P and V rounded to bfloat16 */
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv;
    const uint32_t i0 = qb * BQ, ni = HTP_MIN(BQ, c->t - i0);
    const size_t qstride = (size_t)c->hq * dk, kstride = (size_t)c->hkv * dk;
    const size_t vstride = (size_t)c->hkv * dv, ostride = (size_t)c->hq * dv;
    float *kt = scratch;              /* [dk][BK] */
    float *s = kt + (size_t)dk * BK;  /* [BQ][BK] */
    float *o = s + (size_t)BQ * BK;   /* [BQ][dv] */
    float *qs = o + (size_t)BQ * dv;  /* [BQ][dk], pre-scaled queries */
    float m[HTP_ATTN_BQ], l[HTP_ATTN_BQ];
    for (uint32_t i = 0; i < ni; i++) {
        const float *qi = c->q + (size_t)(i0 + i) * qstride + (size_t)h * dk;
        for (uint32_t d = 0; d < dk; d++) qs[(size_t)i * dk + d] = qi[d] * c->scale;
        for (uint32_t d = 0; d < dv; d++) o[(size_t)i * dv + d] = 0.0f;
        /* a sink is a key of logit sinks[h] and value 0: it starts the running max and sum */
        m[i] = c->sinks ? c->sinks[h] : -INFINITY;
        l[i] = c->sinks ? 1.0f : 0.0f;
    }
    const uint32_t kend = htp_attn_key_end(c, i0 + ni - 1);
    for (uint32_t j0 = htp_attn_key_begin(c, i0) / BK * BK; j0 < kend; j0 += BK) {
        const uint32_t nj = HTP_MIN(BK, kend - j0);
        for (uint32_t j = 0; j < nj; j++) {
            const float *kj = c->k + (size_t)(j0 + j) * kstride + (size_t)hk * dk;
            for (uint32_t d = 0; d < dk; d++) kt[(size_t)d * BK + j] = kj[d];
        }
        for (uint32_t j = nj; j < BK; j++)
            for (uint32_t d = 0; d < dk; d++) kt[(size_t)d * BK + j] = 0.0f;
        for (uint32_t i = 0; i < ni; i++) {
            float sr[HTP_ATTN_BK];
            for (uint32_t j = 0; j < BK; j++) sr[j] = 0.0f;
            const float *qi = qs + (size_t)i * dk;
            for (uint32_t d = 0; d < dk; d++) {
                const float qv = qi[d];
                const float *kr = kt + (size_t)d * BK;
                for (uint32_t j = 0; j < BK; j++) sr[j] = HTP_FMAF(qv, kr[j], sr[j]);
            }
            /* valid keys for row i: begin_i <= j0 + j < end_i */
            const uint32_t lim = htp_attn_key_lim(c, i0 + i, j0, nj), lo = htp_attn_key_lo(c, i0 + i, j0);
            float mx = m[i];
            for (uint32_t j = lo; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
            float *srow = s + (size_t)i * BK;
            float lane[16];
            for (uint32_t u = 0; u < 16; u++) lane[u] = 0.0f;
            for (uint32_t j = 0; j < BK; j++) {
                float p = j >= lo && j < lim ? htp_exp_neg(sr[j] - mx) : 0.0f;
                if (pv16) p = htp_bf16_round(p);
                srow[j] = p;
                lane[j % 16] += p;
            }
            const float corr = m[i] == -INFINITY ? 0.0f : htp_exp_neg(m[i] - mx);
            l[i] = HTP_FMAF(l[i], corr, htp_radd16(lane));
            m[i] = mx;
            float *oi = o + (size_t)i * dv;
            for (uint32_t d = 0; d < dv; d++) oi[d] *= corr;
        }
        for (uint32_t i = 0; i < ni; i++) {
            float *oi = o + (size_t)i * dv;
            const float *srow = s + (size_t)i * BK;
            if (pv16) { /* key pairs, as the bf16 body */
                htp_attn_pv_bf16_row(c, hk, j0, nj, srow, oi);
                continue;
            }
            for (uint32_t j = 0; j < nj; j++) {
                const float p = srow[j];
                const float *vj = c->v + (size_t)(j0 + j) * vstride + (size_t)hk * dv;
                for (uint32_t d = 0; d < dv; d++) oi[d] = HTP_FMAF(p, vj[d], oi[d]);
            }
        }
    }
    for (uint32_t i = 0; i < ni; i++) {
        float *dst = c->out + (size_t)(i0 + i) * ostride + (size_t)h * dv;
        const float inv = 1.0f / l[i];
        for (uint32_t d = 0; d < dv; d++) dst[d] = o[(size_t)i * dv + d] * inv;
    }
}

#endif
