"""estream-htp: the EStream kernel library (C behind a small stable ABI, wrapped with cffi).

Ops (on a `Backend`: "host" in-process or "host-process" in an executor process): tile-major Q4_0/Q8_0 GEMM, the fused routed-expert op, RMSNorm, RoPE, attention, SiLU /
SwiGLU, router top-k, embedding rows. See README.md for accuracy and performance figures.
"""

from __future__ import annotations

from estream_htp._backend import BACKENDS, SIMD_LEVELS, best_simd_level
from estream_htp._core import (
    Backend,
    CapacityError,
    ExecutorDiedError,
    ExpertGraph,
    ExpertNotResidentError,
    Fence,
    HTPDescriptorError,
    HTPError,
    HTPInputError,
    HTPTimeoutError,
    HTPUnsupportedError,
    _init_from_env,
    attention,
    default_backend,
    gemm,
    get_activation_format,
    get_num_threads,
    get_rows,
    moe_ffn,
    nop,
    rms_norm,
    rms_norm_heads,
    rope,
    router_topk,
    set_activation_format,
    set_num_threads,
    silu,
    simd_level,
    simd_supported,
    swiglu,
)
from estream_htp._formats import (
    FormatError,
    dequantize_tiles,
    matrix_nbytes,
    pack_q4_0_t32r4,
    pack_q8_0_t32r4,
    unpack_q4_0_t32r4,
    unpack_q8_0_t32r4,
)

__all__ = [
    "BACKENDS",
    "SIMD_LEVELS",
    "Backend",
    "CapacityError",
    "ExecutorDiedError",
    "ExpertGraph",
    "ExpertNotResidentError",
    "Fence",
    "FormatError",
    "HTPDescriptorError",
    "HTPError",
    "HTPInputError",
    "HTPTimeoutError",
    "HTPUnsupportedError",
    "attention",
    "best_simd_level",
    "default_backend",
    "dequantize_tiles",
    "gemm",
    "get_activation_format",
    "get_num_threads",
    "get_rows",
    "matrix_nbytes",
    "moe_ffn",
    "nop",
    "pack_q4_0_t32r4",
    "pack_q8_0_t32r4",
    "rms_norm",
    "rms_norm_heads",
    "rope",
    "router_topk",
    "set_activation_format",
    "set_num_threads",
    "silu",
    "simd_level",
    "simd_supported",
    "swiglu",
    "unpack_q4_0_t32r4",
    "unpack_q8_0_t32r4",
]

_init_from_env()
