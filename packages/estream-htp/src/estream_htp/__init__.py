"""estream-htp: the EStream kernel library (C behind a small stable ABI, wrapped with cffi).

Ops: tile-major Q4_0/Q8_0 GEMM, the fused routed-expert op, RMSNorm, RoPE, attention, SiLU /
SwiGLU, router top-k, embedding rows. See README.md for accuracy and performance figures.
"""

from __future__ import annotations

from estream_htp._core import (
    SIMD_LEVELS,
    CapacityError,
    ExpertGraph,
    ExpertNotResidentError,
    HTPError,
    HTPInputError,
    HTPUnsupportedError,
    _init_from_env,
    attention,
    best_simd_level,
    gemm,
    get_activation_format,
    get_num_threads,
    get_rows,
    moe_ffn,
    rms_norm,
    rms_norm_heads,
    rope,
    router_topk,
    set_activation_format,
    set_num_threads,
    silu,
    simd_level,
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
    "SIMD_LEVELS",
    "CapacityError",
    "ExpertGraph",
    "ExpertNotResidentError",
    "FormatError",
    "HTPError",
    "HTPInputError",
    "HTPUnsupportedError",
    "attention",
    "best_simd_level",
    "dequantize_tiles",
    "gemm",
    "get_activation_format",
    "get_num_threads",
    "get_rows",
    "matrix_nbytes",
    "moe_ffn",
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
    "swiglu",
    "unpack_q4_0_t32r4",
    "unpack_q8_0_t32r4",
]

_init_from_env()
