/* Internal declarations shared by the library's translation units (not part of the ABI).
 *
 * Structure: one generic driver per op (tiling, token blocking, threading) over a small,
 * immutable table of inner loops per instruction set (`htp_isa`). A new instruction set (HVX)
 * fills in a table; it never copies a driver. */
#ifndef ESTREAM_HTP_INTERNAL_H
#define ESTREAM_HTP_INTERNAL_H

#include "htp.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(HTP_NO_SIMD)
#define HTP_X86 1
#define HTP_TARGET(s) __attribute__((target(s)))
#define HTP_T_AVX2 HTP_TARGET("avx2,fma,f16c")
#define HTP_T_AVX512 HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define HTP_T_VNNI HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define HTP_T_BF16 HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif
#if defined(__aarch64__) && !defined(HTP_NO_SIMD)
#define HTP_ARM64 1
#endif
/* Hexagon (the executor built with csrc/hexagon's freestanding runtime): one thread, and the
 * HVX table when the compiler targets HVX (-mhvx -mhvx-length=128b). */
#if defined(__hexagon__)
#define HTP_NO_THREADS 1
#if defined(__HVX__) && !defined(HTP_NO_SIMD)
#define HTP_HVX 1
#endif
#endif

#define HTP_TILE 32
#define HTP_Q4_TILE_BYTES 576
#define HTP_Q8_TILE_BYTES 1088
#define HTP_Q4K_TILE_BYTES 704  /* d, dmin (fp16), sc, m (uint8) per row, then Q4_0-order nibbles */
#define HTP_Q6K_TILE_BYTES 1152 /* d (fp16), two int8 scales per row, then int8 values */
#define HTP_Q5K_TILE_BYTES 832  /* Q4_K's header and nibbles, then each row's fifth bits */
#define HTP_MXFP4_TILE_BYTES 544
#define HTP_Q41_TILE_BYTES 640 /* (d, m) fp16 pair per row, then Q4_0-order nibbles */
#define HTP_Q50_TILE_BYTES 704 /* fp16 d per row, each row's fifth bits, then nibbles */
#define HTP_Q51_TILE_BYTES 768 /* (d, m) per row, each row's fifth bits, then nibbles */ /* E8M0 exponent byte per row, then Q4_0-order FP4 codes */
#define HTP_IQ4XS_TILE_BYTES 608 /* fp16 d, int8 sub-block scale per row, then IQ4_NL codes */
#define HTP_F16T_TILE_BYTES 2048 /* F16 / BF16 values: 16 groups of 128 B, two columns a row each */
/* F16 / BF16 tiles: dense matrices only, multiplied in fp32 (no int8 kernel, no experts) */
#define HTP_IS_FLOAT_TILE(fmt) ((fmt) == HTP_FMT_F16_T32R4 || (fmt) == HTP_FMT_BF16_T32R4)
#define HTP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define HTP_MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- thread pool (one per backend) ---- */
typedef struct htp_pool htp_pool;
typedef void (*htp_task_fn)(void *ctx, uint32_t ith, uint32_t nth);
htp_pool *htp_pool_new(void);
void htp_pool_free(htp_pool *p);
htp_status htp_pool_resize(htp_pool *p, uint32_t nth);
/* Run fn(ctx, i, n) on every pool thread (the caller is thread 0) and wait for all. */
void htp_parallel(htp_pool *p, htp_task_fn fn, void *ctx);
/* Wait until every thread of the running parallel region arrived (call from all of them). */
void htp_barrier(htp_pool *p);
uint32_t htp_pool_nth(const htp_pool *p);
/* Per-thread scratch `which` (0..3) of at least `bytes` (grows; 0 returns the current one). */
void *htp_scratch(htp_pool *p, uint32_t ith, uint32_t which, size_t bytes);
/* In a forked child: the workers are gone; continue single-threaded. */
void htp_pool_after_fork(htp_pool *p);

/* Even split of [0, n) into nth contiguous parts: part ith is [*b, *e). */
static inline void htp_split(uint32_t n, uint32_t ith, uint32_t nth, uint32_t *b, uint32_t *e) {
    *b = (uint32_t)(((uint64_t)n * ith) / nth);
    *e = (uint32_t)(((uint64_t)n * (ith + 1)) / nth);
}

