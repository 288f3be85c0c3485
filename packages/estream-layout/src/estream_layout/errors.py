"""Exception hierarchy: every failure a user can cause has its own class and an actionable message."""

from __future__ import annotations

__all__ = [
    "ChecksumError",
    "DenseModelError",
    "InsufficientDiskSpaceError",
    "InvalidArgumentError",
    "InvalidGGUFError",
    "InvalidMetadataError",
    "LayoutError",
    "NonFiniteWeightsError",
    "NotGGUFError",
    "PackExistsError",
    "PackFormatError",
    "PackTargetError",
    "ProfileError",
    "TruncatedGGUFError",
    "UnalignedReductionError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "VerifyStoppedError",
]


class LayoutError(Exception):
    """Base class of every error raised by estream-layout."""


class InvalidGGUFError(LayoutError):
    """The file cannot be read as a GGUF model."""


class NotGGUFError(InvalidGGUFError):
    """The file does not start with the GGUF magic."""


class TruncatedGGUFError(InvalidGGUFError):
    """The file is shorter than its own header says (an interrupted download or copy)."""


class UnsupportedArchitectureError(LayoutError):
    """`general.architecture` is not one that estream-layout knows how to lay out."""


class DenseModelError(LayoutError):
    """The model has no expert tensors: there is nothing to stream."""


class UnalignedReductionError(LayoutError):
    """A matrix that must be tiled has a reduction (input) dimension that is not a multiple of 32."""


class UnsupportedTensorTypeError(LayoutError):
    """A tensor type that gguf cannot dequantize, so it cannot be converted."""


class InsufficientDiskSpaceError(LayoutError):
    """The target filesystem has less free space than the file(s) about to be written need.

    Raised before anything is written, so a 26 GB model never dies at 90% with ENOSPC.
    """

    def __init__(self, message: str, *, needed: int, free: int, path: str) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.path = path


class PackExistsError(LayoutError):
    """The target NAME.estream already exists and overwriting was not requested."""


class PackFormatError(LayoutError):
    """A packed model directory is missing files or its manifest is malformed."""


class ChecksumError(PackFormatError):
    """A stored checksum does not match the bytes on disk."""


class VerifyStoppedError(LayoutError):
    """A pack check was stopped by its caller before it read every byte: nothing concluded."""


class ProfileError(LayoutError):
    """A routing-profile JSON file does not have the documented shape."""


class PackTargetError(LayoutError):
    """The output path is not something estream-pack may replace (a user's folder or file, the
    source model, a symbolic link), or it changed while packing."""


class NonFiniteWeightsError(LayoutError):
    """The source model has NaN or infinite weights: it is corrupt and must not be packed."""


class InvalidMetadataError(InvalidGGUFError):
    """A GGUF metadata value is missing, of the wrong type or nonsensical (named in the message)."""


class InvalidArgumentError(LayoutError, ValueError):
    """An argument of a call or a command (a seed, a vocabulary file, ...) is out of range or of
    the wrong kind (named in the message)."""
