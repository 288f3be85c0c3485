/* Attention driver, generic over instruction sets (the table supplies the task kernel):
 * (head, query block) tasks dealt round-robin to the pool threads, so causal blocks of
 * different cost interleave; each output row is written by exactly one task. With bf16
 * products the table's bf16 kernels run when the CPU has AVX512_BF16 (K and V packed once per
 * call into bf16 pairs; under BF16_PV only V, K re-laid in fp32 panels as for fp32 products);
 * otherwise the generic body emulates their rounding. */
#include "htp_attn_body.h"

size_t htp_attn_scratch_floats(const htp_attn_ctx *c) {
    /* the generic body: kt, s, o, qs; the SIMD tasks: s, o, qs or qw, and pw ([BQ][BK / 2]) */
    return (size_t)c->dk * HTP_ATTN_BK + (size_t)HTP_ATTN_BQ * HTP_ATTN_BK +
           (size_t)HTP_ATTN_BQ * c->dv + (size_t)HTP_ATTN_BQ * c->dk +
           (size_t)HTP_ATTN_BQ * HTP_ATTN_BK / 2 + 64;
}

void htp_attn_task_portable(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    htp_attn_task_body(c, task, scratch);
}

void htp_swiglu_portable(const float *g, const float *u, uint64_t n, float *out) {
    htp_swiglu_body(g, u, n, out);
}

void htp_swiglu_oai_portable(const float *g, const float *u, uint64_t n, float alpha, float limit,
                             float *out) {
    htp_swiglu_oai_body(g, u, n, alpha, limit, out);
}

/* The i-th task handed out: heads one after another (the threads share one head's K and V,
 * a few MiB that stay in the last-level cache, instead of each streaming a different head's
 * from memory), and within a head the heavy (late) causal query blocks first, so the light
 * ones even out the threads at the end. */
static inline uint32_t attn_task_of(const htp_attn_ctx *c, uint32_t i) {
    const uint32_t h = i / c->n_qblk, qb = c->n_qblk - 1 - i % c->n_qblk;
    return h * c->n_qblk + qb;
}

static void attn_worker(void *arg, uint32_t ith, uint32_t nth) {
    const htp_attn_ctx *c = (const htp_attn_ctx *)arg;
    uint32_t *next = &((htp_attn_ctx *)arg)->next; /* the one field the threads update */
    float *scratch = (float *)htp_scratch(c->pool, ith, 1, 0);
    const uint32_t n_tasks = c->hq * c->n_qblk;
    if (c->kt) {
        /* Re-lay K and V once per call so that the blocks a task streams are contiguous (the
         * natural [t][h][d] strides put every row of a block in the same L1 set). */
        const uint32_t BK = HTP_ATTN_BK, cols = c->isa->attention_kt_cols;
        const size_t ks = (size_t)c->hkv * c->dk, vs = (size_t)c->hkv * c->dv;
        uint32_t b, e;
        /* one (KV head, key block) at a time, key by key: each key's row is read once,
         * contiguously, and the dk destination lines it scatters into stay in L1 for the
         * block's BK keys (walking a dimension across all keys instead touches a new line of
         * K for every element) */
        htp_split((uint32_t)(c->hkv * c->kt_ld), ith, nth, &b, &e);
        for (uint32_t it = b; it < e; it++) {
            const uint32_t hk = it / (uint32_t)c->kt_ld, kb = it % (uint32_t)c->kt_ld;
            float *dst = c->kt + ((size_t)hk * c->kt_ld + kb) * c->dk * BK;
            for (uint32_t jj = 0; jj < BK; jj++) {
                const size_t j = (size_t)kb * BK + jj;
                const float *src = c->k + j * ks + (size_t)hk * c->dk;
                /* panel jj / cols holds [dk][cols]: a register block's columns are contiguous */
                float *col = dst + (size_t)(jj / cols) * c->dk * cols + jj % cols;
                if (j < c->tk)
                    for (uint32_t d = 0; d < c->dk; d++) col[(size_t)d * cols] = src[d];
                else
                    for (uint32_t d = 0; d < c->dk; d++) col[(size_t)d * cols] = 0.0f;
            }
        }
        if (c->vp) {
            htp_split(c->hkv * c->tk, ith, nth, &b, &e);
            for (uint32_t rr = b; rr < e; rr++) {
                const uint32_t hk = rr / c->tk, j = rr % c->tk;
                memcpy(c->vp + (size_t)rr * c->dv, c->v + (size_t)j * vs + (size_t)hk * c->dv, sizeof(float) * c->dv);
            }
        }
    }
    if (c->vw) c->isa->attention_bf16_pack(c, ith, nth); /* V, and K when c->kw */
    if (c->kt || c->vw) htp_barrier(c->pool);
    void (*task)(const htp_attn_ctx *, uint32_t, float *) =
        !c->vw ? c->isa->attention_task : c->kw ? c->isa->attention_bf16_task : c->isa->attention_bf16_pv_task;
    for (uint32_t i; (i = htp_next(next)) < n_tasks;) task(c, attn_task_of(c, i), scratch);
}