/* Dynamic work sharing inside one parallel region: each call returns the next unclaimed item
 * of a counter the region's threads share (start it at 0 before htp_parallel). Work handed out
 * this way, instead of fixed parts per thread, keeps both cores busy when one of them is
 * preempted (by the loader, by I/O interrupts): a fixed split makes the whole op wait for the
 * thread that lost its core. Each item is computed by one thread, so results do not depend on
 * which thread takes it. */
static inline uint32_t htp_next(uint32_t *counter) {
    return __atomic_fetch_add(counter, 1u, __ATOMIC_RELAXED);
}

/* ---- half floats ---- */
static inline float htp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- MXFP4 (OCP microscaling FP4) ----
 * The E2M1 value of each 4-bit code, doubled so it is an integer (codes 8..15: the negatives of
 * 0..7), and half the E8M0 block scale, 2^(e - 128) (subnormal for e = 0, 1): a block's value is
 * htp_mxfp4_kvalues[code] * htp_e8m0_half(e), llama.cpp's convention. */
static const int8_t htp_mxfp4_kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* IQ4_NL: the int8 value of each 4-bit code (llama.cpp's kvalues_iq4nl); value = d * kv[code] */
static const int8_t htp_iq4nl_kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};
static inline float htp_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- activations ---- */
typedef struct htp_act_q8 {
    const int8_t *q;  /* [t][k] */
    const float *d;   /* [t][k/32] */
    const int32_t *s; /* [t][k/32] (sums of the int8 values of each block) */
    /* optional (NULL: a kernel computes them): [t][k/32][2], -32 x the sum of each block's
     * values 0..15 and -32 x the sum of its values 16..31, the integer start of the Q6_K
     * kernels' two half sums (htp_q8_q6k_seeds); filled by the ops that quantize the rows */
    const int32_t *z;
    /* optional (NULL: a kernel computes them): [t][k/32], (float)s x d of each block, the
     * Q4_K / Q5_K epilogue's sa·da (htp_q8_q45k_sada); filled as z */
    const float *sd;
} htp_act_q8;

/* The IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1 int8 kernels (htp_x86.c's LQ_KERNEL / lqq8_rows16_avx2,
 * htp_neon.c's lq_part_neon): which tile (K, a compile-time constant in each instantiation), its
 * bytes, where its Q4_0-ordered nibbles start, where its fifth-bit words start (Q5_0, Q5_1). */
#define LQ_IQ4NL 0
#define LQ_IQ4XS 1
#define LQ_Q41 2
#define LQ_Q50 3
#define LQ_Q51 4
#define LQ_BYTES(K)                                                                              \
    ((K) == LQ_IQ4NL   ? HTP_Q4_TILE_BYTES                                                       \
     : (K) == LQ_IQ4XS ? HTP_IQ4XS_TILE_BYTES                                                    \
     : (K) == LQ_Q41   ? HTP_Q41_TILE_BYTES                                                      \
     : (K) == LQ_Q50   ? HTP_Q50_TILE_BYTES                                                      \
                       : HTP_Q51_TILE_BYTES)
#define LQ_NIB(K) ((K) == LQ_IQ4NL ? 64 : (K) == LQ_IQ4XS ? 96 : (K) == LQ_Q41 ? 128 : (K) == LQ_Q50 ? 192 : 256)
#define LQ_QH(K) ((K) == LQ_Q50 ? 64 : 128) /* the fifth-bit words (Q5_0, Q5_1) */
#define LQ_IQ4(K) ((K) == LQ_IQ4NL || (K) == LQ_IQ4XS)
#define LQ_HASM(K) ((K) == LQ_Q41 || (K) == LQ_Q51)
#define LQ_Q5(K) ((K) == LQ_Q50 || (K) == LQ_Q51)

/* One table's three entries to those kernels, nlq8_strip_NAME (IQ4_NL), xsq8_strip_NAME
 * (IQ4_XS) and affq8_strip_NAME (Q4_1 / Q5_0 / Q5_1 by fmt), each calling
 * STRIP(strip, kb, a, nt, out, ldo, rows, K) with its constant K; ATTR: the table's attributes. */
