/* Library state, CPU dispatch, the GEMM driver and the small element-wise / row ops. */
#include "htp_gemm_body.h"

#include <pthread.h>

htp_kernels htp_k;
static uint32_t g_simd = HTP_SIMD_PORTABLE;
static uint32_t g_act = HTP_ACT_Q8;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* ---- portable kernel set ---- */
static void gemm_f32_portable(const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k, uint32_t tb,
                              uint32_t te, const htp_act_f32 *a, uint32_t t, float *out,
                              uint32_t ldo, float *panel) {
    htp_gemm_f32_body(w, fmt, n, k, tb, te, a, t, out, ldo, panel);
}
void htp_gemm_q8_portable(const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k, uint32_t tb,
                             uint32_t te, const htp_act_q8 *a, uint32_t t, float *out,
                             uint32_t ldo) {
    htp_gemm_q8_body(w, fmt, n, k, tb, te, a, t, out, ldo);
}
static void quantize_q8_portable(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s) {
    htp_quantize_row_q8_body(x, k, q, d, s);
}
void htp_kernels_portable(htp_kernels *k) {
    k->gemm_f32 = gemm_f32_portable;
    k->gemm_q8 = htp_gemm_q8_portable;
    k->quantize_row_q8 = quantize_q8_portable;
    k->attention_task = htp_attn_task_portable;
    k->swiglu = htp_swiglu_portable;
}

void htp_quantize_row_q8(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s) {
    htp_k.quantize_row_q8(x, k, q, d, s);
}

void htp_dequant_tile_t(const uint8_t *p, uint32_t fmt, float *panel) {
    htp_dequant_tile_body(p, fmt, panel);
}

/* ---- dispatch ---- */
static int cpu_supports(uint32_t level) {
    switch (level) {
    case HTP_SIMD_PORTABLE: return 1;
#ifdef HTP_X86
    case HTP_SIMD_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case HTP_SIMD_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               cpu_supports(HTP_SIMD_AVX2);
    case HTP_SIMD_AVX512VNNI:
        return __builtin_cpu_supports("avx512vnni") && cpu_supports(HTP_SIMD_AVX512);
#endif
#ifdef HTP_ARM64
    case HTP_SIMD_NEON: return htp_neon_dotprod_supported();
#endif
    default: return 0;
    }
}

static void fill_kernels(uint32_t level) {
    htp_kernels k;
    htp_kernels_portable(&k);
#ifdef HTP_X86
    if (level == HTP_SIMD_AVX2) htp_kernels_avx2(&k);
    if (level == HTP_SIMD_AVX512) htp_kernels_avx512(&k);
    if (level == HTP_SIMD_AVX512VNNI) htp_kernels_avx512vnni(&k);
#endif
#ifdef HTP_ARM64
    if (level == HTP_SIMD_NEON) htp_kernels_neon(&k);
#endif
    htp_k = k;
}

uint32_t htp_simd_best(void) {
    for (uint32_t l = HTP_SIMD_NEON + 1; l-- > 0;)
        if (cpu_supports(l)) return l;
    return HTP_SIMD_PORTABLE;
}

static void init_once(void) {
#ifdef HTP_X86
    __builtin_cpu_init();
#endif
    g_simd = htp_simd_best();
    fill_kernels(g_simd);
    htp_pool_register_atfork();
}

void htp_ensure_init(void) { pthread_once(&g_once, init_once); }

uint32_t htp_abi_version(void) { return HTP_ABI_VERSION; }
uint32_t htp_simd_get(void) {
    htp_ensure_init();
    return g_simd;
}
htp_status htp_simd_set(uint32_t level) {
    htp_ensure_init();
    if (level > HTP_SIMD_NEON || !cpu_supports(level)) return HTP_E_UNSUPPORTED;
    g_simd = level;
    fill_kernels(level);
    return HTP_OK;
}
htp_status htp_act_set(uint32_t act) {
    if (act > HTP_ACT_Q8) return HTP_E_INVALID;
    g_act = act;
    return HTP_OK;
}
uint32_t htp_act_get(void) { return g_act; }

