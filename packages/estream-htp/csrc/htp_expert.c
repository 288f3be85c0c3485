/* The fused routed-expert op.
 *
 * Per pass of at most `capacity` routes: resolve each route's slot, count routes per slot,
 * prefix-sum into offsets, scatter route records by slot (stable, empty slots skipped), then in
 * one parallel region:
 *   (a) gather the routed token rows (in Q8 mode: rows quantized once per token before the
 *       passes, or by the caller once for several ops: x_q8), partitioned by record;
 *   (b) gate and up GEMMs (+ their experts' biases) + the gated activation (SwiGLU, ReGLU or
 *       SwiGLU-OAI: htp.h's htp_glu): work items (up to SUB routes of one slot, a block of
 *       d_ff tiles), handed out as threads come free;
 *   (c) down GEMM (+ its expert's bias) + scatter-add weight*y: work items (a block of d_model
 *       tiles, over every slot in order), handed out the same way. Each item reads every
 *       routed row of h once, so there are only ~4 per thread: more would multiply that
 *       traffic (32 MB of h at 4K tokens) for no better balance.
 * Every output element is produced by one thread in slot order, so results are bit-identical
 * for any thread count and whichever thread takes an item. */
#include "htp_internal.h"

#define SUB 128  /* routes per GEMM call inside a slot (bounds per-thread scratch) */
#define FBLK 4   /* d_ff tiles per gate/up work item */

/* The working set of a backend's expert op, grown to the largest (capacity, d_model, d_ff)
 * seen and kept between calls (one op at a time per backend). */
struct htp_expert_ws {
    size_t cap, d, ff;  /* sizes the route arrays and activation buffers were allocated for */
    int32_t *rec_route; /* [C] route index (within the pass) of each record, sorted by slot */
    int32_t *route_slot;
    int32_t *stage; /* [C] route ids selected for the current pass, before sorting */
    int32_t *seg_slot, *seg_begin, *seg_len; /* [C] non-empty slots */
    int32_t *sub_seg, *sub_r0; /* [C] pieces of at most SUB routes of one slot: (segment, first) */
    uint32_t *counts;
    uint32_t counts_cap;
    float *xg;       /* f32 mode: [C][d] */
    float *h;        /* f32 mode: [C][ff] */
    int8_t *xq, *hq; /* q8 mode */
    float *xd, *hd;
    int32_t *xs, *hs;
    int32_t *xz, *hz; /* q8 mode: [C][d/32][2] / [C][ff/32][2], Q6_K start values (htp_act_q8.z) */
    float *xsd, *hsd; /* q8 mode: [C][d/32] / [C][ff/32], Q4_K / Q5_K sa·da (htp_act_q8.sd) */
    size_t tok_cap;  /* q8 mode: rows the per-token quantized input below holds */
    int8_t *tq;      /* [T][d]: each routed token's row quantized once per op, gathered per route */
    float *td;
    int32_t *ts;
    uint8_t *tseen;  /* [T] a token already listed */
    int32_t *tlist;  /* [T] the distinct routed tokens */
};

typedef struct run_ctx {
    struct htp_expert_ws *g;
    const htp_isa *isa;
    htp_pool *pool;
    uint32_t d, ff;
    uint32_t fmt[3]; /* tile formats of gate, up, down */
    const uint8_t *const *planes;
    const uint64_t *stride;
    const float *x;
    const htp_act_q8 *rows; /* q8 mode: the quantized rows of x, indexed by token */
    const int32_t *tokens;
    const float *weights;
    float *y;
    uint32_t r0, nr, nseg, nsub;
    int q8;
    uint32_t next_b, next_c; /* the next work item of phases (b) and (c) (htp_next) */
    const int32_t *experts;  /* expert id of each route (bias rows) */
    const float *const *bias; /* gate [E][ff], up [E][ff], down [E][d], or NULLs */
    uint32_t glu;             /* htp_glu */
    float alpha, limit;       /* SwiGLU-OAI's */
} run_ctx;