#define LQ_ENTRIES(NAME, ATTR, STRIP)                                                            \
    ATTR static void nlq8_strip_##NAME(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,   \
                                       uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {   \
        STRIP(strip, kb, a, nt, out, ldo, rows, LQ_IQ4NL);                                       \
    }                                                                                            \
    ATTR static void xsq8_strip_##NAME(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a,   \
                                       uint32_t nt, float *out, uint32_t ldo, uint32_t rows) {   \
        STRIP(strip, kb, a, nt, out, ldo, rows, LQ_IQ4XS);                                       \
    }                                                                                            \
    ATTR static void affq8_strip_##NAME(const uint8_t *strip, uint32_t fmt, uint32_t kb,         \
                                        const htp_act_q8 *a, uint32_t nt, float *out,            \
                                        uint32_t ldo, uint32_t rows) {                           \
        if (fmt == HTP_FMT_Q4_1_T32R4)                                                           \
            STRIP(strip, kb, a, nt, out, ldo, rows, LQ_Q41);                                     \
        else if (fmt == HTP_FMT_Q5_0_T32R4)                                                      \
            STRIP(strip, kb, a, nt, out, ldo, rows, LQ_Q50);                                     \
        else                                                                                     \
            STRIP(strip, kb, a, nt, out, ldo, rows, LQ_Q51);                                     \
    }

/* ---- attention ---- */
#define HTP_ATTN_BQ 64
#define HTP_ATTN_BK 64
typedef struct htp_attn_ctx {
    const float *q, *k, *v;
    float *out;
    uint32_t t, hq, hkv, dk, dv, causal, n_qblk;
    float scale;
    float *kt;    /* optional: K per KV head in transposed key blocks [hkv][kblk][dk][BK] */
    float *vp;    /* optional: V per KV head, contiguous rows [hkv][t][dv] */
    size_t kt_ld; /* number of key blocks (ceil(t / BK)) */
    /* the products (htp_products): HTP_PRODUCTS_BF16 rounds q*scale, k, v, p to bfloat16,
     * HTP_PRODUCTS_BF16_PV only v and p */
    uint32_t bf16;
    /* native bf16 path: bf16 pairs as 32-bit words, K [hkv][kblk][dk/2][BK] (dims 2i, 2i+1 of
     * one key; NULL under BF16_PV, whose K is kt), V [hkv][kblk][BK/2][dv] (keys 2i, 2i+1 of
     * one value dim); zero past t */
    uint32_t *kw, *vw;
    htp_pool *pool;
    const struct htp_isa *isa;
    uint32_t tk;   /* key/value rows: n_ctx + t (t counts the queries) */
    uint32_t kofs; /* n_ctx: query i sits at key position kofs + i */
    uint32_t next; /* the next (head, query block) task to hand out (htp_next) */
    uint32_t window;     /* causal only: 0, or the number of keys up to its own a query sees */
    const float *sinks;  /* NULL, or one logit per query head joining each row's denominator */
} htp_attn_ctx;

/* Keys query row i (0-based among the queries) may see: [begin, end). */
static inline uint32_t htp_attn_key_end(const htp_attn_ctx *c, uint32_t i) {
    return c->causal ? c->kofs + i + 1 : c->tk;
}
static inline uint32_t htp_attn_key_begin(const htp_attn_ctx *c, uint32_t i) {
    const uint32_t end = c->kofs + i + 1;
    return c->window && end > c->window ? end - c->window : 0;
}
/* Of key block [j0, j0 + nj), the first key query row i sees is j0 + lo and the last is
 * j0 + lim - 1 (none when lo >= lim). */
static inline uint32_t htp_attn_key_lim(const htp_attn_ctx *c, uint32_t i, uint32_t j0, uint32_t nj) {
    const uint32_t end = htp_attn_key_end(c, i);
    return end > j0 ? HTP_MIN(nj, end - j0) : 0;
}
static inline uint32_t htp_attn_key_lo(const htp_attn_ctx *c, uint32_t i, uint32_t j0) {
    const uint32_t begin = htp_attn_key_begin(c, i);
    return begin > j0 ? begin - j0 : 0;
}
size_t htp_attn_scratch_floats(const htp_attn_ctx *c);
/* K and V as bf16 (the bf16 tasks' operands), the scalar packer every table can use
 * (htp_attention.c): NEON's, and AVX-512's for heads over 512 wide. */
void htp_attn_bf16_pack_scalar(const htp_attn_ctx *c, uint32_t ith, uint32_t nth);

