"""estream-layout: read GGUF MoE models and pack them into EStream's streamable layout."""

from __future__ import annotations

from . import _sigint  # noqa: F401  (first: a Ctrl-C during the imports below is one line)
from .checks import check_pack
from .diskspace import check_disk_space
from .errors import (
    ChecksumError,
    DenseModelError,
    InsufficientDiskSpaceError,
    InvalidArgumentError,
    InvalidGGUFError,
    InvalidMetadataError,
    LayoutError,
    NonFiniteWeightsError,
    NotGGUFError,
    PackExistsError,
    PackFormatError,
    PackTargetError,
    ProfileError,
    TruncatedGGUFError,
    UnalignedReductionError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    VerifyStoppedError,
)
from .gguf_model import (
    EXPERT_PROJECTIONS,
    ModelSpec,
    TensorInfo,
    TensorReader,
    dequantize_tensor,
    tensor_memmap,
)
from .manifest import (
    DenseEntry,
    LayerEntry,
    Manifest,
    ProjectionEntry,
    manifest_lock,
    update_manifest,
)
from .pack import (
    dense_format,
    load_routing_profile,
    pack_model,
    planned_pack_bytes,
    storage_order,
)
from .synth import ARCHES, PRESET_ARCH, PRESETS, SynthDims, synth_dims, synth_model
from .tiles import (
    dequantize_blocks,
    dequantize_tiles,
    pack_tiles,
    quantize_q4_0,
    quantize_q8_0,
    tile_nbytes,
    unpack_tiles,
)
from .verify import VerifyReport, inspect_pack, verify_checksums, verify_pack

__version__ = "0.1.0"

__all__ = [
    "ARCHES",
    "EXPERT_PROJECTIONS",
    "PRESETS",
    "PRESET_ARCH",
    "ChecksumError",
    "DenseEntry",
    "DenseModelError",
    "InsufficientDiskSpaceError",
    "InvalidArgumentError",
    "InvalidGGUFError",
    "InvalidMetadataError",
    "LayerEntry",
    "LayoutError",
    "Manifest",
    "ModelSpec",
    "NonFiniteWeightsError",
    "NotGGUFError",
    "PackExistsError",
    "PackFormatError",
    "PackTargetError",
    "ProfileError",
    "ProjectionEntry",
    "SynthDims",
    "TensorInfo",
    "TensorReader",
    "TruncatedGGUFError",
    "UnalignedReductionError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "VerifyReport",
    "VerifyStoppedError",
    "__version__",
    "check_disk_space",
    "check_pack",
    "dense_format",
    "dequantize_blocks",
    "dequantize_tensor",
    "dequantize_tiles",
    "inspect_pack",
    "load_routing_profile",
    "manifest_lock",
    "pack_model",
    "pack_tiles",
    "planned_pack_bytes",
    "quantize_q4_0",
    "quantize_q8_0",
    "storage_order",
    "synth_dims",
    "synth_model",
    "tensor_memmap",
    "tile_nbytes",
    "unpack_tiles",
    "update_manifest",
    "verify_checksums",
    "verify_pack",
]