/* g = act(g, u) over n values (htp.h's htp_glu): SwiGLU and SwiGLU-OAI the table's vector
 * bodies (the same bits on every table), ReGLU a scalar loop. */
static void glu_apply(const run_ctx *c, float *g, const float *u, uint32_t n) {
    if (c->glu == HTP_GLU_REGLU) {
        for (uint32_t i = 0; i < n; i++) g[i] = (g[i] < 0.0f ? 0.0f : g[i]) * u[i];
    } else if (c->glu == HTP_GLU_SWIGLU_OAI) {
        c->isa->swiglu_oai(g, u, n, c->alpha, c->limit, g);
    } else {
        c->isa->swiglu(g, u, n, g);
    }
}

static void ws_release(struct htp_expert_ws *g) {
    free(g->rec_route);
    free(g->route_slot);
    free(g->stage);
    free(g->seg_slot);
    free(g->seg_begin);
    free(g->seg_len);
    free(g->sub_seg);
    free(g->sub_r0);
    free(g->xg);
    free(g->h);
    free(g->xq);
    free(g->hq);
    free(g->xd);
    free(g->hd);
    free(g->xs);
    free(g->hs);
    free(g->xz);
    free(g->hz);
    free(g->xsd);
    free(g->hsd);
    free(g->tq);
    free(g->td);
    free(g->ts);
    free(g->tseen);
    free(g->tlist);
    uint32_t *counts = g->counts;
    const uint32_t counts_cap = g->counts_cap;
    memset(g, 0, sizeof(*g));
    g->counts = counts;
    g->counts_cap = counts_cap;
}

void htp_expert_ws_free(struct htp_expert_ws *g) {
    if (!g) return;
    ws_release(g);
    free(g->counts);
    free(g);
}

/* Route arrays for C routes; activation buffers for the format in use on first need:
 * q8 needs C*(d+ff)*(1+8/32) bytes (and C*(d+ff)*8/32 more, the Q6_K start values, once a
 * matrix is Q6_K; C*(d+ff)*4/32, the Q4_K / Q5_K sa·da, once one is Q4_K or Q5_K), f32
 * C*(d+ff)*4. */
static htp_status ws_reserve(struct htp_expert_ws *g, size_t c, size_t d, size_t ff, int q8,
                             int q6k, int q45k) {
    if (c > g->cap || d > g->d || ff > g->ff) {
        ws_release(g);
        g->cap = c, g->d = d, g->ff = ff;
        g->rec_route = malloc(c * 4);
        g->route_slot = malloc(c * 4);
        g->stage = malloc(c * 4);
        g->seg_slot = malloc(c * 4);
        g->seg_begin = malloc(c * 4);
        g->seg_len = malloc(c * 4);
        g->sub_seg = malloc(c * 4);
        g->sub_r0 = malloc(c * 4);
        if (!g->rec_route || !g->route_slot || !g->stage || !g->seg_slot || !g->seg_begin || !g->seg_len ||
            !g->sub_seg || !g->sub_r0) {
            ws_release(g);
            return HTP_E_NOMEM;
        }
    }
    c = g->cap, d = g->d, ff = g->ff;
    if (q8 && !g->xq) {
        g->xq = malloc(c * d);
        g->hq = malloc(c * ff);
        g->xd = malloc(c * d / 32 * 4);
        g->hd = malloc(c * ff / 32 * 4);
        g->xs = malloc(c * d / 32 * 4);
        g->hs = malloc(c * ff / 32 * 4);
        if (!g->xq || !g->hq || !g->xd || !g->hd || !g->xs || !g->hs) {
            free(g->xq), free(g->hq), free(g->xd), free(g->hd), free(g->xs), free(g->hs);
            g->xq = g->hq = NULL;
            g->xd = g->hd = NULL;
            g->xs = g->hs = NULL;
            return HTP_E_NOMEM;
        }
    }
    if (q8 && q6k && !g->xz) {
        g->xz = malloc(c * d / 32 * 8);
        g->hz = malloc(c * ff / 32 * 8);
        if (!g->xz || !g->hz) {
            free(g->xz), free(g->hz);
            g->xz = g->hz = NULL;
            return HTP_E_NOMEM;
        }
    }
    if (q8 && q45k && !g->xsd) {
        g->xsd = malloc(c * d / 32 * 4);
        g->hsd = malloc(c * ff / 32 * 4);
        if (!g->xsd || !g->hsd) {
            free(g->xsd), free(g->hsd);
            g->xsd = g->hsd = NULL;
            return HTP_E_NOMEM;
        }
    }
    if (!q8 && !g->xg) {
        g->xg = malloc(c * d * 4);
        g->h = malloc(c * ff * 4);
        if (!g->xg || !g->h) {
            free(g->xg), free(g->h);
            g->xg = g->h = NULL;
            return HTP_E_NOMEM;
        }
    }
    return HTP_OK;
}

