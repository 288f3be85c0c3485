/* estream-htp: the kernel library's stable C ABI, version 2.
 *
 * The shape of this header is that of a library driven across a processor boundary (a host CPU
 * submitting to a DSP that shares DRAM): nothing in a descriptor is a pointer of the submitting
 * process. Memory is registered with a backend as buffers (a file descriptor and a size, e.g. the
 * arena's memfd planes, the dense weights, activation buffers) and operands are referenced as
 * (buffer id, byte offset); the executing side checks every reference against the registered
 * size before touching it. Each op is one flat request (`htp_op_desc`). All state lives in a
 * backend object: the library has no mutable globals.
 *
 * Rules: fixed-width integers only, flat structs with explicit padding and a static size check,
 * a status code for every failure, init/free pairs, nothing ISA-specific.
 *
 * build_ffi.py generates the cffi declarations from this file: keep it to declarations cffi's
 * parser understands (no macros other than integer #defines; preprocessor lines and
 * _Static_assert are dropped by the generator).
 */
#ifndef ESTREAM_HTP_H
#define ESTREAM_HTP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HTP_ABI_VERSION 4
#define HTP_MAX_REFS 10
#define HTP_QUEUE_DEPTH 64
#define HTP_TMP_BUFFER 2147483648

typedef enum htp_status {
    HTP_OK = 0,
    HTP_E_INVALID = 1,      /* bad argument (shape, size, format, index out of range) */
    HTP_E_NOMEM = 2,        /* allocation failed */
    HTP_E_UNSUPPORTED = 3,  /* SIMD level, format, backend kind or opcode not available */
    HTP_E_NOT_RESIDENT = 4, /* a route names an expert whose slot is -1 */
    HTP_E_CAPACITY = 5,     /* more tokens than allowed, or too many fences outstanding */
    HTP_E_BAD_BUFFER = 6,   /* a reference names a buffer id that is not registered */
    HTP_E_BOUNDS = 7,       /* a reference reaches past the end of its registered buffer */
    HTP_E_READONLY = 8,     /* an op would write into a buffer registered read-only */
    HTP_E_BAD_OP = 9,       /* malformed descriptor: unknown opcode, wrong ref count, flags */
    HTP_E_MAP = 10,         /* mapping a registered file descriptor failed */
    HTP_E_DEAD = 11,        /* the executor process is gone (killed, crashed or exited) */
    HTP_E_TIMEOUT = 12,     /* a fence did not complete within the time asked */
    HTP_E_FENCE = 13,       /* unknown fence, or its completion was already consumed */
    HTP_E_PROTOCOL = 14     /* the executor answered something unexpected */
} htp_status;

typedef enum htp_format {
    HTP_FMT_Q4_0_T32R4 = 1, /* 576-byte 32x32 tiles, see docs/contracts.md section 1 */
    HTP_FMT_Q8_0_T32R4 = 2, /* 1088-byte 32x32 tiles */
    HTP_FMT_F16 = 3,        /* row-major IEEE half */
    HTP_FMT_F32 = 4,        /* row-major float */
    HTP_FMT_Q4_K_T32R4 = 5, /* 704-byte 32x32 tiles of GGML Q4_K sub-blocks (docs/format.md) */
    HTP_FMT_Q6_K_T32R4 = 6, /* 1152-byte 32x32 tiles of GGML Q6_K sub-blocks */
    HTP_FMT_MXFP4_T32R4 = 7, /* 544-byte 32x32 tiles of GGML MXFP4 blocks (E8M0 + FP4 E2M1) */
    HTP_FMT_Q5_K_T32R4 = 8,  /* 832-byte 32x32 tiles of GGML Q5_K sub-blocks */
    HTP_FMT_IQ4_NL_T32R4 = 9, /* 576-byte 32x32 tiles of GGML IQ4_NL blocks (Q4_0's layout) */
    HTP_FMT_Q4_1_T32R4 = 10,  /* 640-byte 32x32 tiles of GGML Q4_1 blocks */
    HTP_FMT_Q5_0_T32R4 = 11,  /* 704-byte 32x32 tiles of GGML Q5_0 blocks */
    HTP_FMT_Q5_1_T32R4 = 12,  /* 768-byte 32x32 tiles of GGML Q5_1 blocks */
    HTP_FMT_IQ4_XS_T32R4 = 13, /* 608-byte 32x32 tiles of GGML IQ4_XS sub-blocks */
    HTP_FMT_F16_T32R4 = 14,    /* 2048-byte 32x32 tiles of IEEE half values (dense GEMM, rows) */
    HTP_FMT_BF16_T32R4 = 15    /* 2048-byte 32x32 tiles of bfloat16 values (dense GEMM, rows) */
} htp_format;

