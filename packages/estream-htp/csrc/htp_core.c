/* CPU dispatch, the portable inner-loop table, the generic GEMM driver and the small
 * element-wise / row ops. Nothing here is mutable global state: the tables are const, and all
 * per-run state lives in the backend (htp_backend.c). */
#include "htp_gemm_body.h"
#include "htp_matmul_body.h"
#include "htp_norm_body.h"

/* ---- portable table ---- */
static void q4q8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                                float *out, uint32_t ldo, uint32_t rows) {
    htp_q8_strip_body(strip, HTP_FMT_Q4_0_T32R4, kb, a, nt, out, ldo, rows);
}
void htp_q8q8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows) {
    htp_q8_strip_body(strip, HTP_FMT_Q8_0_T32R4, kb, a, nt, out, ldo, rows);
}
void htp_dequant_portable(const uint8_t *p, uint32_t fmt, float *panel) {
    htp_dequant_tile_body(p, fmt, panel);
}
void htp_q4kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows) {
    htp_q4k_strip_body(strip, kb, a, nt, out, ldo, rows);
}
void htp_q6kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows) {
    htp_q6k_strip_body(strip, kb, a, nt, out, ldo, rows);
}
void htp_q5kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows) {
    htp_q5k_strip_body(strip, kb, a, nt, out, ldo, rows);
}
/* The epilogues of these four are products, then sums (no fused multiply-add): without
 * HTP_NO_CONTRACT GCC fuses them where FMA is baseline (arm64), and the portable table would give
 * other bits there than on x86-64, in the hexagon executor and in the SIMD tables. */
HTP_NO_CONTRACT void htp_affq8_strip_portable(const uint8_t *strip, uint32_t fmt, uint32_t kb, const htp_act_q8 *a,
                              uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    htp_aff_strip_body(strip, fmt, kb, a, nt, out, ldo, rows);
}
HTP_NO_CONTRACT void htp_nlq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows) {
    htp_iq4nl_strip_body(strip, kb, a, nt, out, ldo, rows);
}
HTP_NO_CONTRACT void htp_xsq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows) {
    htp_iq4xs_strip_body(strip, kb, a, nt, out, ldo, rows);
}
HTP_NO_CONTRACT void htp_mxq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows) {
    htp_mxfp4_strip_body(strip, kb, a, nt, out, ldo, rows);
}
void htp_f32_strip_portable(const float *panel, uint32_t k, const float *x, uint32_t ldx,
                               uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {
    htp_f32_strip_body(panel, k, x, ldx, nt, out, ldo, rows);
}
void htp_quantize_q8_portable(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s) {
    htp_quantize_row_q8_body(x, k, q, d, s);
}
void htp_q8_q6k_seeds(const int8_t *q, uint32_t kb, int32_t *z) {
    for (uint32_t j = 0; j < kb; j++) {
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; i++) lo += q[32 * j + i], hi += q[32 * j + 16 + i];
        z[2 * j] = -32 * lo, z[2 * j + 1] = -32 * hi;
    }
}
void htp_q8_q45k_sada(const float *d, const int32_t *s, uint32_t kb, float *sd) {
    for (uint32_t j = 0; j < kb; j++) sd[j] = (float)s[j] * d[j];
}

const htp_isa htp_isa_portable = {
    .level = HTP_SIMD_PORTABLE,
    .q4q8_strip = q4q8_strip_portable,
    .q4q8_nt = 64,
    .q8q8_strip = htp_q8q8_strip_portable,
    .q8q8_nt = 64,
    .q4kq8_strip = htp_q4kq8_strip_portable,
    .q6kq8_strip = htp_q6kq8_strip_portable,
    .kq8_nt = 64,
    .q5kq8_strip = htp_q5kq8_strip_portable,
    .nlq8_strip = htp_nlq8_strip_portable,
    .xsq8_strip = htp_xsq8_strip_portable,
    .affq8_strip = htp_affq8_strip_portable,
    .mxq8_strip = htp_mxq8_strip_portable,
    .mxq8_nt = 64,
    .dequant_tile = htp_dequant_portable,
    .dequant_kq_tile = htp_dequant_portable,
    .f32_strip = htp_f32_strip_portable,
    .f32_nt = 4,
    .quantize_row_q8 = htp_quantize_q8_portable,
    .attention_task = htp_attn_task_portable,
    .attention_kt_cols = 0,
    .attention_bf16_pack = NULL,
    .attention_bf16_task = NULL,
    .swiglu = htp_swiglu_portable,
    .swiglu_oai = htp_swiglu_oai_portable,
    .rms_rows = htp_rms_rows_portable,
    .matmul_f32 = htp_matmul_f32_portable,
    .dot_peak = NULL,
    .dot_macs_per_iter = 0,
};

/* ---- dispatch ---- */
static int cpu_supports(uint32_t level) {
#ifdef HTP_X86
    __builtin_cpu_init();
#endif
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
    case HTP_SIMD_AMX:
        return cpu_supports(HTP_SIMD_AVX512VNNI) && htp_amx_usable();
#endif
#ifdef HTP_ARM64
    case HTP_SIMD_NEON: return htp_neon_dotprod_supported();
#endif
#ifdef HTP_HVX
    case HTP_SIMD_HVX: return 1; /* the build targets HVX: every core it runs on has it */
#endif
    default: return 0;
    }
}