static void run_task(void *arg, uint32_t ith, uint32_t nth) {
    run_ctx *c = (run_ctx *)arg;
    struct htp_expert_ws *g = c->g;
    const htp_isa *isa = c->isa;
    const uint32_t d = c->d, ff = c->ff, db = d / 32, fb = ff / 32;
    uint32_t b, e;

    /* the K-quant kernels' values of the rows they multiply, made with the rows: Q6_K start
     * values, Q4_K / Q5_K sa·da */
    const int xz = c->q8 && (c->fmt[0] == HTP_FMT_Q6_K_T32R4 || c->fmt[1] == HTP_FMT_Q6_K_T32R4);
    const int hz = c->q8 && c->fmt[2] == HTP_FMT_Q6_K_T32R4;
#define HTP_Q45K(f) ((f) == HTP_FMT_Q4_K_T32R4 || (f) == HTP_FMT_Q5_K_T32R4)
    const int xsd = c->q8 && (HTP_Q45K(c->fmt[0]) || HTP_Q45K(c->fmt[1]));
    const int hsd = c->q8 && HTP_Q45K(c->fmt[2]);
#undef HTP_Q45K

    /* (a) gather */
    htp_split(c->nr, ith, nth, &b, &e);
    for (uint32_t i = b; i < e; i++) {
        const size_t tok = (size_t)c->tokens[c->r0 + (uint32_t)g->rec_route[i]];
        if (c->q8) { /* the token's row, quantized once for all its routes */
            memcpy(g->xq + (size_t)i * d, c->rows->q + tok * d, d);
            memcpy(g->xd + (size_t)i * db, c->rows->d + tok * db, (size_t)db * 4);
            memcpy(g->xs + (size_t)i * db, c->rows->s + tok * db, (size_t)db * 4);
            if (xz) htp_q8_q6k_seeds(g->xq + (size_t)i * d, db, g->xz + (size_t)i * db * 2);
            if (xsd)
                htp_q8_q45k_sada(g->xd + (size_t)i * db, g->xs + (size_t)i * db, db,
                                 g->xsd + (size_t)i * db);
        } else {
            memcpy(g->xg + (size_t)i * d, c->x + tok * d, (size_t)d * 4);
        }
    }
    htp_barrier(c->pool);

    float *tmp = (float *)htp_scratch(c->pool, ith, 2, 0);
    float *panel = (float *)htp_scratch(c->pool, ith, 0, 0);

    /* (b) gate, up, their biases, the activation: items (piece of a slot's routes, block of
     * d_ff tiles) */
    const uint32_t n_fblk = (fb + FBLK - 1) / FBLK;
    for (uint32_t item; (item = htp_next(&c->next_b)) < c->nsub * n_fblk;) {
        const uint32_t sub = item / n_fblk;
        b = item % n_fblk * FBLK, e = HTP_MIN(fb, b + FBLK);
        const uint32_t ncol = (e - b) * 32;
        const uint32_t s = (uint32_t)g->sub_seg[sub], r0 = (uint32_t)g->sub_r0[sub];
        const uint64_t slot = (uint64_t)g->seg_slot[s];
        const uint8_t *wg = c->planes[0] + slot * c->stride[0];
        const uint8_t *wu = c->planes[1] + slot * c->stride[1];
        const uint32_t rec = (uint32_t)g->seg_begin[s] + r0;
        const uint32_t n = HTP_MIN(SUB, (uint32_t)g->seg_len[s] - r0);
        float *tg = tmp, *tu = tmp + (size_t)SUB * ncol;
        if (c->q8) {
            htp_act_q8 a = {g->xq + (size_t)rec * d, g->xd + (size_t)rec * db, g->xs + (size_t)rec * db,
                            xz ? g->xz + (size_t)rec * db * 2 : NULL,
                            xsd ? g->xsd + (size_t)rec * db : NULL};
            /* gate's last strip fetches up's first */
            const uint8_t *up_first = wu + (size_t)b * db * htp_tile_bytes(c->fmt[1]);
            htp_gemm_tiles(isa, wg, c->fmt[0], ff, d, b, e, &a, NULL, 0, n, tg, ncol, NULL, up_first);
            htp_gemm_tiles(isa, wu, c->fmt[1], ff, d, b, e, &a, NULL, 0, n, tu, ncol, NULL, NULL);
        } else {
            const float *xa = g->xg + (size_t)rec * d;
            htp_gemm_tiles(isa, wg, c->fmt[0], ff, d, b, e, NULL, xa, d, n, tg, ncol, panel, NULL);
            htp_gemm_tiles(isa, wu, c->fmt[1], ff, d, b, e, NULL, xa, d, n, tu, ncol, panel, NULL);
        }
        for (uint32_t i = 0; i < n; i++) {
            float *gi = tg + (size_t)i * ncol;
            float *ui = tu + (size_t)i * ncol;
            if (c->bias[0]) { /* this route's expert's rows of the gate and up biases */
                const size_t e = (size_t)c->experts[c->r0 + (uint32_t)g->rec_route[rec + i]];
                const float *bg = c->bias[0] + e * ff + (size_t)b * 32;
                const float *bu = c->bias[1] + e * ff + (size_t)b * 32;
                for (uint32_t col = 0; col < ncol; col++) {
                    gi[col] += bg[col];
                    ui[col] += bu[col];
                }
            }
            glu_apply(c, gi, ui, ncol);
            if (c->q8) { /* the item's blocks of this route's h are contiguous: one call */
                const size_t o = (size_t)(rec + i) * fb + b;
                isa->quantize_row_q8(gi, ncol, g->hq + o * 32, g->hd + o, g->hs + o);
                if (hz) htp_q8_q6k_seeds(g->hq + o * 32, ncol / 32, g->hz + o * 2);
                if (hsd) htp_q8_q45k_sada(g->hd + o, g->hs + o, ncol / 32, g->hsd + o);
            } else {
                memcpy(g->h + (size_t)(rec + i) * ff + (size_t)b * 32, gi, (size_t)ncol * 4);
            }
        }
    }
    htp_barrier(c->pool);

    /* (c) down + scatter-add: items (block of d_model tiles), each over every slot in order */
    const uint32_t dblk = HTP_MAX(2u, db / (4 * nth)); /* d_model tiles per item */
    const uint32_t n_dblk = (db + dblk - 1) / dblk;
    for (uint32_t item; (item = htp_next(&c->next_c)) < n_dblk;) {
        b = item * dblk, e = HTP_MIN(db, b + dblk);
        const uint32_t dcol = (e - b) * 32;
        for (uint32_t s = 0; s < c->nseg; s++) {
            const uint64_t slot = (uint64_t)g->seg_slot[s];
            const uint8_t *wd = c->planes[2] + slot * c->stride[2];
            for (uint32_t r0 = 0; r0 < (uint32_t)g->seg_len[s]; r0 += SUB) {
                const uint32_t rec = (uint32_t)g->seg_begin[s] + r0;
                const uint32_t n = HTP_MIN(SUB, (uint32_t)g->seg_len[s] - r0);
                if (c->q8) {
                    htp_act_q8 a = {g->hq + (size_t)rec * ff, g->hd + (size_t)rec * fb, g->hs + (size_t)rec * fb,
                                    hz ? g->hz + (size_t)rec * fb * 2 : NULL,
                                    hsd ? g->hsd + (size_t)rec * fb : NULL};
                    /* next: this slot's strip b again (its next piece), else the next slot's */
                    const size_t first = (size_t)b * fb * htp_tile_bytes(c->fmt[2]);
                    const uint8_t *after = r0 + SUB < (uint32_t)g->seg_len[s] ? wd + first
                                           : s + 1 < c->nseg
                                               ? c->planes[2] + (uint64_t)g->seg_slot[s + 1] * c->stride[2] + first
                                               : NULL;
                    htp_gemm_tiles(isa, wd, c->fmt[2], d, ff, b, e, &a, NULL, 0, n, tmp, dcol, NULL, after);
                } else {
                    htp_gemm_tiles(isa, wd, c->fmt[2], d, ff, b, e, NULL, g->h + (size_t)rec * ff, ff,
                                   n, tmp, dcol, panel, NULL);
                }
                for (uint32_t i = 0; i < n; i++) {
                    const uint32_t route = c->r0 + (uint32_t)g->rec_route[rec + i];
                    const float wgt = c->weights[route];
                    float *yr = c->y + (size_t)c->tokens[route] * d + (size_t)b * 32;
                    const float *src = tmp + (size_t)i * dcol;
                    if (c->bias[2]) { /* down's bias row of the route's expert, then weighted */
                        const float *bd = c->bias[2] + (size_t)c->experts[route] * d + b * 32;
                        for (uint32_t col = 0; col < dcol; col++)
                            yr[col] += wgt * (src[col] + bd[col]);
                    } else {
                        for (uint32_t col = 0; col < dcol; col++) yr[col] += wgt * src[col];
                    }
                }
            }
        }
    }
}