typedef enum htp_simd {
    HTP_SIMD_PORTABLE = 0,
    HTP_SIMD_AVX2 = 1,
    HTP_SIMD_AVX512 = 2,
    HTP_SIMD_AVX512VNNI = 3,
    HTP_SIMD_NEON = 4,
    HTP_SIMD_HVX = 5, /* Hexagon HVX (128-byte vectors): only in the Hexagon executor */
    HTP_SIMD_AMX = 6, /* AVX-512 VNNI with Intel AMX int8 tiles for the Q4_0 x Q8 products */
    HTP_SIMD_BEST = 255 /* in htp_backend_desc: the best level this CPU and build support */
} htp_simd;

/* How activations meet the quantized weights in GEMMs and the expert op (per call).
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

/* How the attention op multiplies (htp_attention_params.products).
 * F32: fp32 products and sums (matches a float64 reference to ~1e-6).
 * BF16: q*scale, k, v and the softmax weights are rounded to bfloat16 (nearest even, subnormals
 *       to zero), products accumulate in fp32 (vdpbf16ps where the CPU has AVX512_BF16,
 *       BFMLALT / BFMLALB on arm64 with FEAT_BF16, the same bits; the same rounding emulated
 *       elsewhere); rel. L2 error ~3e-3.
 * BF16_PV: the scores q*scale . k in fp32, as F32; the softmax weights and v rounded to
 *       bfloat16 for P.V (vdpbf16ps where the CPU has AVX512_BF16, the same rounding emulated
 *       elsewhere). Rounding q and k is what moves a score, and a score error scales its
 *       weight; rounding P and v averages out over the keys: rel. L2 error ~2e-3, half the
 *       products at the bf16 rate. */
typedef enum htp_products {
    HTP_PRODUCTS_F32 = 0,
    HTP_PRODUCTS_BF16 = 1,
    HTP_PRODUCTS_BF16_PV = 2
} htp_products;

typedef enum htp_gating {
    HTP_GATING_SOFTMAX = 0,
    HTP_GATING_SIGMOID = 1
} htp_gating;

typedef enum htp_backend_kind {
    HTP_BACKEND_HOST = 0,   /* ops run in this process, on the calling thread + a pool */
    HTP_BACKEND_REMOTE = 1  /* ops run in an executor process reached through `sock_fd` */
} htp_backend_kind;

typedef enum htp_buffer_flags {
    HTP_BUF_READ = 1,
    HTP_BUF_WRITE = 2
} htp_buffer_flags;