const htp_isa *htp_isa_for(uint32_t level) {
    if (!cpu_supports(level)) return NULL;
    switch (level) {
    case HTP_SIMD_PORTABLE: return &htp_isa_portable;
#ifdef HTP_X86
    case HTP_SIMD_AVX2: return &htp_isa_avx2;
    case HTP_SIMD_AVX512: return &htp_isa_avx512;
    case HTP_SIMD_AVX512VNNI: return &htp_isa_avx512vnni;
    case HTP_SIMD_AMX: return &htp_isa_amx;
#endif
#ifdef HTP_ARM64
    case HTP_SIMD_NEON: return htp_neon_i8mm_supported() ? &htp_isa_neon_i8mm : &htp_isa_neon;
#endif
#ifdef HTP_HVX
    case HTP_SIMD_HVX: return &htp_isa_hvx;
#endif
    default: return NULL;
    }
}

int htp_cpu_bf16(void) {
#ifdef HTP_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && cpu_supports(HTP_SIMD_AVX512);
#elif defined(HTP_ARM64)
    return htp_neon_bf16_supported();
#else
    return 0;
#endif
}

int htp_simd_native_bf16_attention(uint32_t level) {
#ifdef HTP_X86
    const htp_isa *isa = htp_isa_for(level);
    return isa && isa->attention_bf16_task && htp_cpu_bf16();
#else
    /* NEON's bf16 task (BFMLALT / BFMLALB, one product per lane and an explicit flush) gives
     * the bits natively but issues ~2.9x the fp32 task's instructions: not the faster choice */
    (void)level;
    return 0;
#endif
}

uint32_t htp_simd_best(void) {
    for (uint32_t l = HTP_SIMD_AMX + 1; l-- > 0;)
        if (cpu_supports(l)) return l;
    return HTP_SIMD_PORTABLE;
}

uint32_t htp_abi_version(void) { return HTP_ABI_VERSION; }

size_t htp_tile_bytes(uint32_t fmt) {
    switch (fmt) {
    case HTP_FMT_Q4_0_T32R4: return HTP_Q4_TILE_BYTES;
    case HTP_FMT_Q8_0_T32R4: return HTP_Q8_TILE_BYTES;
    case HTP_FMT_Q4_K_T32R4: return HTP_Q4K_TILE_BYTES;
    case HTP_FMT_Q6_K_T32R4: return HTP_Q6K_TILE_BYTES;
    case HTP_FMT_MXFP4_T32R4: return HTP_MXFP4_TILE_BYTES;
    case HTP_FMT_Q5_K_T32R4: return HTP_Q5K_TILE_BYTES;
    case HTP_FMT_IQ4_NL_T32R4: return HTP_Q4_TILE_BYTES;
    case HTP_FMT_Q4_1_T32R4: return HTP_Q41_TILE_BYTES;
    case HTP_FMT_Q5_0_T32R4: return HTP_Q50_TILE_BYTES;
    case HTP_FMT_Q5_1_T32R4: return HTP_Q51_TILE_BYTES;
    case HTP_FMT_IQ4_XS_T32R4: return HTP_IQ4XS_TILE_BYTES;
    case HTP_FMT_F16_T32R4:
    case HTP_FMT_BF16_T32R4: return HTP_F16T_TILE_BYTES;
    default: return 0;
    }
}
int htp_is_weight_format(uint32_t fmt) {
    return fmt == HTP_FMT_Q4_0_T32R4 || fmt == HTP_FMT_Q8_0_T32R4 || fmt == HTP_FMT_Q4_K_T32R4 ||
           fmt == HTP_FMT_Q6_K_T32R4 || fmt == HTP_FMT_MXFP4_T32R4 || fmt == HTP_FMT_Q5_K_T32R4 ||
           fmt == HTP_FMT_IQ4_NL_T32R4 || fmt == HTP_FMT_Q4_1_T32R4 || fmt == HTP_FMT_Q5_0_T32R4 ||
           fmt == HTP_FMT_Q5_1_T32R4 || fmt == HTP_FMT_IQ4_XS_T32R4;
}
int htp_is_dense_format(uint32_t fmt) { return htp_is_weight_format(fmt) || HTP_IS_FLOAT_TILE(fmt); }
uint64_t htp_matrix_bytes(uint32_t fmt, uint32_t n, uint32_t k) {
    return (uint64_t)((n + 31) / 32) * (k / 32) * htp_tile_bytes(fmt);
}