size_t htp_tile_bytes(uint32_t fmt) {
    return fmt == HTP_FMT_Q4_0_T32R4 ? HTP_Q4_TILE_BYTES : fmt == HTP_FMT_Q8_0_T32R4 ? HTP_Q8_TILE_BYTES : 0;
}
uint64_t htp_matrix_bytes(uint32_t fmt, uint32_t n, uint32_t k) {
    return (uint64_t)((n + 31) / 32) * (k / 32) * htp_tile_bytes(fmt);
}

/* ---- GEMM driver ---- */
typedef struct gemm_ctx {
    const uint8_t *w;
    uint32_t fmt, n, k, t, ldx, ldy;
    const float *x;
    float *y;
    int8_t *q;
    float *qd;
    int32_t *qs;
    int use_q8;
} gemm_ctx;

static void gemm_task(void *arg, uint32_t ith, uint32_t nth) {
    gemm_ctx *c = (gemm_ctx *)arg;
    const uint32_t kb = c->k / 32;
    if (c->use_q8) {
        uint32_t b, e;
        htp_split(c->t, ith, nth, &b, &e);
        for (uint32_t i = b; i < e; i++)
            htp_k.quantize_row_q8(c->x + (size_t)i * c->ldx, c->k, c->q + (size_t)i * c->k,
                                  c->qd + (size_t)i * kb, c->qs + (size_t)i * kb);
        htp_barrier();
    }
    uint32_t tb, te;
    htp_split((c->n + 31) / 32, ith, nth, &tb, &te);
    if (tb == te) return;
    if (c->use_q8) {
        htp_act_q8 a = {c->q, c->qd, c->qs};
        htp_k.gemm_q8(c->w, c->fmt, c->n, c->k, tb, te, &a, c->t, c->y + (size_t)tb * 32, c->ldy);
    } else {
        htp_act_f32 a = {c->x, c->ldx};
        float *panel = (float *)htp_scratch(ith, 0, 0);
        htp_k.gemm_f32(c->w, c->fmt, c->n, c->k, tb, te, &a, c->t, c->y + (size_t)tb * 32, c->ldy, panel);
    }
}

static htp_status reserve_panels(uint32_t k) {
    for (uint32_t i = 0; i < htp_nth(); i++)
        if (!htp_scratch(i, 0, (size_t)k * 32 * sizeof(float))) return HTP_E_NOMEM;
    return HTP_OK;
}

htp_status htp_gemm(const htp_matrix_desc *wd, const void *w, const float *x, uint32_t t,
                    uint32_t ldx, float *y, uint32_t ldy) {
    htp_ensure_init();
    if (!wd || !w || !x || !y) return HTP_E_INVALID;
    if (wd->format != HTP_FMT_Q4_0_T32R4 && wd->format != HTP_FMT_Q8_0_T32R4) return HTP_E_INVALID;
    if (wd->k == 0 || wd->k % 32 || wd->n == 0 || ldx < wd->k || ldy < wd->n) return HTP_E_INVALID;
    if (wd->nbytes < htp_matrix_bytes(wd->format, wd->n, wd->k)) return HTP_E_INVALID;
    if (t == 0) return HTP_OK;
    gemm_ctx c = {(const uint8_t *)w, wd->format, wd->n, wd->k, t, ldx, ldy, x, y, NULL, NULL, NULL, 0};
    c.use_q8 = g_act == HTP_ACT_Q8;
    void *buf = NULL;
    htp_api_lock();
    if (c.use_q8) {
        const size_t kb = wd->k / 32;
        buf = malloc((size_t)t * wd->k + (size_t)t * kb * 8 + 64);
        if (!buf) {
            htp_api_unlock();
            return HTP_E_NOMEM;
        }
        c.qd = (float *)buf;
        c.qs = (int32_t *)(c.qd + (size_t)t * kb);
        c.q = (int8_t *)(c.qs + (size_t)t * kb);
    } else if (reserve_panels(wd->k) != HTP_OK) {
        htp_api_unlock();
        return HTP_E_NOMEM;
    }
    htp_parallel(gemm_task, &c);
    htp_api_unlock();
    free(buf);
    return HTP_OK;
}