typedef enum htp_opcode {
    HTP_OP_NOP = 0,        /* no operands: measures the submission round trip */
    HTP_OP_GEMM = 1,       /* ref: w, x, y [, w_b, y_b [, w_c, y_c]] (see htp_gemm_params) */
    HTP_OP_EXPERT = 2,     /* ref: x, tokens, experts, weights, slot_of_expert, gate, up, down, y */
    HTP_OP_GET_ROWS = 3,   /* ref: table, ids, out */
    HTP_OP_RMS_NORM = 4,   /* ref: x, w (if has_weight), out */
    HTP_OP_ROPE = 5,       /* ref: x (in place), positions */
    HTP_OP_ATTENTION = 6,  /* ref: q, k, v, sinks (if has_sinks), out */
    HTP_OP_SILU = 7,       /* ref: x, out (out is x, or apart from it) */
    HTP_OP_SWIGLU = 8,     /* ref: g, u, out (out is g or u, or apart from both) */
    HTP_OP_ROUTER_TOPK = 9, /* ref: logits, bias (if has_bias), ids, weights */
    HTP_OP_CONV1D = 10,     /* ref: x, w, state (if has_state), out */
    HTP_OP_MATMUL_F32 = 11, /* ref: x, w, y */
    HTP_OP_ADD = 12,        /* ref: a, b, out (htp_binary_params) */
    HTP_OP_MUL = 13,        /* ref: a, b, out (htp_binary_params) */
    HTP_OP_COPY_ROWS = 14,  /* ref: src, dst */
    HTP_OP_FILL = 15,       /* ref: out */
    HTP_OP_QUANTIZE = 16    /* ref: x, out (htp_quantize_params): Q8 rows, see below */
} htp_opcode;

/* ---- backend and buffers ---- */
typedef struct htp_backend_desc {
    uint32_t abi_version; /* HTP_ABI_VERSION: a mismatch is HTP_E_UNSUPPORTED */
    uint32_t kind;        /* htp_backend_kind */
    uint32_t n_threads;   /* pool size (caller + n-1 workers); 0 = 1 */
    uint32_t simd;        /* htp_simd level, or HTP_SIMD_BEST */
    int32_t sock_fd;      /* REMOTE: connected SOCK_SEQPACKET to the executor (owned after init) */
    uint32_t timeout_ms;  /* REMOTE: bound on the executor's answer to a control request */
    uint32_t reserved[2];
} htp_backend_desc;

typedef struct htp_backend htp_backend;

/* A region of memory made visible to a backend. With fd >= 0 the backend maps
 * [offset, offset+size) of the file itself (MAP_SHARED): this is the only form a REMOTE backend
 * accepts (the fd is passed to the executor). A HOST backend also accepts fd = -1 with the
 * region's address in this process in host_addr. */
typedef struct htp_buffer_desc {
    int32_t fd;
    uint32_t flags;     /* htp_buffer_flags */
    uint64_t offset;    /* in the file, page-aligned */
    uint64_t size;      /* bytes; every reference is checked against it */
    uint64_t host_addr; /* HOST backend, fd = -1 only */
} htp_buffer_desc;

/* An operand: a byte offset into a registered buffer. */
typedef struct htp_ref {
    uint32_t buffer; /* id from htp_buffer_register (0 is never a valid id) */
    uint32_t reserved;
    uint64_t offset;
} htp_ref;

/* ---- per-op parameters (one member of htp_op_params per opcode) ---- */
/* y[t][ldy] (first n) = x[t][ldx] (first k) . W^T. With n_more = 1 or 2 (appended fields: 0
 * is the original one-matrix op) the same x also multiplies W_b [n_b][k] (and W_c [n_c][k]),
 * same format, into y_b [t][n_b] (and y_c [t][n_c]): q/k/v or gate/up projections of one
 * input, which is quantized once. Every output is bit-identical to a one-matrix GEMM. */
typedef struct htp_gemm_params {
    uint32_t format; /* HTP_FMT_Q4_0_T32R4, _Q8_0_, _Q4_K_, _Q5_K_, _Q6_K_ or _MXFP4_T32R4 */
    uint32_t n, k, t, ldx, ldy;
    uint32_t n_more; /* 0, 1 or 2 further matrices */
    uint32_t n_b, n_c;
    uint32_t x_q8; /* appended (0: x is fp32 [t][ldx]); 1: x is t Q8 rows of k values
                      (HTP_OP_QUANTIZE's output; act Q8, ldx = k): an input quantized once */
} htp_gemm_params;