htp_status htp_exec_attention(htp_exec *e, const htp_attention_params *p, const float *q,
                              const float *k, const float *v, const float *sinks, float *out) {
    const uint32_t t = p->t;
    if (t == 0) return HTP_OK;
    htp_attn_ctx c = {q, k, v, out, t, p->n_q_heads, p->n_kv_heads, p->dk, p->dv,
                      p->causal ? 1u : 0u, (t + HTP_ATTN_BQ - 1) / HTP_ATTN_BQ, p->scale,
                      NULL, NULL, 0, p->products, NULL, NULL, e->pool, e->isa,
                      t + p->n_ctx, p->n_ctx, 0, p->causal ? p->window : 0, sinks};
    const size_t need = htp_attn_scratch_floats(&c) * sizeof(float);
    for (uint32_t i = 0; i < htp_pool_nth(e->pool); i++)
        if (!htp_scratch(e->pool, i, 1, need)) return HTP_E_NOMEM;
    /* Which re-laid copies the tasks read (in the backend's shared per-op buffer, kept between
     * calls): K in fp32 panels of the table's register block (fp32 products, and the scores of
     * BF16_PV) or in bf16 pairs (BF16); V as contiguous rows (fp32) or in bf16 key pairs (both
     * bf16 modes). The native bf16 tasks need AVX512_BF16 / FEAT_BF16; elsewhere, and for head
     * dims not a multiple of 16, the generic body reads K and V as given. */
    const htp_isa *isa = e->isa;
    const int aligned = c.dk % 16 == 0 && c.dv % 16 == 0, native16 = aligned && htp_cpu_bf16();
    const int pv_native = c.bf16 == HTP_PRODUCTS_BF16_PV && native16 && isa->attention_bf16_pv_task;
    const int kt = isa->attention_kt_cols && aligned && (c.bf16 == HTP_PRODUCTS_F32 || pv_native);
    const int kw = c.bf16 == HTP_PRODUCTS_BF16 && native16 && isa->attention_bf16_task;
    const int vw = kw || (kt && c.bf16 == HTP_PRODUCTS_BF16_PV);
    if (kt || kw) {
        c.kt_ld = ((size_t)c.tk + HTP_ATTN_BK - 1) / HTP_ATTN_BK;
        const size_t keys = c.kt_ld * HTP_ATTN_BK * c.hkv;         /* padded key rows, all heads */
        const size_t k4 = kt ? keys * c.dk : keys / 2 * c.dk;      /* fp32 values or bf16 pairs */
        const size_t v4 = vw ? keys / 2 * c.dv : (size_t)c.tk * c.hkv * c.dv;
        char *buf = (char *)htp_scratch(e->pool, 0, 3, 4 * (k4 + v4)); /* 4-byte elements */
        if (!buf) return HTP_E_NOMEM;
        if (kt) c.kt = (float *)buf;
        else c.kw = (uint32_t *)buf;
        if (vw) c.vw = (uint32_t *)(buf + 4 * k4);
        else c.vp = (float *)(buf + 4 * k4);
    }
    htp_parallel(e->pool, attn_worker, &c);
    return HTP_OK;
}

/* K and V of every KV head into bf16 pairs (see htp_attn_ctx), rows split across threads, in
 * scalar code: the NEON table's packer (the AVX-512 one lays out the same words with the same
 * bits: htp_bf16_bits, nearest even, subnormals to zero). */
void htp_attn_bf16_pack_scalar(const htp_attn_ctx *c, uint32_t ith, uint32_t nth) {
    const uint32_t BK = HTP_ATTN_BK, dk = c->dk, dv = c->dv, t = c->tk; /* key rows */
    const uint32_t dp = dk / 2, nblk = (uint32_t)c->kt_ld;
    const size_t ks = (size_t)c->hkv * dk, vs = (size_t)c->hkv * dv;
    uint32_t b, e;
    htp_split(c->kw ? c->hkv * nblk : 0, ith, nth, &b, &e); /* K: not under BF16_PV */
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr / nblk, kb = rr % nblk;
        uint32_t *dst = c->kw + ((size_t)hk * nblk + kb) * dp * BK;
        for (uint32_t jj = 0; jj < BK; jj++) {
            const uint32_t j = kb * BK + jj;
            const float *src = c->k + (size_t)j * ks + (size_t)hk * dk;
            for (uint32_t p = 0; p < dp; p++)
                dst[(size_t)p * BK + jj] = j < t ? (uint32_t)htp_bf16_bits(src[2 * p]) |
                                                       (uint32_t)htp_bf16_bits(src[2 * p + 1]) << 16
                                                 : 0u;
        }
    }
    const uint32_t npair = nblk * (BK / 2);
    htp_split(c->hkv * npair, ith, nth, &b, &e);
    for (uint32_t rr = b; rr < e; rr++) {
        const uint32_t hk = rr / npair, jp = rr % npair, j = 2 * jp;
        uint32_t *dst = c->vw + ((size_t)hk * npair + jp) * dv;
        const float *v0 = c->v + (size_t)j * vs + (size_t)hk * dv;
        for (uint32_t d = 0; d < dv; d++) {
            const uint32_t lo = j < t ? htp_bf16_bits(v0[d]) : 0u;
            const uint32_t hi = j + 1 < t ? htp_bf16_bits(v0[vs + d]) : 0u;
            dst[d] = lo | hi << 16;
        }
    }
}
