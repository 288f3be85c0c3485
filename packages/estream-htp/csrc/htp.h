/* estream-htp: the kernel library's stable C ABI.
 *
 * Rules that keep this header shareable between the host backend and a future Hexagon (HVX)
 * backend: fixed-width integers only, flat descriptor structs with explicit padding and a
 * static_assert on their size, status codes instead of errno/exceptions, init/free pairs for
 * every object, nothing ISA-specific. Pointers to weight planes travel as uint64_t addresses so
 * the descriptor is the same on 32- and 64-bit hosts.
 */
#ifndef ESTREAM_HTP_H
#define ESTREAM_HTP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HTP_ABI_VERSION 1

typedef enum htp_status {
    HTP_OK = 0,
    HTP_E_INVALID = 1,      /* bad argument (shape, size, format, index out of range) */
    HTP_E_NOMEM = 2,        /* allocation failed */
    HTP_E_UNSUPPORTED = 3,  /* SIMD level or format not available on this CPU / build */
    HTP_E_NOT_RESIDENT = 4, /* a route names an expert whose slot is -1 */
    HTP_E_CAPACITY = 5      /* more tokens than the object was sized for */
} htp_status;

typedef enum htp_format {
    HTP_FMT_Q4_0_T32R4 = 1, /* 576-byte 32x32 tiles, see docs/contracts.md section 1 */
    HTP_FMT_Q8_0_T32R4 = 2, /* 1088-byte 32x32 tiles */
    HTP_FMT_F16 = 3,        /* row-major IEEE half */
    HTP_FMT_F32 = 4         /* row-major float */
} htp_format;

typedef enum htp_simd {
    HTP_SIMD_PORTABLE = 0,
    HTP_SIMD_AVX2 = 1,
    HTP_SIMD_AVX512 = 2,
    HTP_SIMD_AVX512VNNI = 3,
    HTP_SIMD_NEON = 4
} htp_simd;

/* How activations meet the quantized weights in GEMMs and the expert op.
 * F32: weights are dequantized, products and sums in fp32 (exact path, rel. L2 ~1e-7).
 * Q8: activations quantized per 32-element block to int8 with an fp32 scale (as GGML's Q8_0),
 *     integer dot products per block, fp32 accumulation across blocks. */
typedef enum htp_act {
    HTP_ACT_F32 = 0,
    HTP_ACT_Q8 = 1
} htp_act;

typedef enum htp_rope_mode {
    HTP_ROPE_NORMAL = 0, /* pairs (2i, 2i+1) */
    HTP_ROPE_NEOX = 1    /* pairs (i, i + n_rot/2) */
} htp_rope_mode;

typedef enum htp_gating {
    HTP_GATING_SOFTMAX = 0,
    HTP_GATING_SIGMOID = 1
} htp_gating;

/* A quantized matrix W[n][k] in a tile format. */
typedef struct htp_matrix_desc {
    uint32_t format; /* htp_format */
    uint32_t n;      /* rows (outputs); storage is padded to a multiple of 32 */
    uint32_t k;      /* columns (reduction); multiple of 32 */
    uint32_t reserved;
    uint64_t nbytes; /* bytes available at the weight address (checked >= required) */
} htp_matrix_desc;

/* Sizes the fused expert op's working buffers once. */
typedef struct htp_expert_graph_desc {
    uint32_t d_model;  /* multiple of 32 */
    uint32_t d_ff;     /* multiple of 32 */
    uint32_t capacity; /* routes processed per internal pass (larger sets are split) */
    uint32_t t_max;    /* largest token count accepted */
} htp_expert_graph_desc;

/* One call of the fused expert op. */
typedef struct htp_expert_run_desc {
    uint64_t plane_base[3];   /* gate, up, down: address of slot 0 of each plane */
    uint64_t slot_stride[3];  /* bytes between consecutive slots of each plane */
    uint32_t n_tokens;        /* T: rows of x and y */
    uint32_t n_routes;        /* R: entries of tokens/experts/weights */
    uint32_t n_experts;       /* E: entries of slot_of_expert */
    uint32_t format;          /* htp_format of the expert weights (Q4_0_T32R4) */
} htp_expert_run_desc;

typedef struct htp_expert_graph htp_expert_graph;

#ifdef __cplusplus
}
#endif