typedef struct htp_expert_params {
    uint32_t d_model, d_ff; /* multiples of 32 */
    uint32_t n_tokens;      /* T: rows of x and y */
    uint32_t n_routes;      /* R: entries of tokens/experts/weights */
    uint32_t n_experts;     /* E: entries of slot_of_expert */
    uint32_t capacity;      /* routes per internal pass (larger route sets are split) */
    uint32_t format;        /* the gate projection's tile format (HTP_FMT_Q4_0_T32R4, _Q8_0_,
                               _Q4_K_, _Q5_K_, _Q6_K_ or _MXFP4_T32R4); also up's and down's where 0
                               below */
    uint32_t x_q8;          /* 0: x is [T][d_model] fp32; 1: x is T Q8 rows (HTP_OP_QUANTIZE's
                               output, act must be Q8): several ops on one input share them */
    uint64_t slot_stride[3]; /* gate, up, down: bytes between consecutive slots of a plane */
    uint32_t format_up;      /* appended (was reserved, 0): up's tile format, 0 = `format` */
    uint32_t format_down;    /* down's tile format, 0 = `format` (a file may mix the types of
                                an expert's projections, e.g. Q4_K_M's Q6_K ffn_down) */
    /* Appended (ABI 3; zeros are the original SwiGLU op without biases). */
    uint32_t glu;        /* htp_glu: the gated activation of gate g and up u */
    float glu_alpha;     /* HTP_GLU_SWIGLU_OAI: the sigmoid's scale (> 0); else 0 */
    float glu_limit;     /* HTP_GLU_SWIGLU_OAI: the clamp (> 0); else 0 */
    uint32_t has_bias;   /* 1: a tenth reference holds f32 biases indexed by expert id: gate
                            [E][d_ff] at its offset, up [E][d_ff] bias_up bytes and down
                            [E][d_model] bias_down bytes further (multiples of 4); g, u get
                            their expert's row before the activation, down's output before
                            the weighting. 0: no biases, both offsets 0 */
    uint64_t bias_up, bias_down;
} htp_expert_params;

/* The expert op's gated activation h = act(g, u) (g, u after their biases, if any):
 * SWIGLU: silu(g) * u; REGLU: max(g, 0) * u; SWIGLU_OAI (gpt-oss): with g' = min(g, limit) and
 * u' = clamp(u, -limit, limit), g' * sigmoid(alpha * g') * (u' + 1). */
typedef enum htp_glu {
    HTP_GLU_SWIGLU = 0,
    HTP_GLU_REGLU = 1,
    HTP_GLU_SWIGLU_OAI = 2
} htp_glu;

typedef struct htp_get_rows_params {
    uint32_t format, n_rows, n_cols, t;
} htp_get_rows_params;

typedef struct htp_rms_norm_params { /* rows of n_groups groups of d; w may be absent */
    uint32_t t, n_groups, d, has_weight;
    float eps;
} htp_rms_norm_params;

/* RoPE, llama.cpp's ggml_rope_ext semantics. `yarn` = 0 (what a caller unaware of the YaRN
 * fields leaves): plain rotation by pos * freq_scale * freq_base^(-2j/n_rot). `yarn` = 1: YaRN
 * (ggml's rope_yarn): the scaled and unscaled angles of pair j are mixed by
 * ramp(j) * ext_factor, ramp(j) = 1 - clamp((j - corr_low) / max(0.001, corr_high - corr_low),
 * 0, 1), and cos/sin are multiplied by attn_factor, times (1 + 0.1 ln(1/freq_scale)) when
 * ext_factor != 0. Appended fields: the descriptor stays within htp_op_params' 96 bytes. */
typedef struct htp_rope_params {
    uint32_t t, n_heads, head_dim, n_rot, mode;
    float freq_base, freq_scale;
    uint32_t yarn;
    float ext_factor, attn_factor, corr_low, corr_high;
} htp_rope_params;

