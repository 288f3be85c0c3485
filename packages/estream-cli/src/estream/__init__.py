"""EStream: `estream.load(path, budget=...)` then `engine.prefill(tokens)`."""

from __future__ import annotations

from estream_cli import (
    MODES,
    BadRequestError,
    BudgetTooSmallError,
    Engine,
    EStreamError,
    NonFiniteError,
    PackError,
    PrefillResult,
    UnsupportedModelError,
    load,
)

__all__ = [
    "MODES",
    "BadRequestError",
    "BudgetTooSmallError",
    "EStreamError",
    "Engine",
    "NonFiniteError",
    "PackError",
    "PrefillResult",
    "UnsupportedModelError",
    "load",
]
