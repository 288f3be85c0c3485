/* Attention driver: (head, query block) tasks dealt round-robin to the pool threads, so causal
 * blocks of different cost interleave; each output row is written by exactly one task. */
#include "htp_attn_body.h"

size_t htp_attn_scratch_floats(const htp_attn_ctx *c) {
    return (size_t)c->dk * HTP_ATTN_BK + (size_t)HTP_ATTN_BQ * HTP_ATTN_BK +
           (size_t)HTP_ATTN_BQ * c->dv + (size_t)HTP_ATTN_BQ * c->dk + 64;
}

void htp_attn_task_portable(const htp_attn_ctx *c, uint32_t task, float *scratch) {
    htp_attn_task_body(c, task, scratch);
}

static void attn_worker(void *arg, uint32_t ith, uint32_t nth) {
    const htp_attn_ctx *c = (const htp_attn_ctx *)arg;
    float *scratch = (float *)htp_scratch(ith, 1, 0);
    const uint32_t n_tasks = c->hq * c->n_qblk;
    /* Heavy (late) causal blocks first, dealt round-robin. */
    for (uint32_t i = ith; i < n_tasks; i += nth) {
        const uint32_t h = i % c->hq, qb = c->n_qblk - 1 - i / c->hq;
        htp_k.attention_task(c, h * c->n_qblk + qb, scratch);
    }
}

htp_status htp_attention(const float *q, const float *k, const float *v, uint32_t t,
                         uint32_t n_q_heads, uint32_t n_kv_heads, uint32_t dk, uint32_t dv,
                         float scale, uint32_t causal, float *out) {
    htp_ensure_init();
    if (!q || !k || !v || !out || n_q_heads == 0 || n_kv_heads == 0 || dk == 0 || dv == 0 ||
        n_q_heads % n_kv_heads)
        return HTP_E_INVALID;
    if (t == 0) return HTP_OK;
    htp_attn_ctx c = {q, k, v, out, t, n_q_heads, n_kv_heads, dk, dv, causal ? 1u : 0u,
                      (t + HTP_ATTN_BQ - 1) / HTP_ATTN_BQ, scale};
    const size_t need = htp_attn_scratch_floats(&c) * sizeof(float);
    for (uint32_t i = 0; i < htp_nth(); i++)
        if (!htp_scratch(i, 1, need)) return HTP_E_NOMEM;
    htp_parallel(attn_worker, &c);
    return HTP_OK;
}