/* fp32 -> bfloat16 bits, round to nearest even, subnormals to signed zero, NaN kept quiet (the
 * rounding of AVX512_BF16's vcvtneps2bf16). */
static inline uint16_t htp_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float htp_bf16_round(float f) {
    const uint32_t u = (uint32_t)htp_bf16_bits(f) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}
/* Whether this CPU has AVX512_BF16 (x86) or FEAT_BF16 (arm64): the native bf16 attention
 * kernels need it. */
int htp_cpu_bf16(void);

/* ---- the inner-loop table of one instruction set ----
 * Strip kernels compute, for one 32-row tile strip of W (kb tiles of 32x32) and nt <= *_nt
 * consecutive tokens, out[u*ldo + r] for u < nt and r < rows (rows past `rows` untouched). */
typedef struct htp_isa {
    uint32_t level;
    /* Q4_0 tiles x Q8 activations (a points at the strip's first token) */
    void (*q4q8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                       float *out, uint32_t ldo, uint32_t rows);
    uint32_t q4q8_nt;
    /* Q8_0 tiles x Q8 activations */
    void (*q8q8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                       float *out, uint32_t ldo, uint32_t rows);
    uint32_t q8q8_nt;
    /* Q4_K / Q6_K tiles x Q8 activations (NULL: the portable kernels), kq8_nt tokens a call */
    void (*q4kq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                        float *out, uint32_t ldo, uint32_t rows);
    void (*q6kq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                        float *out, uint32_t ldo, uint32_t rows);
    uint32_t kq8_nt;
    /* Q5_K tiles x Q8 activations (NULL: the portable kernel), kq8_nt tokens a call */
    void (*q5kq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                        float *out, uint32_t ldo, uint32_t rows);
    /* Q4_1 / Q5_0 / Q5_1 tiles x Q8 activations (NULL: the portable kernel), mxq8_nt tokens */
    void (*affq8_strip)(const uint8_t *strip, uint32_t fmt, uint32_t kb, const htp_act_q8 *a,
                        uint32_t nt, float *out, uint32_t ldo, uint32_t rows);
    /* IQ4_NL tiles x Q8 activations (NULL: the portable kernel), mxq8_nt tokens a call */
    void (*nlq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                       float *out, uint32_t ldo, uint32_t rows);
    /* IQ4_XS tiles x Q8 activations (NULL: the portable kernel), kq8_nt tokens a call */
    void (*xsq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                       float *out, uint32_t ldo, uint32_t rows);
    /* MXFP4 tiles x Q8 activations (NULL: the portable kernel), mxq8_nt tokens a call */
    void (*mxq8_strip)(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                       float *out, uint32_t ldo, uint32_t rows);
    uint32_t mxq8_nt;
    /* one 32x32 tile dequantized into panel[col*32 + row] (Q4_0 / Q8_0 tiles) */
    void (*dequant_tile)(const uint8_t *tile, uint32_t fmt, float *panel);
    /* the same for Q4_K / Q5_K / Q6_K / MXFP4 tiles (NULL: the portable one) */
    void (*dequant_kq_tile)(const uint8_t *tile, uint32_t fmt, float *panel);
    /* a dequantized strip panel [k][32] x fp32 activations x[nt][ldx] */
    void (*f32_strip)(const float *panel, uint32_t k, const float *x, uint32_t ldx, uint32_t nt,
                      float *out, uint32_t ldo, uint32_t rows);
    uint32_t f32_nt;
    /* row of k floats -> k int8 + k/32 scales + k/32 block sums */
    void (*quantize_row_q8)(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s);
    void (*attention_task)(const htp_attn_ctx *c, uint32_t task, float *scratch);
    /* > 0: the driver re-lays K into panels of this many key columns per (key block, head dim)
     * and V into [head][key][dv] (needs dk, dv % 16 == 0); 0: the task reads K and V as given */
    uint32_t attention_kt_cols;
    /* bf16 products, used when htp_cpu_bf16() (AVX512_BF16 / FEAT_BF16) and dk, dv % 16 == 0
     * (else the generic body emulates the same rounding): pack c->kw (when not NULL) and c->vw
     * (thread ith of nth), then tasks; the BF16_PV task reads K from kt (attention_kt_cols
     * panels) and may be NULL (then the generic body emulates it) */
    void (*attention_bf16_pack)(const htp_attn_ctx *c, uint32_t ith, uint32_t nth);
    void (*attention_bf16_task)(const htp_attn_ctx *c, uint32_t task, float *scratch);
    void (*attention_bf16_pv_task)(const htp_attn_ctx *c, uint32_t task, float *scratch);
    void (*swiglu)(const float *g, const float *u, uint64_t n, float *out); /* u may be NULL */
    /* gpt-oss's SwiGLU-OAI (htp_swiglu_oai_body); out may be g or u */
    void (*swiglu_oai)(const float *g, const float *u, uint64_t n, float alpha, float limit,
                       float *out);
    /* RMSNorm of `rows` rows of d floats (w may be NULL): htp_norm_body.h's bits on every table */
    void (*rms_rows)(const float *x, const float *w, uint32_t d, float eps, size_t rows, float *out);
    /* rows [i0, i1) of y[t][n] = x[t][k] @ w[k][n], each output summed over k in order */
    void (*matmul_f32)(const float *x, const float *w, uint32_t k, uint32_t n, uint32_t i0,
                       uint32_t i1, float *y);
    /* diagnostics: 12 chains x iters of the level's int8 dot instruction; NULL if none */
    int32_t (*dot_peak)(uint64_t iters);
    uint32_t dot_macs_per_iter;
    /* the same for the fp32 FMA and (AVX512_BF16 CPUs only) the bf16 dot product */
    int32_t (*fma_peak)(uint64_t iters);
    uint32_t fma_macs_per_iter;
    int32_t (*bf16_peak)(uint64_t iters);
    uint32_t bf16_macs_per_iter;
    /* the int8 dot product in the Q4_0 / Q8_0 kernels' mix with their per-block fp32 step
     * (htp_bench_mac_peak kind 3); NULL where not measured */
    int32_t (*dotstep_peak)(uint64_t iters);
    uint32_t dotstep_macs_per_iter;
} htp_isa;

