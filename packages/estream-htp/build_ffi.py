"""cffi build script (API / out-of-line mode): compiles csrc/ into ``estream_htp._ffi``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"

_spec = importlib.util.spec_from_file_location(
    "_htp_buildcfg", HERE / "src/estream_htp/_buildcfg.py"
)
assert _spec and _spec.loader
_cfg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cfg)

CDEF = """
typedef enum htp_status { HTP_OK, HTP_E_INVALID, HTP_E_NOMEM, HTP_E_UNSUPPORTED,
    HTP_E_NOT_RESIDENT, HTP_E_CAPACITY, ... } htp_status;
typedef enum htp_format { HTP_FMT_Q4_0_T32R4, HTP_FMT_Q8_0_T32R4, HTP_FMT_F16, HTP_FMT_F32, ...
    } htp_format;
typedef enum htp_simd { HTP_SIMD_PORTABLE, HTP_SIMD_AVX2, HTP_SIMD_AVX512, HTP_SIMD_AVX512VNNI,
    HTP_SIMD_NEON, ... } htp_simd;
typedef enum htp_act { HTP_ACT_F32, HTP_ACT_Q8, ... } htp_act;
typedef enum htp_rope_mode { HTP_ROPE_NORMAL, HTP_ROPE_NEOX, ... } htp_rope_mode;
typedef enum htp_gating { HTP_GATING_SOFTMAX, HTP_GATING_SIGMOID, ... } htp_gating;
#define HTP_ABI_VERSION ...

typedef struct htp_matrix_desc {
    uint32_t format; uint32_t n; uint32_t k; uint32_t reserved; uint64_t nbytes;
} htp_matrix_desc;
typedef struct htp_expert_graph_desc {
    uint32_t d_model; uint32_t d_ff; uint32_t capacity; uint32_t t_max;
} htp_expert_graph_desc;
typedef struct htp_expert_run_desc {
    uint64_t plane_base[3]; uint64_t slot_stride[3];
    uint32_t n_tokens; uint32_t n_routes; uint32_t n_experts; uint32_t format;
} htp_expert_run_desc;
typedef struct htp_expert_graph htp_expert_graph;

uint32_t htp_abi_version(void);
htp_status htp_set_num_threads(uint32_t n);
uint32_t htp_get_num_threads(void);
uint32_t htp_simd_best(void);
uint32_t htp_simd_get(void);
htp_status htp_simd_set(uint32_t level);
htp_status htp_act_set(uint32_t act);
uint32_t htp_act_get(void);
htp_status htp_gemm(const htp_matrix_desc *w_desc, const void *w, const float *x, uint32_t t,
                    uint32_t ldx, float *y, uint32_t ldy);
htp_status htp_get_rows(const void *table, uint32_t format, uint64_t nbytes, uint32_t n_rows,
                        uint32_t n_cols, const int32_t *ids, uint32_t t, float *out);
htp_status htp_rms_norm(const float *x, const float *w, uint32_t t, uint32_t n_groups,
                        uint32_t d, float eps, float *out);
htp_status htp_rope(float *x, const int32_t *positions, uint32_t t, uint32_t n_heads,
                    uint32_t head_dim, uint32_t n_rot, float freq_base, float freq_scale,
                    uint32_t mode);
htp_status htp_attention(const float *q, const float *k, const float *v, uint32_t t,
                         uint32_t n_q_heads, uint32_t n_kv_heads, uint32_t dk, uint32_t dv,
                         float scale, uint32_t causal, float *out);
htp_status htp_silu(const float *x, uint64_t n, float *out);
htp_status htp_swiglu(const float *g, const float *u, uint64_t n, float *out);
htp_status htp_router_topk(const float *logits, uint32_t t, uint32_t n_experts, uint32_t k,
                           uint32_t gating, uint32_t norm, float scale, const float *bias,
                           int32_t *ids, float *weights);
htp_status htp_expert_graph_init(const htp_expert_graph_desc *desc, htp_expert_graph **out);
void htp_expert_graph_free(htp_expert_graph *graph);
htp_status htp_expert_graph_run(htp_expert_graph *graph, const htp_expert_run_desc *desc,
                                const float *x, const int32_t *tokens, const int32_t *experts,
                                const float *weights, const int32_t *slot_of_expert, float *y);
htp_status htp_bench_dot_peak(uint64_t iters, double *macs_per_s);
"""

SOURCES = [
    "htp_pool.c",
    "htp_core.c",
    "htp_attention.c",
    "htp_expert.c",
    "htp_x86.c",
    "htp_attn_avx512.c",
    "htp_neon.c",
]

cflags, ldflags = _cfg.compile_flags(os.environ)

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "estream_htp._ffi",
    '#include "htp.h"',
    # setuptools wants paths relative to setup.py (the build runs from there)
    sources=[os.path.relpath(CSRC / s) for s in SOURCES],
    include_dirs=[os.path.relpath(CSRC)],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