/* ---- embedding rows ---- */
htp_status htp_get_rows(const void *table, uint32_t format, uint64_t nbytes, uint32_t n_rows,
                        uint32_t n_cols, const int32_t *ids, uint32_t t, float *out) {
    htp_ensure_init();
    if (!table || !ids || !out || n_rows == 0 || n_cols == 0) return HTP_E_INVALID;
    const uint8_t *p = (const uint8_t *)table;
    uint64_t need;
    switch (format) {
    case HTP_FMT_F32: need = (uint64_t)n_rows * n_cols * 4; break;
    case HTP_FMT_F16: need = (uint64_t)n_rows * n_cols * 2; break;
    case HTP_FMT_Q4_0_T32R4:
    case HTP_FMT_Q8_0_T32R4:
        if (n_cols % 32) return HTP_E_INVALID;
        need = htp_matrix_bytes(format, n_rows, n_cols);
        break;
    default: return HTP_E_INVALID;
    }
    if (nbytes < need) return HTP_E_INVALID;
    for (uint32_t i = 0; i < t; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= n_rows) return HTP_E_INVALID;
    const size_t tb = htp_tile_bytes(format);
    const uint32_t kb = n_cols / 32;
    for (uint32_t i = 0; i < t; i++) {
        const uint32_t row = (uint32_t)ids[i];
        float *o = out + (size_t)i * n_cols;
        if (format == HTP_FMT_F32) {
            memcpy(o, p + (size_t)row * n_cols * 4, (size_t)n_cols * 4);
        } else if (format == HTP_FMT_F16) {
            const uint8_t *src = p + (size_t)row * n_cols * 2;
            for (uint32_t c = 0; c < n_cols; c++) {
                uint16_t h;
                memcpy(&h, src + 2 * c, 2);
                o[c] = htp_f16_to_f32(h);
            }
        } else {
            const uint32_t it = row / 32, r = row % 32;
            for (uint32_t j = 0; j < kb; j++) {
                const uint8_t *tile = p + ((size_t)it * kb + j) * tb;
                uint16_t h;
                memcpy(&h, tile + 2 * r, 2);
                const float d = htp_f16_to_f32(h);
                float *ob = o + 32 * j;
                if (format == HTP_FMT_Q4_0_T32R4) {
                    for (int g = 0; g < 4; g++)
                        for (int b = 0; b < 4; b++) {
                            const uint8_t v = tile[64 + g * 128 + r * 4 + b];
                            ob[4 * g + b] = d * (float)((int)(v & 15) - 8);
                            ob[16 + 4 * g + b] = d * (float)((int)(v >> 4) - 8);
                        }
                } else {
                    for (int g = 0; g < 8; g++)
                        for (int b = 0; b < 4; b++)
                            ob[4 * g + b] = d * (float)(int8_t)tile[64 + g * 128 + r * 4 + b];
                }
            }
        }
    }
    return HTP_OK;
}

/* ---- RMSNorm ---- */
htp_status htp_rms_norm(const float *x, const float *w, uint32_t t, uint32_t n_groups, uint32_t d,
                        float eps, float *out) {
    if (!x || !out || d == 0 || n_groups == 0 || !(eps >= 0.0f)) return HTP_E_INVALID;
    const size_t rows = (size_t)t * n_groups;
    for (size_t i = 0; i < rows; i++) {
        const float *xr = x + i * d;
        float *o = out + i * d;
        double ss = 0.0;
        for (uint32_t c = 0; c < d; c++) ss += (double)xr[c] * xr[c];
        const float inv = (float)(1.0 / sqrt(ss / d + (double)eps));
        if (w)
            for (uint32_t c = 0; c < d; c++) o[c] = xr[c] * inv * w[c];
        else
            for (uint32_t c = 0; c < d; c++) o[c] = xr[c] * inv;
    }
    return HTP_OK;
}