extern const htp_isa htp_isa_portable;
#ifdef HTP_X86
/* key columns per register block of the SIMD attention tasks: the K panel width their tables
 * ask the driver for (each task file asserts it equals its ATTN_MC * VW) */
#define HTP_ATTN_COLS_AVX512 64
#define HTP_ATTN_COLS_AVX2 16
void htp_attn_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_attn_task_avx2(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_attn_bf16_pack_avx512(const htp_attn_ctx *c, uint32_t ith, uint32_t nth);
void htp_attn_bf16_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_attn_bf16_pv_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch);
extern const htp_isa htp_isa_avx2;
extern const htp_isa htp_isa_avx512;
extern const htp_isa htp_isa_avx512vnni;
extern const htp_isa htp_isa_amx;
/* htp_amx.c: whether this CPU has AMX-INT8 and the OS granted the tile state (asks once) */
int htp_amx_usable(void);
void htp_q4q8_strip_amx(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                        float *out, uint32_t ldo, uint32_t rows);
int32_t htp_amx_peak(uint64_t iters);
#define HTP_Q4_VNNI_NT 6 /* tokens per call of the VNNI Q4_0 x Q8 strip */
void htp_q4q8_strip_vnni(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                         float *out, uint32_t ldo, uint32_t rows);
#endif
#ifdef HTP_ARM64
int htp_neon_dotprod_supported(void);
/* whether this CPU has the dot-product and int8 matrix-multiply (FEAT_I8MM: SMMLA) extensions */
int htp_neon_i8mm_supported(void);
/* whether this CPU has FEAT_BF16 (BFMLALB / BFMLALT: the NEON bf16 attention task) */
int htp_neon_bf16_supported(void);
/* key columns per register block of the NEON fp32 attention task (htp_attn_neon.c) */
#define HTP_ATTN_COLS_NEON 16
void htp_attn_task_neon(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_attn_bf16_task_neon(const htp_attn_ctx *c, uint32_t task, float *scratch);
extern const htp_isa htp_isa_neon;
extern const htp_isa htp_isa_neon_i8mm; /* the same with SMMLA strip kernels (FEAT_I8MM) */
#endif
#ifdef HTP_HVX
extern const htp_isa htp_isa_hvx;
#endif
/* The table of a level, or NULL if this CPU/build cannot run it. */
const htp_isa *htp_isa_for(uint32_t level);

/* Portable pieces other tables reuse. */
void htp_q8q8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows);
void htp_dequant_portable(const uint8_t *p, uint32_t fmt, float *panel);
void htp_q4kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows);
void htp_q6kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows);
void htp_q5kq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                              float *out, uint32_t ldo, uint32_t rows);
void htp_affq8_strip_portable(const uint8_t *strip, uint32_t fmt, uint32_t kb, const htp_act_q8 *a,
                              uint32_t nt, float *out, uint32_t ldo, uint32_t rows);
