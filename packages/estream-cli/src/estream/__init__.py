"""EStream: `estream.load(path, budget=...)` then `engine.prefill(tokens)`."""

from __future__ import annotations

from estream_cli import (
    MODES,
    BadRequestError,
    BranchRequest,
    BranchResult,
    BudgetTooSmallError,
    Engine,
    EStreamError,
    InsufficientMemoryError,
    NonFiniteError,
    PackError,
    PrefillResult,
    UnsupportedModelError,
    load,
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
    "UnsupportedModelError",
    "load",
]