#if defined(__cplusplus)
static_assert(sizeof(htp_matrix_desc) == 24, "htp_matrix_desc ABI");
static_assert(sizeof(htp_expert_graph_desc) == 16, "htp_expert_graph_desc ABI");
static_assert(sizeof(htp_expert_run_desc) == 64, "htp_expert_run_desc ABI");
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(htp_matrix_desc) == 24, "htp_matrix_desc ABI");
_Static_assert(sizeof(htp_expert_graph_desc) == 16, "htp_expert_graph_desc ABI");
_Static_assert(sizeof(htp_expert_run_desc) == 64, "htp_expert_run_desc ABI");
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- library state ---- */
uint32_t htp_abi_version(void);
htp_status htp_set_num_threads(uint32_t n);
uint32_t htp_get_num_threads(void);
uint32_t htp_simd_best(void);              /* best level this CPU and build support */
uint32_t htp_simd_get(void);
htp_status htp_simd_set(uint32_t level);   /* HTP_E_UNSUPPORTED if the CPU cannot run it */
htp_status htp_act_set(uint32_t act);
uint32_t htp_act_get(void);

/* ---- dense ops ---- */
/* y[t][n] = sum_k x[t][k] * W[n][k];  x is [t][ldx], y is [t][ldy]. */
htp_status htp_gemm(const htp_matrix_desc *w_desc, const void *w, const float *x, uint32_t t,
                    uint32_t ldx, float *y, uint32_t ldy);

/* out[t][n_cols] = row ids[t] of table (any htp_format; tile formats are read out of tiles). */
htp_status htp_get_rows(const void *table, uint32_t format, uint64_t nbytes, uint32_t n_rows,
                        uint32_t n_cols, const int32_t *ids, uint32_t t, float *out);

/* out[t][:] = x[t][:] / rms(x[t][:]) * w (w may be NULL), rows of length d, n_groups per row
 * of length d each (per-head norm: rows of H*Dh with d = Dh and n_groups = H). */
htp_status htp_rms_norm(const float *x, const float *w, uint32_t t, uint32_t n_groups,
                        uint32_t d, float eps, float *out);

/* In-place rotary embedding of x[t][n_heads][head_dim] on the first n_rot dims. */
htp_status htp_rope(float *x, const int32_t *positions, uint32_t t, uint32_t n_heads,
                    uint32_t head_dim, uint32_t n_rot, float freq_base, float freq_scale,
                    uint32_t mode);

/* Causal/non-causal attention with grouped KV heads, online softmax, O(T*d) memory.
 * q[t][hq][dk], k[t][hkv][dk], v[t][hkv][dv], out[t][hq][dv]. */
htp_status htp_attention(const float *q, const float *k, const float *v, uint32_t t,
                         uint32_t n_q_heads, uint32_t n_kv_heads, uint32_t dk, uint32_t dv,
                         float scale, uint32_t causal, float *out);

htp_status htp_silu(const float *x, uint64_t n, float *out);
htp_status htp_swiglu(const float *g, const float *u, uint64_t n, float *out);

/* Router: ids/weights [t][k]. bias may be NULL. */
htp_status htp_router_topk(const float *logits, uint32_t t, uint32_t n_experts, uint32_t k,
                           uint32_t gating, uint32_t norm, float scale, const float *bias,
                           int32_t *ids, float *weights);

/* ---- fused routed-expert op ---- */
htp_status htp_expert_graph_init(const htp_expert_graph_desc *desc, htp_expert_graph **out);
void htp_expert_graph_free(htp_expert_graph *graph);
/* y[tokens[r]] += weights[r] * down(silu(gate(x)) * up(x)) for every route r. */
htp_status htp_expert_graph_run(htp_expert_graph *graph, const htp_expert_run_desc *desc,
                                const float *x, const int32_t *tokens, const int32_t *experts,
                                const float *weights, const int32_t *slot_of_expert, float *y);

/* ---- diagnostics ---- */
/* Throughput of the int8 dot-product instruction of the current SIMD level on all pool
 * threads: returns multiply-accumulates per second in *macs_per_s. */
htp_status htp_bench_dot_peak(uint64_t iters, double *macs_per_s);

#ifdef __cplusplus
}
#endif

#endif /* ESTREAM_HTP_H */