/* ---- RoPE ---- */
htp_status htp_rope(float *x, const int32_t *pos, uint32_t t, uint32_t n_heads, uint32_t head_dim,
                    uint32_t n_rot, float freq_base, float freq_scale, uint32_t mode) {
    if (!x || !pos || n_rot > head_dim || n_rot % 2 || mode > HTP_ROPE_NEOX || !(freq_base > 0.0f))
        return HTP_E_INVALID;
    const uint32_t half = n_rot / 2;
    double *cs = (double *)malloc(sizeof(double) * 2 * (half ? half : 1));
    if (!cs) return HTP_E_NOMEM;
    for (uint32_t i = 0; i < t; i++) {
        for (uint32_t j = 0; j < half; j++) {
            const double theta = (double)pos[i] * (double)freq_scale *
                                 pow((double)freq_base, -2.0 * (double)j / (double)n_rot);
            cs[2 * j] = cos(theta);
            cs[2 * j + 1] = sin(theta);
        }
        for (uint32_t h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            for (uint32_t j = 0; j < half; j++) {
                const uint32_t a = mode == HTP_ROPE_NORMAL ? 2 * j : j;
                const uint32_t b = mode == HTP_ROPE_NORMAL ? 2 * j + 1 : j + half;
                const double x0 = v[a], x1 = v[b];
                v[a] = (float)(x0 * cs[2 * j] - x1 * cs[2 * j + 1]);
                v[b] = (float)(x0 * cs[2 * j + 1] + x1 * cs[2 * j]);
            }
        }
    }
    free(cs);
    return HTP_OK;
}

/* ---- SiLU / SwiGLU ---- */
htp_status htp_silu(const float *x, uint64_t n, float *out) {
    htp_ensure_init();
    if ((!x || !out) && n) return HTP_E_INVALID;
    htp_k.swiglu(x, NULL, n, out);
    return HTP_OK;
}
htp_status htp_swiglu(const float *g, const float *u, uint64_t n, float *out) {
    htp_ensure_init();
    if ((!g || !u || !out) && n) return HTP_E_INVALID;
    htp_k.swiglu(g, u, n, out);
    return HTP_OK;
}

/* ---- router ---- */
htp_status htp_router_topk(const float *logits, uint32_t t, uint32_t n_experts, uint32_t k,
                           uint32_t gating, uint32_t norm, float scale, const float *bias,
                           int32_t *ids, float *weights) {
    if (!logits || !ids || !weights || k == 0 || k > n_experts || gating > HTP_GATING_SIGMOID)
        return HTP_E_INVALID;
    double *p = (double *)malloc(sizeof(double) * n_experts * 2);
    if (!p) return HTP_E_NOMEM;
    double *key = p + n_experts;
    for (uint32_t i = 0; i < t; i++) {
        const float *l = logits + (size_t)i * n_experts;
        if (gating == HTP_GATING_SOFTMAX) {
            double mx = -INFINITY, sum = 0.0;
            for (uint32_t e = 0; e < n_experts; e++) mx = l[e] > mx ? l[e] : mx;
            for (uint32_t e = 0; e < n_experts; e++) sum += (p[e] = exp((double)l[e] - mx));
            for (uint32_t e = 0; e < n_experts; e++) key[e] = (p[e] /= sum);
        } else {
            for (uint32_t e = 0; e < n_experts; e++) {
                p[e] = 1.0 / (1.0 + exp(-(double)l[e]));
                key[e] = p[e] + (bias ? (double)bias[e] : 0.0);
            }
        }
        int32_t *id = ids + (size_t)i * k;
        float *wt = weights + (size_t)i * k;
        /* selection: k passes, each picks the largest remaining key (ties -> lower id) */
        double wsum = 0.0;
        for (uint32_t j = 0; j < k; j++) {
            int32_t best = -1;
            for (uint32_t e = 0; e < n_experts; e++) {
                int taken = 0;
                for (uint32_t q = 0; q < j; q++) taken |= id[q] == (int32_t)e;
                if (taken) continue;
                if (best < 0 || key[e] > key[best]) best = (int32_t)e;
            }
            id[j] = best;
            wsum += p[best];
        }
        for (uint32_t j = 0; j < k; j++) {
            double v = p[id[j]];
            if (norm) v /= wsum;
            wt[j] = (float)(v * scale);
        }
    }
    free(p);
    return HTP_OK;
}
