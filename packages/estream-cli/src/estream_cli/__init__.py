"""EStream engine and command: streamed prefill-only MoE inference.

The public Python API is re-exported by the `estream` module: `estream.load(path, ...)`.
"""

from __future__ import annotations

from .engine import (
    MODES,
    BranchRequest,
    BranchResult,
    Engine,
    PrefillResult,
    StreamConfig,
    load,
)
from .errors import (
    BadRequestError,
    BudgetTooSmallError,
    EStreamError,
    InsufficientMemoryError,
    NonFiniteError,
    PackError,
    UnsupportedModelError,
)

__all__ = [
    "MODES",
    "BadRequestError",
    "BranchRequest",
    "BranchResult",
    "BudgetTooSmallError",
    "EStreamError",
    "Engine",
    "InsufficientMemoryError",
    "NonFiniteError",
    "PackError",
    "PrefillResult",
    "StreamConfig",
    "UnsupportedModelError",
    "load",
]
__version__ = "0.1.0"