typedef struct quant_ctx {
    const htp_isa *isa;
    const float *x;
    const int32_t *list; /* the tokens to quantize (NULL: tokens 0 .. n-1) */
    uint32_t n, d;
    int8_t *q; /* rows indexed by token */
    float *qd;
    int32_t *qs;
} quant_ctx;

static void quant_task(void *arg, uint32_t ith, uint32_t nth) {
    const quant_ctx *c = (const quant_ctx *)arg;
    const uint32_t db = c->d / 32;
    uint32_t b, e;
    htp_split(c->n, ith, nth, &b, &e);
    for (uint32_t i = b; i < e; i++) {
        const size_t tok = c->list ? (size_t)c->list[i] : i;
        c->isa->quantize_row_q8(c->x + tok * c->d, c->d, c->q + tok * c->d, c->qd + tok * db, c->qs + tok * db);
    }
}

htp_act_q8 htp_q8_rows(const uint8_t *rows, uint32_t t, uint32_t d) {
    const size_t vals = (size_t)t * d, blocks = (size_t)t * (d / 32);
    htp_act_q8 a = {(const int8_t *)rows, (const float *)(rows + vals),
                    (const int32_t *)(rows + vals + blocks * 4)};
    return a;
}

/* Validated by the caller (htp_host_execute): d a multiple of 32, both buffers' sizes. */
void htp_exec_quantize(htp_exec *ex, const htp_quantize_params *p, const float *x, uint8_t *out) {
    const htp_act_q8 a = htp_q8_rows(out, p->t, p->d);
    quant_ctx qc = {ex->isa, x, NULL, p->t, p->d, (int8_t *)a.q, (float *)a.d, (int32_t *)a.s};
    htp_parallel(ex->pool, quant_task, &qc);
}