/* t query rows attend to n_ctx + t key/value rows: query i sits at key position n_ctx + i, so
 * causal attention lets it see keys 0 .. n_ctx + i (all the context, then its own segment up
 * to itself: a branch continuing a prefix); n_ctx = 0 is plain self-attention over t rows.
 * window > 0 (causal only) narrows that to the window keys n_ctx + i - window < j <= n_ctx + i
 * (sliding-window attention). has_sinks: a reference before out holds one float per query
 * head, a learned logit that joins each row's softmax denominator (exp(sink - max)) but adds
 * no value. */
typedef struct htp_attention_params {
    uint32_t t, n_q_heads, n_kv_heads, dk, dv, causal;
    float scale;
    uint32_t products;  /* htp_products (appended: 0 is the original fp32 behaviour) */
    uint32_t n_ctx;     /* appended: key rows before the first query's own row */
    uint32_t window;    /* appended: 0 = every earlier key; else keys within window of the query */
    uint32_t has_sinks; /* appended: 0 = no sinks (four references) */
} htp_attention_params;

typedef struct htp_eltwise_params {
    uint64_t n;
    uint32_t glu;       /* appended: HTP_OP_SWIGLU's activation, HTP_GLU_SWIGLU (0) or
                           HTP_GLU_SWIGLU_OAI; 0 for HTP_OP_SILU */
    float alpha, limit; /* appended: HTP_GLU_SWIGLU_OAI's (finite, > 0), else 0 */
} htp_eltwise_params;

typedef struct htp_router_params {
    uint32_t t, n_experts, k, gating, norm, has_bias;
    float scale;
} htp_router_params;

/* Causal depthwise convolution along the token axis (LFM2's short convolution, ggml_ssm_conv):
 * out[t][c] = sum_j w[c][j] * s[t + j][c], s = the taps-1 rows of `state` (zeros if absent)
 * followed by x[T][C]; tap taps-1 weighs the current token. w is [C][taps]. */
typedef struct htp_conv1d_params {
    uint32_t t, channels, taps, has_state;
} htp_conv1d_params;

/* y[t][n] = x[t][k] . w[k][n], all fp32 row-major (the router's logits, f32 projections):
 * each output summed over k in order, in fp32. */
typedef struct htp_matmul_params {
    uint32_t t, k, n;
} htp_matmul_params;

/* fp32 element-wise add / multiply over rows with their own strides (views of wider rows):
 * out[r * ldo + c] = a[r * lda + c] (+|*) b[r * ldb + c], r < rows, c < cols. */
typedef struct htp_binary_params {
    uint32_t rows, cols, lda, ldb, ldo;
} htp_binary_params;

/* A strided copy of 4-byte elements: dst[r * ld_dst + c] = src[(r / rep) * ld_src + c] for
 * r < rows, c < cols (rep >= 1 repeats each source row rep times: a broadcast). Slices,
 * head re-orderings and concatenations of activations; src and dst must not overlap. */
typedef struct htp_copy_params {
    uint32_t rows, cols, ld_src, ld_dst, rep;
} htp_copy_params;

/* out[i] = value for i < n (4-byte elements; value as fp32 bits). */
typedef struct htp_fill_params {
    uint64_t n;
    uint32_t value;
    uint32_t reserved;
} htp_fill_params;

/* Q8 rows: t rows of x[t][d] (d a multiple of 32) quantized as the Q8 GEMM and expert op do
 * it (per 32-element block: int8 values, an fp32 scale, the int32 sum of the values), laid out
 * as [t][d] int8, then [t][d/32] fp32 scales, then [t][d/32] int32 sums: t * (d + d/4) bytes.
 * An expert op given them (x_q8 = 1) computes the bits it computes from the fp32 rows. */
typedef struct htp_quantize_params {
    uint32_t t, d;
} htp_quantize_params;

