/* Internal declarations shared by the library's translation units (not part of the ABI). */
#ifndef ESTREAM_HTP_INTERNAL_H
#define ESTREAM_HTP_INTERNAL_H

#include "htp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(HTP_NO_SIMD)
#define HTP_X86 1
#define HTP_TARGET(s) __attribute__((target(s)))
#define HTP_T_AVX2 HTP_TARGET("avx2,fma,f16c")
#define HTP_T_AVX512 HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define HTP_T_VNNI HTP_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#define HTP_TILE 32
#define HTP_Q4_TILE_BYTES 576
#define HTP_Q8_TILE_BYTES 1088
#define HTP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define HTP_MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- thread pool ---- */
typedef void (*htp_task_fn)(void *ctx, uint32_t ith, uint32_t nth);
/* Run fn(ctx, i, n) on every pool thread (the caller is thread 0) and wait for all. */
void htp_parallel(htp_task_fn fn, void *ctx);
/* Wait until every thread of the running parallel region arrived (call from all of them). */
void htp_barrier(void);
uint32_t htp_nth(void);
/* Held by every op entry point around scratch reservation and its parallel region. */
void htp_api_lock(void);
void htp_api_unlock(void);
void htp_pool_register_atfork(void);

/* Even split of [0, n) into nth contiguous parts: part ith is [*b, *e). */
static inline void htp_split(uint32_t n, uint32_t ith, uint32_t nth, uint32_t *b, uint32_t *e) {
    *b = (uint32_t)(((uint64_t)n * ith) / nth);
    *e = (uint32_t)(((uint64_t)n * (ith + 1)) / nth);
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

/* ---- activations quantized to Q8 blocks ---- */
/* Row of k floats -> k int8 + k/32 scales + k/32 block sums (sum of the int8 values). */
void htp_quantize_row_q8(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s);

/* ---- GEMM micro-kernels (per SIMD level) ----
 * For row tiles it in [tile_b, tile_e) computes out[t*ldo + (it - tile_b)*32 + r] (rows past n
 * are not written): out points at the first output column of tile tile_b. */
typedef struct htp_act_f32 {
    const float *x; /* [t][ldx] */
    uint32_t ldx;
} htp_act_f32;

typedef struct htp_act_q8 {
    const int8_t *q;  /* [t][k] */
    const float *d;   /* [t][k/32] */
    const int32_t *s; /* [t][k/32] */
} htp_act_q8;

typedef void (*htp_gemm_f32_fn)(const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k,
                                uint32_t tile_b, uint32_t tile_e, const htp_act_f32 *a,
                                uint32_t t, float *out, uint32_t ldo, float *panel);
typedef void (*htp_gemm_q8_fn)(const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k,
                               uint32_t tile_b, uint32_t tile_e, const htp_act_q8 *a,
                               uint32_t t, float *out, uint32_t ldo);

/* One attention call; tasks are (head, query block) pairs. */
#define HTP_ATTN_BQ 32
#define HTP_ATTN_BK 64
typedef struct htp_attn_ctx {
    const float *q, *k, *v;
    float *out;
    uint32_t t, hq, hkv, dk, dv, causal, n_qblk;
    float scale;
    float *kt;    /* optional: K per KV head in transposed key blocks [hkv][kblk][dk][BK] */
    float *vp;    /* optional: V per KV head, contiguous rows [hkv][t][dv] */
    size_t kt_ld; /* number of key blocks (ceil(t / BK)) */
} htp_attn_ctx;
size_t htp_attn_scratch_floats(const htp_attn_ctx *c);

typedef struct htp_kernels {
    htp_gemm_f32_fn gemm_f32;
    htp_gemm_q8_fn gemm_q8;
    void (*quantize_row_q8)(const float *x, uint32_t k, int8_t *q, float *d, int32_t *s);
    void (*attention_task)(const struct htp_attn_ctx *c, uint32_t task, float *scratch);
    void (*swiglu)(const float *g, const float *u, uint64_t n, float *out); /* u may be NULL */
} htp_kernels;

extern htp_kernels htp_k;

/* Kernel sets, filled by each level's translation unit. */
void htp_kernels_portable(htp_kernels *k);
void htp_attn_task_portable(const htp_attn_ctx *c, uint32_t task, float *scratch);
void htp_swiglu_portable(const float *g, const float *u, uint64_t n, float *out);
#if defined(__aarch64__) && !defined(HTP_NO_SIMD)
#define HTP_ARM64 1
int htp_neon_dotprod_supported(void);
void htp_kernels_neon(htp_kernels *k);
#endif
void htp_gemm_q8_portable(const uint8_t *w, uint32_t fmt, uint32_t n, uint32_t k, uint32_t tb,
                          uint32_t te, const htp_act_q8 *a, uint32_t t, float *out, uint32_t ldo);
#ifdef HTP_X86
void htp_kernels_avx2(htp_kernels *k);
void htp_kernels_avx512(htp_kernels *k);
void htp_kernels_avx512vnni(htp_kernels *k);
void htp_attn_task_avx512(const htp_attn_ctx *c, uint32_t task, float *scratch);
#endif

/* Dequantize one 32x32 tile (tile_bytes at p) into panel[col][32 rows] (column-major strip). */
void htp_dequant_tile_t(const uint8_t *p, uint32_t fmt, float *panel_cols);

/* Per-thread scratch (grows, freed at exit of the library / set_num_threads). */
void *htp_scratch(uint32_t ith, uint32_t which, size_t bytes);

size_t htp_tile_bytes(uint32_t fmt);
uint64_t htp_matrix_bytes(uint32_t fmt, uint32_t n, uint32_t k);
void htp_ensure_init(void);

#endif