/* q8 mode: room for T tokens' quantized rows and the token list (grown, kept between calls). */
static htp_status ws_reserve_tokens(struct htp_expert_ws *g, size_t t, size_t d) {
    if (t <= g->tok_cap && d <= g->d) return HTP_OK;
    free(g->tq), free(g->td), free(g->ts), free(g->tseen), free(g->tlist);
    g->tq = malloc(t * d);
    g->td = malloc(t * d / 32 * 4);
    g->ts = malloc(t * d / 32 * 4);
    g->tseen = malloc(t);
    g->tlist = malloc(t * 4);
    if (!g->tq || !g->td || !g->ts || !g->tseen || !g->tlist) {
        free(g->tq), free(g->td), free(g->ts), free(g->tseen), free(g->tlist);
        g->tq = NULL, g->td = NULL, g->ts = NULL, g->tseen = NULL, g->tlist = NULL;
        g->tok_cap = 0;
        return HTP_E_NOMEM;
    }
    g->tok_cap = t;
    return HTP_OK;
}

htp_status htp_expert_formats(const htp_expert_params *p, uint32_t fmt[3]) {
    const uint32_t given[3] = {p->format, p->format_up ? p->format_up : p->format,
                               p->format_down ? p->format_down : p->format};
    for (int j = 0; j < 3; j++) {
        if (!htp_is_weight_format(given[j])) return HTP_E_UNSUPPORTED;
        fmt[j] = given[j];
    }
    return HTP_OK;
}