/* ---- the generic GEMM driver: row-tile strips x token blocks, inner loops from the table ---- */
void htp_gemm_tiles(const htp_isa *isa, const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k,
                    uint32_t tile_b, uint32_t tile_e, const htp_act_q8 *q8, const float *x,
                    uint32_t ldx, uint32_t t, float *out, uint32_t ldo, float *panel,
                    const uint8_t *after) {
    const uint32_t kb = k / 32;
    const size_t tbytes = htp_tile_bytes(fmt);
    /* the strip kernel and its tokens per call for this format (K-quant and MXFP4 kernels a
     * table does not have: the portable ones) */
    const int kq = fmt == HTP_FMT_Q4_K_T32R4 || fmt == HTP_FMT_Q5_K_T32R4 ||
                   fmt == HTP_FMT_Q6_K_T32R4 || fmt == HTP_FMT_MXFP4_T32R4 ||
                   fmt == HTP_FMT_IQ4_XS_T32R4;
    void (*strip_fn)(const uint8_t *, uint32_t, const htp_act_q8 *, uint32_t, float *, uint32_t, uint32_t);
    uint32_t ntmax;
    if (fmt == HTP_FMT_Q4_0_T32R4) {
        strip_fn = isa->q4q8_strip, ntmax = isa->q4q8_nt;
    } else if (fmt == HTP_FMT_Q8_0_T32R4) {
        strip_fn = isa->q8q8_strip, ntmax = isa->q8q8_nt;
    } else if (fmt == HTP_FMT_MXFP4_T32R4) {
        const htp_isa *mi = isa->mxq8_strip ? isa : &htp_isa_portable;
        strip_fn = mi->mxq8_strip, ntmax = mi->mxq8_nt;
    } else if (fmt == HTP_FMT_Q4_1_T32R4 || fmt == HTP_FMT_Q5_0_T32R4 || fmt == HTP_FMT_Q5_1_T32R4) {
        strip_fn = NULL, ntmax = isa->mxq8_nt ? isa->mxq8_nt : 64;
    } else if (fmt == HTP_FMT_IQ4_NL_T32R4) {
        const htp_isa *ni = isa->nlq8_strip ? isa : &htp_isa_portable;
        strip_fn = ni->nlq8_strip, ntmax = ni->mxq8_nt;
    } else if (fmt == HTP_FMT_IQ4_XS_T32R4) {
        const htp_isa *xi = isa->xsq8_strip ? isa : &htp_isa_portable;
        strip_fn = xi->xsq8_strip, ntmax = xi->kq8_nt;
    } else if (fmt == HTP_FMT_Q5_K_T32R4) {
        const htp_isa *ki = isa->q5kq8_strip ? isa : &htp_isa_portable;
        strip_fn = ki->q5kq8_strip, ntmax = ki->kq8_nt;
    } else {
        const int own = isa->q4kq8_strip && isa->q6kq8_strip;
        const htp_isa *ki = own ? isa : &htp_isa_portable;
        strip_fn = fmt == HTP_FMT_Q4_K_T32R4 ? ki->q4kq8_strip : ki->q6kq8_strip;
        ntmax = ki->kq8_nt;
    }
    void (*dequant)(const uint8_t *, uint32_t, float *) =
        !kq ? isa->dequant_tile : isa->dequant_kq_tile ? isa->dequant_kq_tile : htp_dequant_portable;
    for (uint32_t it = tile_b; it < tile_e; it++) {
        const uint8_t *strip = w + (size_t)it * kb * tbytes;
        const uint32_t rows = HTP_MIN(32u, n - it * 32);
        float *o = out + (size_t)(it - tile_b) * 32;
        if (q8) {
            /* The strip multiplied next (`after` past the range) is fetched into the cache a
             * slice after each token block, so that its first token block does not wait on
             * memory: that block reads it from DRAM (expert weights serve few tokens), and the
             * hardware prefetcher starts too late for it. */
            const uint8_t *next = it + 1 < tile_e ? strip + (size_t)kb * tbytes
                                  : after                ? after
                                  : it + 1 < (n + 31) / 32 ? strip + (size_t)kb * tbytes
                                                           : NULL;
            const size_t lines = (size_t)kb * tbytes / 64, blocks = (t + ntmax - 1) / ntmax;
            const size_t per = (lines + blocks - 1) / blocks;
            size_t line = 0;
            for (uint32_t t0 = 0; t0 < t; t0 += ntmax) {
                if (next)
                    for (const size_t end = HTP_MIN(lines, line + per); line < end; line++)
                        __builtin_prefetch(next + line * 64, 0, 3);
                const uint32_t nt = HTP_MIN(ntmax, t - t0);
                const htp_act_q8 a = {q8->q + (size_t)t0 * k, q8->d + (size_t)t0 * kb, q8->s + (size_t)t0 * kb,
                                      q8->z ? q8->z + (size_t)t0 * kb * 2 : NULL,
                                      q8->sd ? q8->sd + (size_t)t0 * kb : NULL};
                if (strip_fn)
                    strip_fn(strip, kb, &a, nt, o + (size_t)t0 * ldo, ldo, rows);
                else /* Q4_1 / Q5_0 / Q5_1: one kernel for the three, told the format */
                    (isa->affq8_strip ? isa->affq8_strip : htp_affq8_strip_portable)(
                        strip, fmt, kb, &a, nt, o + (size_t)t0 * ldo, ldo, rows);
            }
        } else {
            for (uint32_t j = 0; j < kb; j++) dequant(strip + j * tbytes, fmt, panel + (size_t)j * 1024);
            const uint32_t ntmax = isa->f32_nt;
            for (uint32_t t0 = 0; t0 < t; t0 += ntmax) {
                const uint32_t nt = HTP_MIN(ntmax, t - t0);
                isa->f32_strip(panel, k, x + (size_t)t0 * ldx, ldx, nt, o + (size_t)t0 * ldo, ldo, rows);
            }
        }
    }
}

/* ---- dense GEMM op: quantize rows (q8) once, then the row tiles of every matrix, as one
 * range, split across threads ---- */
typedef struct gemm_ctx {
    const htp_isa *isa;
    htp_pool *pool;
    const htp_gemm_mat *m;
    uint32_t n_mats, fmt, k, t, ldx, tiles;
    const float *x;
    int8_t *q;
    float *qd;
    int32_t *qs;
    int32_t *qz; /* the Q6_K start values of the rows quantized here (NULL: none) */
    float *qsd;  /* the Q4_K / Q5_K sa·da of the rows quantized here (NULL: none) */
    int use_q8;
    int quantize; /* q8: quantize x first (0: the caller's Q8 rows) */
    uint32_t next; /* the next (token chunk, tile block) item (htp_next) */
} gemm_ctx;

#define HTP_GEMM_BLOCK_TILES 4 /* row tiles per work item */

/* Tokens per chunk of the q8 GEMM: about 384 KiB of quantized rows (k bytes each, plus
 * scales), a multiple of 8 tokens, at least 8. */
static uint32_t htp_gemm_token_chunk(uint32_t k) {
    const uint32_t per_row = k + k / 32 * 8;
    const uint32_t n = (384u << 10) / (per_row ? per_row : 1);
    return HTP_MAX(8u, n / 8 * 8);
}

