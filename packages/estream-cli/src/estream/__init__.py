"""EStream: streamed prefill-only MoE inference, as a library.

`estream.load(path, budget=...)` then `engine.prefill(tokens)`. The engine, the architectures'
forward passes (`estream.models`), the expert sources, the tokenizer (`estream.tokenizer`), tasks
and evaluation live here; the `estream` command is the separate `estream_cli` package, which
imports this one and is never imported by it.
"""

from __future__ import annotations

from .engine import (
    MODES,
    BranchRequest,
    BranchResult,
    Engine,
    EngineOptions,
    PrefillResult,
    StreamConfig,
    load,
)
from .errors import (
    BadRequestError,
    BudgetTooSmallError,
    EngineClosedError,
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
    "EngineClosedError",
    "EngineOptions",
    "InsufficientMemoryError",
    "NonFiniteError",
    "PackError",
    "PrefillResult",
    "StreamConfig",
    "UnsupportedModelError",
    "load",
]
__version__ = "0.1.0"