typedef union htp_op_params {
    htp_gemm_params gemm;
    htp_expert_params expert;
    htp_get_rows_params get_rows;
    htp_rms_norm_params rms_norm;
    htp_rope_params rope;
    htp_attention_params attention;
    htp_eltwise_params eltwise;
    htp_router_params router;
    htp_conv1d_params conv1d;
    htp_matmul_params matmul;
    htp_binary_params binary;
    htp_copy_params copy;
    htp_fill_params fill;
    htp_quantize_params quantize;
    uint8_t raw[96];
} htp_op_params;

/* One op. Unused refs and reserved fields must be zero. */
typedef struct htp_op_desc {
    uint32_t opcode; /* htp_opcode */
    uint32_t act;    /* htp_act, for GEMM and EXPERT */
    uint32_t n_refs; /* must equal the opcode's operand count */
    uint32_t flags;  /* must be 0 */
    htp_ref ref[HTP_MAX_REFS];
    htp_op_params p;
} htp_op_desc;

/* When the op of a fence ran, as CLOCK_MONOTONIC nanoseconds of this machine: submitted (by
 * this process), started and completed (by the executing side: the executor process's clock,
 * which is the same kernel clock for a process on this host, qemu-user included). */
typedef struct htp_op_times {
    uint64_t submitted_ns, started_ns, completed_ns, reserved;
} htp_op_times;

#ifdef __cplusplus
}
#endif

#if defined(__cplusplus)
static_assert(sizeof(htp_backend_desc) == 32, "htp_backend_desc ABI");
static_assert(sizeof(htp_buffer_desc) == 32, "htp_buffer_desc ABI");
static_assert(sizeof(htp_ref) == 16, "htp_ref ABI");
static_assert(sizeof(htp_expert_params) == 96, "htp_expert_params ABI");
static_assert(sizeof(htp_op_params) == 96, "htp_op_params ABI");
static_assert(sizeof(htp_rope_params) == 48, "htp_rope_params ABI");
static_assert(sizeof(htp_op_desc) == 272, "htp_op_desc ABI");
static_assert(sizeof(htp_op_times) == 32, "htp_op_times ABI");
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(htp_backend_desc) == 32, "htp_backend_desc ABI");
_Static_assert(sizeof(htp_buffer_desc) == 32, "htp_buffer_desc ABI");
_Static_assert(sizeof(htp_ref) == 16, "htp_ref ABI");
_Static_assert(sizeof(htp_expert_params) == 96, "htp_expert_params ABI");
_Static_assert(sizeof(htp_op_params) == 96, "htp_op_params ABI");
_Static_assert(sizeof(htp_op_desc) == 272, "htp_op_desc ABI");
_Static_assert(sizeof(htp_op_times) == 32, "htp_op_times ABI");
#endif