static void gemm_task(void *arg, uint32_t ith, uint32_t nth) {
    gemm_ctx *c = (gemm_ctx *)arg;
    const uint32_t kb = c->k / 32;
    if (c->quantize) {
        uint32_t b, e;
        htp_split(c->t, ith, nth, &b, &e);
        for (uint32_t i = b; i < e; i++) {
            c->isa->quantize_row_q8(c->x + (size_t)i * c->ldx, c->k, c->q + (size_t)i * c->k,
                                    c->qd + (size_t)i * kb, c->qs + (size_t)i * kb);
            if (c->qz) htp_q8_q6k_seeds(c->q + (size_t)i * c->k, kb, c->qz + (size_t)i * kb * 2);
            if (c->qsd)
                htp_q8_q45k_sada(c->qd + (size_t)i * kb, c->qs + (size_t)i * kb, kb,
                                 c->qsd + (size_t)i * kb);
        }
        htp_barrier(c->pool);
    }
    float *panel = c->use_q8 ? NULL : (float *)htp_scratch(c->pool, ith, 0, 0);
    /* q8: tokens in chunks whose quantized rows stay in L2 while row tiles pass over them (a
     * whole prompt's rows would stream from L3 once per tile, which two cores cannot sustain).
     * f32 keeps one chunk: its strips are dequantized once per chunk. Work items are (chunk,
     * block of row tiles of the joint range of every matrix), chunk-major, handed out as
     * threads come free. Every output is computed the same way in any chunking. */
    const uint32_t chunk = c->use_q8 ? htp_gemm_token_chunk(c->k) : c->t;
    const uint32_t n_chunks = (c->t + chunk - 1) / chunk;
    const uint32_t n_blk = (c->tiles + HTP_GEMM_BLOCK_TILES - 1) / HTP_GEMM_BLOCK_TILES;
    for (uint32_t item; (item = htp_next(&c->next)) < n_chunks * n_blk;) {
        const uint32_t t0 = item / n_blk * chunk, n_tok = HTP_MIN(chunk, c->t - t0);
        const uint32_t tb = item % n_blk * HTP_GEMM_BLOCK_TILES;
        const uint32_t te = HTP_MIN(c->tiles, tb + HTP_GEMM_BLOCK_TILES);
        htp_act_q8 a = {NULL, NULL, NULL};
        if (c->use_q8)
            a = (htp_act_q8){c->q + (size_t)t0 * c->k, c->qd + (size_t)t0 * kb, c->qs + (size_t)t0 * kb,
                             c->qz ? c->qz + (size_t)t0 * kb * 2 : NULL,
                             c->qsd ? c->qsd + (size_t)t0 * kb : NULL};
        uint32_t base = 0; /* first tile of matrix i in the joint range */
        for (uint32_t i = 0; i < c->n_mats && base < te; i++) {
            const htp_gemm_mat *m = &c->m[i];
            const uint32_t nt = (m->n + 31) / 32;
            const uint32_t b = HTP_MAX(tb, base), e = HTP_MIN(te, base + nt);
            if (b < e)
                htp_gemm_tiles(c->isa, m->w, c->fmt, m->n, c->k, b - base, e - base, c->use_q8 ? &a : NULL,
                               c->use_q8 ? NULL : c->x + (size_t)t0 * c->ldx, c->ldx, n_tok,
                               m->y + (size_t)t0 * m->ldy + (size_t)(b - base) * 32, m->ldy, panel,
                               NULL);
            base += nt;
        }
    }
}

htp_status htp_exec_gemm(htp_exec *e, const htp_gemm_mat *mats, uint32_t n_mats, uint32_t fmt,
                         uint32_t k, const float *x, uint32_t t, uint32_t ldx, uint32_t act,
                         const htp_act_q8 *xq) {
    if (t == 0) return HTP_OK;
    /* F16 / BF16 tiles are multiplied in fp32 under either activation format (the caller
     * refuses int8 rows given for them) */
    const int use_q8 = act == HTP_ACT_Q8 && !HTP_IS_FLOAT_TILE(fmt);
    if (xq && !use_q8) return HTP_E_INVALID;
    gemm_ctx c = {e->isa, e->pool, mats, n_mats, fmt, k, t, ldx, 0, x, NULL, NULL, NULL, NULL, NULL, use_q8, 0, 0};
    for (uint32_t i = 0; i < n_mats; i++) c.tiles += (mats[i].n + 31) / 32;
    void *buf = NULL;
    if (c.use_q8 && xq) { /* quantized by the caller, once for every op on this input */
        c.q = (int8_t *)xq->q, c.qd = (float *)xq->d, c.qs = (int32_t *)xq->s;
    } else if (c.use_q8) {
        c.quantize = 1;
        /* the backend's shared per-op buffer (kept between calls: no page faults per GEMM) */
        const size_t kb = k / 32;
        /* and the K-quant kernels' values made with the rows: Q6_K start values, Q4_K sa·da */
        const int q6k = fmt == HTP_FMT_Q6_K_T32R4;
        const int q45k = fmt == HTP_FMT_Q4_K_T32R4 || fmt == HTP_FMT_Q5_K_T32R4;
        const size_t extra = (size_t)t * kb * (q6k ? 8 : q45k ? 4 : 0);
        buf = htp_scratch(e->pool, 0, 3, (size_t)t * k + (size_t)t * kb * 8 + extra + 64);
        if (!buf) return HTP_E_NOMEM;
        c.qd = (float *)buf;
        c.qs = (int32_t *)(c.qd + (size_t)t * kb);
        c.q = (int8_t *)(c.qs + (size_t)t * kb);
        if (q6k) c.qz = (int32_t *)(c.q + (size_t)t * k);
        if (q45k) c.qsd = (float *)(c.q + (size_t)t * k);
    } else {
        for (uint32_t i = 0; i < htp_pool_nth(e->pool); i++)
            if (!htp_scratch(e->pool, i, 0, (size_t)k * 32 * sizeof(float))) return HTP_E_NOMEM;
    }
    htp_parallel(e->pool, gemm_task, &c);
    return HTP_OK;
}

