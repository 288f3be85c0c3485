/* Flash-style attention body (one query block of one head: key blocks from the first the
 * block's sliding window reaches to the last its causal rows see, an online softmax that starts
 * from the head's sink when there is one), instantiated per SIMD level. With
 * c->bf16 it rounds q*scale, k, v and the softmax weights to bfloat16 exactly as the native
 * bf16 kernels do (products and sums stay fp32). */
#ifndef ESTREAM_HTP_ATTN_BODY_H
#define ESTREAM_HTP_ATTN_BODY_H

#include "htp_internal.h"

#define HTP_INLINE static inline __attribute__((always_inline))

/* exp(x) for x <= 0 (attention scores minus the running max); ~2 ulp, vectorisable. */
HTP_INLINE float htp_exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float l2e = 1.44269504088896341f;
    const float magic = 12582912.0f; /* 1.5 * 2^23: rounds to nearest integer */
    float n = (x * l2e + magic) - magic;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
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

HTP_INLINE void htp_attn_task_body(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    const uint32_t BQ = HTP_ATTN_BQ, BK = HTP_ATTN_BK;
    const uint32_t h = task / c->n_qblk, qb = task % c->n_qblk;
    const uint32_t hk = h / (c->hq / c->hkv);
    const uint32_t dk = c->dk, dv = c->dv;
    const int bf16 = c->bf16 != 0; /* emulate HTP_PRODUCTS_BF16's rounding */
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
        if (bf16)
            for (uint32_t d = 0; d < dk; d++) qs[(size_t)i * dk + d] = htp_bf16_round(qs[(size_t)i * dk + d]);
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
            if (bf16)
                for (uint32_t d = 0; d < dk; d++) kt[(size_t)d * BK + j] = htp_bf16_round(kj[d]);
            else
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
                for (uint32_t j = 0; j < BK; j++) sr[j] += qv * kr[j];
            }
            /* valid keys for row i: begin_i <= j0 + j < end_i */
            const uint32_t lim = htp_attn_key_lim(c, i0 + i, j0, nj), lo = htp_attn_key_lo(c, i0 + i, j0);
            float mx = m[i];
            for (uint32_t j = lo; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
            float *srow = s + (size_t)i * BK;
            float sum = 0.0f;
            for (uint32_t j = 0; j < BK; j++) {
                float p = j >= lo && j < lim ? htp_exp_neg(sr[j] - mx) : 0.0f;
                if (bf16) p = htp_bf16_round(p);
                srow[j] = p;
                sum += p;
            }
            const float corr = m[i] == -INFINITY ? 0.0f : htp_exp_neg(m[i] - mx);
            l[i] = l[i] * corr + sum;
            m[i] = mx;
            float *oi = o + (size_t)i * dv;
            for (uint32_t d = 0; d < dv; d++) oi[d] *= corr;
        }
        for (uint32_t i = 0; i < ni; i++) {
            float *oi = o + (size_t)i * dv;
            const float *srow = s + (size_t)i * BK;
            for (uint32_t j = 0; j < nj; j++) {
                const float p = srow[j];
                const float *vj = c->v + (size_t)(j0 + j) * vstride + (size_t)hk * dv;
                if (bf16)
                    for (uint32_t d = 0; d < dv; d++) oi[d] += p * htp_bf16_round(vj[d]);
                else
                    for (uint32_t d = 0; d < dv; d++) oi[d] += p * vj[d];
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
