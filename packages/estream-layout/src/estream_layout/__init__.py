"""estream-layout: read GGUF MoE models and pack them into EStream's streamable layout."""

from __future__ import annotations

from .errors import (
    ChecksumError,
    DenseModelError,
    InvalidGGUFError,
    LayoutError,
    NotGGUFError,
    PackExistsError,
    PackFormatError,
    ProfileError,
    TruncatedGGUFError,
    UnalignedReductionError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from .gguf_model import (
    EXPERT_PROJECTIONS,
    ModelSpec,
    TensorInfo,
    TensorReader,
    dequantize_tensor,
    tensor_memmap,
)
from .synth import ARCHES, PRESETS, synth_model
from .tiles import (
    dequantize_blocks,
    dequantize_tiles,
    pack_tiles,
    quantize_q4_0,
    quantize_q8_0,
    tile_nbytes,
    unpack_tiles,
)

__version__ = "0.1.0"

__all__ = [
    "ARCHES",
    "EXPERT_PROJECTIONS",
    "PRESETS",
    "ChecksumError",
    "DenseModelError",
    "InvalidGGUFError",
    "LayoutError",
    "ModelSpec",
    "NotGGUFError",
    "PackExistsError",
    "PackFormatError",
    "ProfileError",
    "TensorInfo",
    "TensorReader",
    "TruncatedGGUFError",
    "UnalignedReductionError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "__version__",
    "dequantize_blocks",
    "dequantize_tensor",
    "dequantize_tiles",
    "pack_tiles",
    "quantize_q4_0",
    "quantize_q8_0",
    "synth_model",
    "tensor_memmap",
    "tile_nbytes",
    "unpack_tiles",
]