/* ---- embedding rows (validated by the caller) ---- */
void htp_exec_get_rows(const htp_get_rows_params *pr, const uint8_t *p, const int32_t *ids,
                       float *out) {
    const uint32_t format = pr->format, n_cols = pr->n_cols, t = pr->t;
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
                if (HTP_IS_FLOAT_TILE(format)) {
                    for (int c = 0; c < 32; c++) ob[c] = htp_f16t_value(tile, format, r, c);
                } else if (format == HTP_FMT_Q4_K_T32R4 || format == HTP_FMT_Q5_K_T32R4 ||
                    format == HTP_FMT_Q6_K_T32R4 || format == HTP_FMT_MXFP4_T32R4 ||
                    format == HTP_FMT_IQ4_XS_T32R4) {
                    float panel[1024]; /* the tile's values, then row r of them */
                    htp_dequant_kq_tile_body(tile, format, panel);
                    for (int c = 0; c < 32; c++) ob[c] = panel[c * 32 + r];
                } else if (format == HTP_FMT_Q4_1_T32R4 || format == HTP_FMT_Q5_0_T32R4 ||
                           format == HTP_FMT_Q5_1_T32R4) {
                    float panel[1024];
                    htp_dequant_aff_tile(tile, format, panel);
                    for (int c = 0; c < 32; c++) ob[c] = panel[c * 32 + r];
                } else if (format == HTP_FMT_IQ4_NL_T32R4) {
                    for (int g = 0; g < 4; g++)
                        for (int b = 0; b < 4; b++) {
                            const uint8_t v = tile[64 + g * 128 + r * 4 + b];
                            ob[4 * g + b] = d * (float)htp_iq4nl_kvalues[v & 15];
                            ob[16 + 4 * g + b] = d * (float)htp_iq4nl_kvalues[v >> 4];
                        }
                } else if (format == HTP_FMT_Q4_0_T32R4) {
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
}


/* ---- RMSNorm (validated by the caller): rows split across the pool's threads, each row
 * computed the same way whatever the split (results do not depend on the thread count) ---- */
typedef struct rms_ctx {
    const htp_isa *isa;
    const htp_rms_norm_params *p;
    const float *x, *w;
    float *out;
} rms_ctx;

void htp_rms_rows_portable(const float *x, const float *w, uint32_t d, float eps, size_t rows,
                           float *out) {
    htp_rms_rows_body(x, w, d, eps, rows, out);
}

static void rms_task(void *arg, uint32_t ith, uint32_t nth) {
    const rms_ctx *c = (const rms_ctx *)arg;
    const uint32_t d = c->p->d;
    uint32_t b, e;
    htp_split(c->p->t * c->p->n_groups, ith, nth, &b, &e);
    if (b < e) c->isa->rms_rows(c->x + (size_t)b * d, c->w, d, c->p->eps, e - b, c->out + (size_t)b * d);
}

void htp_exec_rms_norm(htp_exec *e, const htp_rms_norm_params *p, const float *x, const float *w,
                       float *out) {
    rms_ctx c = {e->isa, p, x, w, out};
    /* below ~64K elements a wake-up costs more than it saves */
    if ((uint64_t)p->t * p->n_groups * p->d < 65536)
        rms_task(&c, 0, 1);
    else
        htp_parallel(e->pool, rms_task, &c);
}

/* ---- RoPE (validated by the caller): tokens split across the pool's threads. Each token's
 * cos/sin pairs (double, times the YaRN magnitude scale) depend only on its position and the
 * rotation parameters, not on the rows rotated, so they are computed once into a table the
 * exec keeps (struct htp_rope_table): the q and k of a layer and every later layer of a pass
 * at the same positions reuse it instead of calling cos/sin again; the values are the same
 * doubles, so the results are the same bits. ---- */
struct htp_rope_table {
    htp_rope_params key; /* t and the rotation parameters the table is for (rows fields 0) */
    int32_t *pos;        /* [t] the positions */
    double *cs;          /* [t][half][2] cos·mscale, sin·mscale */
    size_t cap_t, cap_pairs; /* tokens pos, cos/sin pairs cs were allocated for */
};
/* Above this many cos/sin pairs (16 MiB of doubles) a table is not kept: they are computed per
 * call into a buffer freed on return. */
#define HTP_ROPE_TABLE_MAX_PAIRS ((size_t)1 << 20)

void htp_rope_table_free(struct htp_rope_table *rt) {
    if (!rt) return;
    free(rt->pos);
    free(rt->cs);
    free(rt);
}

typedef struct rope_ctx {
    const htp_rope_params *p;
    float *x;
    const int32_t *pos;
    const double *inv_freq; /* [half] freq_base^(-2j/n_rot) */
    double *cs;             /* [t][half][2] */
    double mscale, ext, span;
} rope_ctx;

static void rope_table_task(void *arg, uint32_t ith, uint32_t nth) {
    const rope_ctx *c = (const rope_ctx *)arg;
    const htp_rope_params *p = c->p;
    const uint32_t half = p->n_rot / 2;
    uint32_t b, e;
    htp_split(p->t, ith, nth, &b, &e);
    for (uint32_t i = b; i < e; i++) {
        double *cs = c->cs + (size_t)i * 2 * half;
        for (uint32_t j = 0; j < half; j++) {
            const double extrap = (double)c->pos[i] * c->inv_freq[j];
            double theta = (double)p->freq_scale * extrap;
            if (c->ext != 0.0) {
                const double y = fmin(1.0, fmax(0.0, ((double)j - (double)p->corr_low) / c->span));
                const double mix = (1.0 - y) * c->ext;
                theta = theta * (1.0 - mix) + extrap * mix;
            }
            cs[2 * j] = cos(theta) * c->mscale;
            cs[2 * j + 1] = sin(theta) * c->mscale;
        }
    }
}

static void rope_task(void *arg, uint32_t ith, uint32_t nth) {
    const rope_ctx *c = (const rope_ctx *)arg;
    const htp_rope_params *p = c->p;
    const uint32_t n_rot = p->n_rot, half = n_rot / 2, mode = p->mode;
    const uint32_t n_heads = p->n_heads, head_dim = p->head_dim; /* locals: see binary_rows */
    uint32_t b, e;
    htp_split(p->t, ith, nth, &b, &e);
    for (uint32_t i = b; i < e; i++) {
        const double *cs = c->cs + (size_t)i * 2 * half;
        for (uint32_t h = 0; h < n_heads; h++) {
            float *v = c->x + ((size_t)i * n_heads + h) * head_dim;
            for (uint32_t j = 0; j < half; j++) {
                const uint32_t a = mode == HTP_ROPE_NORMAL ? 2 * j : j;
                const uint32_t bb = mode == HTP_ROPE_NORMAL ? 2 * j + 1 : j + half;
                const double x0 = v[a], x1 = v[bb];
                v[a] = (float)(x0 * cs[2 * j] - x1 * cs[2 * j + 1]);
                v[bb] = (float)(x0 * cs[2 * j + 1] + x1 * cs[2 * j]);
            }
        }
    }
}

/* the parameters a cos/sin table depends on: t and the rotation's, the rows' fields zeroed */
static htp_rope_params rope_key(const htp_rope_params *p) {
    htp_rope_params k;
    memset(&k, 0, sizeof k);
    k.t = p->t;
    k.n_rot = p->n_rot;
    k.freq_base = p->freq_base;
    k.freq_scale = p->freq_scale;
    k.yarn = p->yarn != 0;
    if (k.yarn) {
        k.ext_factor = p->ext_factor;
        k.attn_factor = p->attn_factor;
        k.corr_low = p->corr_low;
        k.corr_high = p->corr_high;
    }
    return k;
}

htp_status htp_exec_rope(htp_exec *e, const htp_rope_params *p, float *x, const int32_t *pos) {
    const uint32_t half = p->n_rot / 2;
    if (half == 0 || p->t == 0) return HTP_OK; /* nothing rotates */
    const uint32_t nth = (uint64_t)p->t * p->n_heads * p->n_rot < 16384 ? 1 : htp_pool_nth(e->pool);
    const size_t pairs = (size_t)p->t * half;
    const htp_rope_params key = rope_key(p);
    struct htp_rope_table *rt = e->rope;
    double *cs = NULL, *own = NULL;
    if (rt && memcmp(&rt->key, &key, sizeof key) == 0 &&
        memcmp(rt->pos, pos, sizeof(int32_t) * p->t) == 0) {
        cs = rt->cs; /* the same positions and rotation: the table is current */
    } else {
        double *inv = (double *)malloc(sizeof(double) * half);
        if (!inv) return HTP_E_NOMEM;
        for (uint32_t j = 0; j < half; j++) inv[j] = pow((double)p->freq_base, -2.0 * (double)j / (double)p->n_rot);
        if (pairs <= HTP_ROPE_TABLE_MAX_PAIRS) {
            if (!rt) rt = e->rope = (struct htp_rope_table *)calloc(1, sizeof *rt);
            if (rt && (rt->cap_t < p->t || rt->cap_pairs < pairs)) {
                free(rt->pos);
                free(rt->cs);
                rt->pos = (int32_t *)malloc(sizeof(int32_t) * p->t);
                rt->cs = (double *)malloc(sizeof(double) * 2 * pairs);
                const int ok = rt->pos && rt->cs;
                rt->cap_t = ok ? p->t : 0;
                rt->cap_pairs = ok ? pairs : 0;
                memset(&rt->key, 0xff, sizeof rt->key);
            }
            if (rt && rt->cap_t >= p->t && rt->cap_pairs >= pairs) {
                memset(&rt->key, 0xff, sizeof rt->key); /* invalid until filled */
                cs = rt->cs;
            }
        }
        if (!cs) cs = own = (double *)malloc(sizeof(double) * 2 * pairs);
        if (!cs) {
            free(inv);
            return HTP_E_NOMEM;
        }
        const int yarn = p->yarn != 0;
        const double ext = yarn ? (double)p->ext_factor : 0.0;
        double mscale = yarn ? (double)p->attn_factor : 1.0;
        if (ext != 0.0) mscale *= 1.0 + 0.1 * log(1.0 / (double)p->freq_scale);
        rope_ctx tc = {p, x, pos, inv, cs, mscale, ext,
                       fmax(0.001, (double)p->corr_high - (double)p->corr_low)};
        if ((uint64_t)p->t * half < 4096)
            rope_table_task(&tc, 0, 1);
        else
            htp_parallel(e->pool, rope_table_task, &tc);
        free(inv);
        if (!own) {
            memcpy(rt->pos, pos, sizeof(int32_t) * p->t);
            rt->key = key;
        }
    }
    rope_ctx c = {p, x, pos, NULL, cs, 0.0, 0.0, 0.0};
    if (nth == 1)
        rope_task(&c, 0, 1);
    else
        htp_parallel(e->pool, rope_task, &c);
    free(own);
    return HTP_OK;
}

/* ---- causal depthwise conv1d (validated by the caller) ----
 * One portable body for every ISA: the inner loop runs over contiguous channels, which the
 * compiler vectorises; the taps are summed in order 0..taps-1 in fp32, as ggml_ssm_conv does. */
htp_status htp_exec_conv1d(const htp_conv1d_params *p, const float *x, const float *w,
                           const float *state, float *out) {
    const size_t C = p->channels, L = p->taps, T = p->t;
    float *wt = (float *)malloc(sizeof(float) * C * L); /* [taps][C]: a tap's weights in a row */
    if (!wt) return HTP_E_NOMEM;
    for (size_t c = 0; c < C; c++)
        for (size_t j = 0; j < L; j++) wt[j * C + c] = w[c * L + j];
    for (size_t t = 0; t < T; t++) {
        float *o = out + t * C;
        for (size_t c = 0; c < C; c++) o[c] = 0.0f;
        for (size_t j = 0; j < L; j++) {
            /* row t + j of [state; x]: state rows come first (taps - 1 of them) */
            const size_t r = t + j;
            const float *src;
            if (r + 1 >= L)
                src = x + (r + 1 - L) * C;
            else if (state)
                src = state + r * C;
            else
                continue; /* zero history */
            const float *wj = wt + j * C;
            for (size_t c = 0; c < C; c++) o[c] += wj[c] * src[c];
        }
    }
    free(wt);
    return HTP_OK;
}

/* ---- element-wise add / multiply, strided copy, fill (validated by the caller) ----
 * One portable body each for every ISA and backend: contiguous inner loops the compiler
 * vectorises; one rounding per element, so every backend gives the same bits (and numpy's
 * float32 a + b / a * b the same too). */
typedef struct rows_ctx {
    uint32_t opcode;
    const htp_binary_params *bp;
    const htp_copy_params *cp;
    const void *a, *b;
    void *out;
} rows_ctx;

static void binary_rows(uint32_t opcode, const htp_binary_params *p, const float *a,
                        const float *b, float *out, size_t r0, size_t r1) {
    /* the sizes in locals: read through p inside the loop, they would be reloaded after every
     * store to o (which may alias *p as far as the compiler knows), keeping the loop scalar */
    const size_t cols = p->cols, lda = p->lda, ldb = p->ldb, ldo = p->ldo;
    for (size_t r = r0; r < r1; r++) {
        const float *ar = a + r * lda, *br = b + r * ldb;
        float *o = out + r * ldo;
        if (opcode == HTP_OP_ADD)
            for (size_t c = 0; c < cols; c++) o[c] = ar[c] + br[c];
        else
            for (size_t c = 0; c < cols; c++) o[c] = ar[c] * br[c];
    }
}

static void copy_rows(const htp_copy_params *p, const uint32_t *src, uint32_t *dst, size_t r0,
                      size_t r1) {
    const size_t cols = p->cols, ld_src = p->ld_src, ld_dst = p->ld_dst, rep = p->rep;
    for (size_t r = r0; r < r1; r++) memcpy(dst + r * ld_dst, src + (r / rep) * ld_src, cols * 4);
}

static void rows_task(void *arg, uint32_t ith, uint32_t nth) {
    const rows_ctx *c = (const rows_ctx *)arg;
    uint32_t b, e;
    if (c->bp) {
        htp_split(c->bp->rows, ith, nth, &b, &e);
        binary_rows(c->opcode, c->bp, (const float *)c->a, (const float *)c->b, (float *)c->out, b, e);
    } else {
        htp_split(c->cp->rows, ith, nth, &b, &e);
        copy_rows(c->cp, (const uint32_t *)c->a, (uint32_t *)c->out, b, e);
    }
}

/* below ~64K elements a wake-up costs more than it saves */
#define HTP_ROWS_PARALLEL_MIN 65536u

void htp_exec_binary(htp_exec *e, uint32_t opcode, const htp_binary_params *p, const float *a,
                     const float *b, float *out) {
    /* out is an input element for element or apart from both (htp_backend.c checks) */
    if ((uint64_t)p->rows * p->cols < HTP_ROWS_PARALLEL_MIN) {
        binary_rows(opcode, p, a, b, out, 0, p->rows);
        return;
    }
    rows_ctx c = {opcode, p, NULL, a, b, out};
    htp_parallel(e->pool, rows_task, &c);
}

/* silu(g)·u (u NULL: silu alone), or SwiGLU-OAI (glu HTP_GLU_SWIGLU_OAI, alpha, limit: u not
 * NULL), over n values: split across the pool in pieces of whole 64-value blocks (the table's
 * vector body gives every element the same bits wherever it sits, a padded tail included, so
 * the split changes nothing). out is g or u element for element, or apart from both
 * (htp_backend.c checks). */
typedef struct glu_ctx {
    const htp_isa *isa;
    const float *g, *u;
    float *out;
    uint64_t n;
    uint32_t glu;
    float alpha, limit;
} glu_ctx;

static void glu_run(const glu_ctx *c, uint64_t b, uint64_t e) {
    if (c->glu == HTP_GLU_SWIGLU_OAI)
        c->isa->swiglu_oai(c->g + b, c->u + b, e - b, c->alpha, c->limit, c->out + b);
    else
        c->isa->swiglu(c->g + b, c->u ? c->u + b : NULL, e - b, c->out + b);
}

static void glu_task(void *arg, uint32_t ith, uint32_t nth) {
    const glu_ctx *c = (const glu_ctx *)arg;
    const uint64_t blocks = (c->n + 63) / 64;
    const uint64_t b = blocks * ith / nth * 64, e = HTP_MIN(c->n, blocks * (ith + 1) / nth * 64);
    if (b < e) glu_run(c, b, e);
}

void htp_exec_swiglu(htp_exec *e, const float *g, const float *u, uint64_t n, uint32_t glu,
                     float alpha, float limit, float *out) {
    glu_ctx c = {e->isa, g, u, out, n, glu, alpha, limit};
    if (n < HTP_ROWS_PARALLEL_MIN)
        glu_run(&c, 0, n);
    else
        htp_parallel(e->pool, glu_task, &c);
}

void htp_exec_copy_rows(htp_exec *e, const htp_copy_params *p, const uint32_t *src, uint32_t *dst) {
    if ((uint64_t)p->rows * p->cols < HTP_ROWS_PARALLEL_MIN) { /* src and dst never overlap */
        copy_rows(p, src, dst, 0, p->rows);
        return;
    }
    rows_ctx c = {0, NULL, p, src, NULL, dst};
    htp_parallel(e->pool, rows_task, &c);
}

void htp_exec_fill(const htp_fill_params *p, uint32_t *out) {
    const uint64_t n = p->n;
    const uint32_t value = p->value; /* in locals: see binary_rows */
    for (uint64_t i = 0; i < n; i++) out[i] = value;
}

/* ---- fp32 matmul (validated by the caller): token rows split across the pool; each output
 * is summed over k in order (the table's body), so results do not depend on the thread count,
 * the instruction set or the backend ---- */
void htp_matmul_f32_portable(const float *x, const float *w, uint32_t k, uint32_t n, uint32_t i0,
                             uint32_t i1, float *y) {
    htp_matmul_f32_body(x, w, k, n, i0, i1, y);
}

typedef struct matmul_ctx {
    const htp_isa *isa;
    const htp_matmul_params *p;
    const float *x, *w;
    float *y;
} matmul_ctx;

static void matmul_task(void *arg, uint32_t ith, uint32_t nth) {
    const matmul_ctx *c = (const matmul_ctx *)arg;
    uint32_t b, e;
    htp_split(c->p->t, ith, nth, &b, &e);
    if (b < e) c->isa->matmul_f32(c->x, c->w, c->p->k, c->p->n, b, e, c->y);
}

htp_status htp_exec_matmul_f32(htp_exec *e, const htp_matmul_params *p, const float *x,
                               const float *w, float *y) {
    matmul_ctx c = {e->isa, p, x, w, y};
    if (p->t) htp_parallel(e->pool, matmul_task, &c);
    return HTP_OK;
}

/* ---- router (validated by the caller): tokens split across the pool's threads, each row
 * computed the same way whatever the split ---- */
typedef struct router_ctx {
    const htp_router_params *pr;
    const float *logits, *bias;
    int32_t *ids;
    float *weights;
    double *scratch; /* [nth][per] */
    size_t per;      /* doubles of one thread's scratch: p, key, then the taken flags */
} router_ctx;

static void router_task(void *arg, uint32_t ith, uint32_t nth) {
    const router_ctx *c = (const router_ctx *)arg;
    const htp_router_params *pr = c->pr;
    const uint32_t n_experts = pr->n_experts, k = pr->k;
    double *p = c->scratch + (size_t)ith * c->per;
    double *key = p + n_experts;
    uint8_t *taken = (uint8_t *)(key + n_experts); /* [n_experts] after the two double rows */
    uint32_t b, e_;
    htp_split(pr->t, ith, nth, &b, &e_);
    for (uint32_t i = b; i < e_; i++) {
        const float *l = c->logits + (size_t)i * n_experts;
        if (pr->gating == HTP_GATING_SOFTMAX) {
            double mx = -INFINITY, sum = 0.0;
            for (uint32_t e = 0; e < n_experts; e++) mx = l[e] > mx ? l[e] : mx;
            for (uint32_t e = 0; e < n_experts; e++) sum += (p[e] = exp((double)l[e] - mx));
            for (uint32_t e = 0; e < n_experts; e++) key[e] = (p[e] /= sum);
        } else {
            for (uint32_t e = 0; e < n_experts; e++) {
                p[e] = 1.0 / (1.0 + exp(-(double)l[e]));
                key[e] = p[e] + (c->bias ? (double)c->bias[e] : 0.0);
            }
        }
        int32_t *id = c->ids + (size_t)i * k;
        float *wt = c->weights + (size_t)i * k;
        /* selection: k passes, each picks the largest key not yet taken (ties -> lower id; a
         * NaN key is never larger, so it is picked only when nothing before it is) */
        memset(taken, 0, n_experts);
        double wsum = 0.0;
        for (uint32_t j = 0; j < k; j++) {
            int32_t best = -1;
            for (uint32_t e = 0; e < n_experts; e++) {
                if (taken[e]) continue;
                if (best < 0 || key[e] > key[best]) best = (int32_t)e;
            }
            id[j] = best;
            taken[best] = 1;
            wsum += p[best];
        }
        for (uint32_t j = 0; j < k; j++) {
            double v = p[id[j]];
            if (pr->norm) v /= wsum;
            wt[j] = (float)(v * pr->scale);
        }
    }
}

htp_status htp_exec_router(htp_exec *ex, const htp_router_params *pr, const float *logits,
                           const float *bias, int32_t *ids, float *weights) {
    const uint32_t n_experts = pr->n_experts;
    /* below ~16K logits a wake-up costs more than it saves */
    const uint32_t nth = (uint64_t)pr->t * n_experts < 16384 ? 1 : htp_pool_nth(ex->pool);
    /* per thread: p and key (doubles), then the taken flags (bytes, rounded up to doubles) */
    const size_t per = 2 * (size_t)n_experts + ((size_t)n_experts + 7) / 8;
    double *scratch = (double *)malloc(sizeof(double) * per * nth);
    if (!scratch) return HTP_E_NOMEM;
    router_ctx c = {pr, logits, bias, ids, weights, scratch, per};
    if (nth == 1) {
        router_task(&c, 0, 1);
    } else {
        htp_parallel(ex->pool, router_task, &c);
    }
    free(scratch);
    return HTP_OK;
}