#ifdef __cplusplus
extern "C" {
#endif

uint32_t htp_abi_version(void);
uint32_t htp_simd_best(void); /* best level this CPU and build support */
/* 1 if kernel table `level` runs bf16 attention products (HTP_PRODUCTS_BF16, _BF16_PV) natively
 * on this CPU at about twice the rate of fp32 products: the AVX-512 levels and AMX on a CPU with
 * AVX512_BF16 (vdpbf16ps, two products a lane). 0 where they are emulated bit for bit (slower
 * than fp32 products), where the level is not available, and on NEON: its native FEAT_BF16
 * task (BFMLALB / BFMLALT, one product a lane, plus vdpbf16ps's flush done explicitly) gives
 * the same bits but issues ~2.9x the fp32 task's instructions. Heads with dk or dv not a
 * multiple of 16 take the emulation at any level. */
int htp_simd_native_bf16_attention(uint32_t level);

/* ---- backends ---- */
htp_status htp_backend_init(const htp_backend_desc *desc, htp_backend **out);
/* Frees the backend: a REMOTE backend asks its executor to exit and closes every fd it owns. */
void htp_backend_free(htp_backend *backend);
uint32_t htp_backend_kind_of(const htp_backend *backend);
uint32_t htp_backend_simd(const htp_backend *backend);
uint32_t htp_backend_threads(const htp_backend *backend);
/* Resize the pool / re-dispatch to another SIMD level (HOST and REMOTE). */
htp_status htp_backend_configure(htp_backend *backend, uint32_t n_threads, uint32_t simd);

htp_status htp_buffer_register(htp_backend *backend, const htp_buffer_desc *desc, uint32_t *id);
/* The caller guarantees no submitted op that references the buffer is still in flight. */
htp_status htp_buffer_unregister(htp_backend *backend, uint32_t id);

/* ---- ops ---- */
/* Queue one op; *fence names its completion. A HOST backend runs it before returning; a REMOTE
 * backend returns once the descriptor is in the executor's queue. At most HTP_QUEUE_DEPTH fences
 * may be outstanding (submitted and not yet waited for): one more is HTP_E_CAPACITY. The
 * descriptor is copied; operand memory must stay untouched until the fence completes. */
htp_status htp_op_submit(htp_backend *backend, const htp_op_desc *op, uint64_t *fence);
/* Wait up to timeout_ms (UINT32_MAX: no bound) for a fence; the op's own status goes to
 * *op_status. Each fence's completion is delivered once: waiting again is HTP_E_FENCE.
 * Returns HTP_E_TIMEOUT (fence still pending) or HTP_E_DEAD (executor gone). */
htp_status htp_fence_wait(htp_backend *backend, uint64_t fence, uint32_t timeout_ms,
                          htp_status *op_status);
/* htp_fence_wait that also returns the op's times. */
htp_status htp_fence_wait_timed(htp_backend *backend, uint64_t fence, uint32_t timeout_ms,
                                htp_status *op_status, htp_op_times *times);
/* Submit + wait: the op's status. */
htp_status htp_op_run(htp_backend *backend, const htp_op_desc *op);
/* HOST backends: run one op whose references may also name n_tmp buffers registered for this
 * call only, as ids HTP_TMP_BUFFER + i (bounds-checked like any other). An in-process caller
 * saves a register/unregister pair per operand; REMOTE backends return HTP_E_UNSUPPORTED. */
htp_status htp_op_run_tmp(htp_backend *backend, const htp_op_desc *op, const htp_buffer_desc *tmp,
                          uint32_t n_tmp);

/* ---- executor ---- */
/* The executor side of a REMOTE backend: serve the connected socket until the host closes it or
 * asks for shutdown. Returns 0 on an orderly shutdown. */
int htp_executor_serve(int sock_fd);

/* ---- diagnostics ---- */
/* Throughput of the int8 dot-product instruction of the backend's SIMD level on all its pool
 * threads: multiply-accumulates per second in *macs_per_s (HOST backends). */
htp_status htp_bench_dot_peak(htp_backend *backend, uint64_t iters, double *macs_per_s);
/* Same for another instruction: kind 0 the int8 dot product (as above), 1 the fp32 FMA, 2 the
 * bf16 dot product (vdpbf16ps; HTP_E_UNSUPPORTED without AVX512_BF16), 3 the int8 dot product
 * in the mix of the Q4_0 / Q8_0 x Q8 kernels: per 32-row block and token 16 dot products, 2
 * multiplies and 2 FMAs (the fp32 step per 32-value block, d_w*d_a then acc += dot * that),
 * int8 multiply-accumulates only counted: the rate those kernels can reach where the fp32
 * operations share the dot product's pipes (HTP_E_UNSUPPORTED but on the AVX-512 VNNI level). */
htp_status htp_bench_mac_peak(htp_backend *backend, uint32_t kind, uint64_t iters,
                              double *macs_per_s);

#ifdef __cplusplus
}
#endif

#endif /* ESTREAM_HTP_H */