/* Validated by the caller (htp_host_execute): shapes, formats, every index, the slot range
 * against the planes' registered sizes, the activation's fields, the biases' bounds. */
htp_status htp_exec_expert(htp_exec *ex, const htp_expert_params *p, uint32_t act,
                           const float *x, const int32_t *tokens, const int32_t *experts,
                           const float *weights, const int32_t *slot_of_expert,
                           const uint8_t *const planes[3], float *y, const htp_act_q8 *xq,
                           const float *const bias[3]) {
    const uint32_t R = p->n_routes;
    if (R == 0) return HTP_OK;
    const uint32_t d = p->d_model, ff = p->d_ff, C = p->capacity;
    if (!ex->ws) {
        ex->ws = (struct htp_expert_ws *)calloc(1, sizeof(struct htp_expert_ws));
        if (!ex->ws) return HTP_E_NOMEM;
    }
    struct htp_expert_ws *g = ex->ws;
    int32_t max_slot = -1;
    for (uint32_t r = 0; r < R; r++) {
        const int32_t s = slot_of_expert[experts[r]];
        max_slot = s > max_slot ? s : max_slot;
    }
    if ((uint32_t)max_slot + 1 > g->counts_cap) {
        uint32_t *q = (uint32_t *)realloc(g->counts, ((size_t)max_slot + 1) * 8);
        if (!q) return HTP_E_NOMEM;
        g->counts = q;
        g->counts_cap = (uint32_t)max_slot + 1;
    }
    /* per-thread scratch: GEMM panel (f32 mode) and gate/up/down staging */
    const size_t kmax = HTP_MAX(d, ff);
    const size_t stage = (size_t)2 * SUB * HTP_MAX(d, 2 * ff) * 4 + 256;
    for (uint32_t i = 0; i < htp_pool_nth(ex->pool); i++)
        if (!htp_scratch(ex->pool, i, 0, kmax * 32 * 4) || !htp_scratch(ex->pool, i, 2, stage))
            return HTP_E_NOMEM;
    const int q8 = act == HTP_ACT_Q8;
    uint32_t fmt[3] = {0, 0, 0};
    htp_expert_formats(p, fmt);
    int q6k = 0, q45k = 0;
    for (int j = 0; j < 3; j++) {
        q6k |= fmt[j] == HTP_FMT_Q6_K_T32R4;
        q45k |= fmt[j] == HTP_FMT_Q4_K_T32R4 || fmt[j] == HTP_FMT_Q5_K_T32R4;
    }
    if (ws_reserve(g, C, d, ff, q8, q6k, q45k) != HTP_OK) return HTP_E_NOMEM;
    htp_act_q8 rows = {NULL, NULL, NULL}; /* q8 mode: every routed token's quantized row */
    if (q8 && xq) {
        rows = *xq; /* quantized by the caller, once for every op on this input */
    } else if (q8) { /* each token's row once, however many experts it is routed to */
        if (ws_reserve_tokens(g, p->n_tokens, g->d) != HTP_OK) return HTP_E_NOMEM;
        /* only the tokens routed in this call (a streamed group of one expert sees few) */
        memset(g->tseen, 0, p->n_tokens);
        uint32_t nt = 0;
        for (uint32_t r = 0; r < R; r++)
            if (!g->tseen[tokens[r]]) {
                g->tseen[tokens[r]] = 1;
                g->tlist[nt++] = tokens[r];
            }
        quant_ctx qc = {ex->isa, x, g->tlist, nt, d, g->tq, g->td, g->ts};
        htp_parallel(ex->pool, quant_task, &qc);
        rows.q = g->tq, rows.d = g->td, rows.s = g->ts;
    }
    const uint32_t P = (uint32_t)max_slot + 1;
    /* Passes are runs of consecutive slots holding at most `capacity` routes (a slot with more
     * routes is cut into capacity-sized pieces of its routes in route order), so each pass
     * meets every expert it touches once, with as many routes as possible. The order in which
     * contributions reach y (slot ascending, then route order) does not depend on capacity. */
    uint32_t *total = g->counts + P;
    memset(total, 0, (size_t)P * 4);
    for (uint32_t r = 0; r < R; r++) total[slot_of_expert[experts[r]]]++;
    uint32_t sa = 0;
    while (sa < P) {
        if (total[sa] == 0) {
            sa++;
            continue;
        }
        uint32_t sb = sa, sum = 0;
        while (sb < P && sum + total[sb] <= C) sum += total[sb++];
        const int big = sb == sa; /* slot sa alone exceeds capacity */
        const uint32_t pieces = big ? (total[sa] + C - 1) / C : 1;
        if (big) sb = sa + 1;
        for (uint32_t piece = 0; piece < pieces; piece++) {
            /* select the pass's routes */
            uint32_t nr = 0, ordinal = 0;
            for (uint32_t r = 0; r < R; r++) {
                const uint32_t sl = (uint32_t)slot_of_expert[experts[r]];
                if (sl < sa || sl >= sb) continue;
                if (big) {
                    const uint32_t o = ordinal++;
                    if (o < piece * C || o >= (piece + 1) * C) continue;
                }
                g->stage[nr] = (int32_t)r; /* staged, then sorted by slot below */
                g->route_slot[nr] = (int32_t)sl;
                nr++;
            }
            /* counting sort of the staged routes by slot (stable) */
            memset(g->counts + sa, 0, (size_t)(sb - sa) * 4);
            for (uint32_t i = 0; i < nr; i++) g->counts[g->route_slot[i]]++;
            uint32_t nseg = 0, off = 0;
            for (uint32_t sl = sa; sl < sb; sl++) {
                const uint32_t cnt = g->counts[sl];
                if (!cnt) continue;
                g->seg_slot[nseg] = (int32_t)sl;
                g->seg_begin[nseg] = (int32_t)off;
                g->seg_len[nseg] = (int32_t)cnt;
                g->counts[sl] = off;
                off += cnt;
                nseg++;
            }
            uint32_t nsub = 0; /* the pieces of at most SUB routes phase (b) hands out */
            for (uint32_t sg = 0; sg < nseg; sg++)
                for (uint32_t r0 = 0; r0 < (uint32_t)g->seg_len[sg]; r0 += SUB) {
                    g->sub_seg[nsub] = (int32_t)sg;
                    g->sub_r0[nsub] = (int32_t)r0;
                    nsub++;
                }
            for (uint32_t i = 0; i < nr; i++) g->rec_route[g->counts[g->route_slot[i]]++] = g->stage[i];
            run_ctx c = {g, ex->isa, ex->pool, d, ff, {0, 0, 0}, planes, p->slot_stride, x, &rows, tokens, weights,
                         y, 0, nr, nseg, nsub, q8, 0, 0, experts, bias, p->glu, p->glu_alpha,
                         p->glu_limit};
            htp_expert_formats(p, c.fmt);
            htp_parallel(ex->pool, run_task, &c);
        }
        sa = sb;
    }
    return HTP_OK;
}