void htp_nlq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows);
void htp_xsq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows);
void htp_mxq8_strip_portable(const uint8_t *strip, uint32_t kb, const htp_act_q8 *a, uint32_t nt,
                             float *out, uint32_t ldo, uint32_t rows);
/* whether fmt is a weight tile format (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, Q4_1, Q5_0,
 * Q5_1, IQ4_XS) */
int htp_is_weight_format(uint32_t fmt);
int htp_is_dense_format(uint32_t fmt); /* a weight format, or an F16 / BF16 tile format */
void htp_f32_strip_portable(const float *panel, uint32_t k, const float *x, uint32_t ldx,
                            uint32_t nt, float *out, uint32_t ldo, uint32_t rows);
void htp_quantize_q8_portable(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s);
/* the Q6_K start values (htp_act_q8.z) of kb blocks of quantized values q into z[kb][2] */
void htp_q8_q6k_seeds(const int8_t *q, uint32_t kb, int32_t *z);
/* the Q4_K / Q5_K products sa·da (htp_act_q8.sd) of kb blocks' scales d and sums s into sd */
void htp_q8_q45k_sada(const float *d, const int32_t *s, uint32_t kb, float *sd);
void htp_attn_task_portable(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_swiglu_portable(const float *g, const float *u, uint64_t n, float *out);
void htp_swiglu_oai_portable(const float *g, const float *u, uint64_t n, float alpha, float limit,
                             float *out);
void htp_rms_rows_portable(const float *x, const float *w, uint32_t d, float eps, size_t rows,
                           float *out);
/* the vector SwiGLU (htp_vswiglu.h), in the attention task's translation units */
void htp_swiglu_avx2(const float *g, const float *u, uint64_t n, float *out);
void htp_swiglu_avx512(const float *g, const float *u, uint64_t n, float *out);
void htp_swiglu_oai_avx2(const float *g, const float *u, uint64_t n, float alpha, float limit,
                         float *out);
void htp_swiglu_oai_avx512(const float *g, const float *u, uint64_t n, float alpha, float limit,
                           float *out);
void htp_swiglu_neon(const float *g, const float *u, uint64_t n, float *out);
void htp_swiglu_oai_neon(const float *g, const float *u, uint64_t n, float alpha, float limit,
                         float *out);
void htp_matmul_f32_portable(const float *x, const float *w, uint32_t k, uint32_t n, uint32_t i0,
                             uint32_t i1, float *y);

/* ---- generic drivers (written once for every instruction set) ---- */
/* GEMM over row tiles [tile_b, tile_e) of W for t tokens: out[tt*ldo + (it-tile_b)*32 + r].
 * q8 != NULL: quantized activations; else fp32 x[t][ldx] with `panel` (k*32 floats).
 * `after`: the strip (k/32 tiles of this format) the caller multiplies next, fetched into the
 * cache while the range's last strip runs (NULL: W's strip tile_e, if any). */
void htp_gemm_tiles(const htp_isa *isa, const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k,
                    uint32_t tile_b, uint32_t tile_e, const htp_act_q8 *q8, const float *x,
                    uint32_t ldx, uint32_t t, float *out, uint32_t ldo, float *panel,
                    const uint8_t *after);

size_t htp_tile_bytes(uint32_t fmt);
uint64_t htp_matrix_bytes(uint32_t fmt, uint32_t n, uint32_t k);

/* ---- the execution context of a HOST backend (also used by the executor) ---- */
typedef struct htp_exec {
    const htp_isa *isa;
    htp_pool *pool;
    struct htp_expert_ws *ws; /* expert op working set, grown on demand */
    struct htp_rope_table *rope; /* the last RoPE cos/sin table (htp_core.c), or NULL */
} htp_exec;

/* One matrix of a GEMM op: W [n][k] (tiles) -> y [t][ldy] (first n columns). */
typedef struct htp_gemm_mat {
    const uint8_t *w;
    uint32_t n, ldy;
    float *y;
} htp_gemm_mat;

/* y_i = x . W_i^T for n_mats (1..3) matrices of one format sharing x (quantized once). */
htp_status htp_exec_gemm(htp_exec *e, const htp_gemm_mat *mats, uint32_t n_mats, uint32_t fmt,
                         uint32_t k, const float *x, uint32_t t, uint32_t ldx, uint32_t act,
                         const htp_act_q8 *xq);
/* The tile formats of an expert's gate, up and down (`format`, `format_up`, `format_down`, 0 =
 * `format`): HTP_E_UNSUPPORTED unless each is a weight tile format the expert op computes. */
htp_status htp_expert_formats(const htp_expert_params *p, uint32_t fmt[3]);
/* The routed-expert op (htp.h's HTP_OP_EXPERT, activation p->glu); bias: gate [E][d_ff], up
 * [E][d_ff], down [E][d_model] f32 rows indexed by expert id, or NULLs (p->has_bias = 0). */
htp_status htp_exec_expert(htp_exec *e, const htp_expert_params *p, uint32_t act,
                           const float *x, const int32_t *tokens, const int32_t *experts,
                           const float *weights, const int32_t *slot_of_expert,
                           const uint8_t *const planes[3], float *y, const htp_act_q8 *xq,
                           const float *const bias[3]);
/* Q8 rows (htp.h, htp_quantize_params) of x[t][d]; the parts of `out` as an htp_act_q8. */
htp_act_q8 htp_q8_rows(const uint8_t *rows, uint32_t t, uint32_t d);
void htp_exec_quantize(htp_exec *e, const htp_quantize_params *p, const float *x, uint8_t *out);
void htp_expert_ws_free(struct htp_expert_ws *ws);
void htp_rope_table_free(struct htp_rope_table *rt);
htp_status htp_exec_attention(htp_exec *e, const htp_attention_params *p, const float *q,
                              const float *k, const float *v, const float *sinks, float *out);
void htp_exec_get_rows(const htp_get_rows_params *p, const uint8_t *table, const int32_t *ids,
                       float *out);
void htp_exec_rms_norm(htp_exec *e, const htp_rms_norm_params *p, const float *x, const float *w,
                       float *out);
htp_status htp_exec_rope(htp_exec *e, const htp_rope_params *p, float *x, const int32_t *pos);
htp_status htp_exec_conv1d(const htp_conv1d_params *p, const float *x, const float *w,
                            const float *state, float *out);
void htp_exec_binary(htp_exec *e, uint32_t opcode, const htp_binary_params *p, const float *a,
                     const float *b, float *out);
void htp_exec_copy_rows(htp_exec *e, const htp_copy_params *p, const uint32_t *src, uint32_t *dst);
void htp_exec_swiglu(htp_exec *e, const float *g, const float *u, uint64_t n, uint32_t glu,
                     float alpha, float limit, float *out);
void htp_exec_fill(const htp_fill_params *p, uint32_t *out);
htp_status htp_exec_matmul_f32(htp_exec *e, const htp_matmul_params *p, const float *x,
                               const float *w, float *y);
htp_status htp_exec_router(htp_exec *e, const htp_router_params *p, const float *logits,
                           const float *bias, int32_t *ids, float *weights);

/* ---- REMOTE backends (htp_remote.c) ---- */
typedef struct htp_remote htp_remote;
htp_status htp_remote_open(const htp_backend_desc *desc, htp_remote **out);
void htp_remote_close(htp_remote *r);
htp_status htp_remote_register(htp_remote *r, const htp_buffer_desc *d, uint32_t *id);
htp_status htp_remote_unregister(htp_remote *r, uint32_t id);
htp_status htp_remote_configure(htp_remote *r, uint32_t n_threads, uint32_t simd,
                                uint32_t *got_simd);
htp_status htp_remote_submit(htp_remote *r, const htp_op_desc *op, uint64_t *fence);
htp_status htp_remote_wait(htp_remote *r, uint64_t fence, uint32_t timeout_ms,
                           htp_status *op_status, htp_op_times *times);

/* Run one descriptor on a HOST backend (validates every field and reference first). */
htp_status htp_host_execute(htp_backend *b, const htp_op_desc *op);

#endif
