"""Errors of the engine and the command. Each names what is wrong and what to do about it."""

from __future__ import annotations

__all__ = [
    "BadRequestError",
    "BudgetTooSmallError",
    "EStreamError",
    "EngineClosedError",
    "InsufficientMemoryError",
    "NonFiniteError",
    "PackError",
    "StaleProfileError",
    "UnsupportedModelError",
    "json_kind",
]


class EStreamError(Exception):
    """Base class: the command prints the message and exits non-zero."""

    exit_code = 1


class PackError(EStreamError):
    """The packed model is missing, incomplete or corrupt."""


class StaleProfileError(PackError):
    """The pack's stored profile was measured with other kernels, CPU, threads or expert
    formats than the ones this run has (or does not say what it was measured with)."""


class EngineClosedError(EStreamError, RuntimeError):
    """A request to an engine after its `close` (or while it closes, from another thread)."""


class UnsupportedModelError(EStreamError):
    """The model's architecture has no engine graph."""


class NonFiniteError(EStreamError):
    """A forward pass produced NaN or infinite activations (corrupt weights or overflow)."""


class InsufficientMemoryError(EStreamError):
    """What the chosen mode must hold in memory cannot be allocated."""


class BadRequestError(EStreamError):
    """Tokens out of vocabulary, prompt longer than the context, bad option values."""

    exit_code = 2


class BudgetTooSmallError(EStreamError):
    """The memory budget is below the smallest feasible configuration."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


def json_kind(value: object) -> str:
    """What a JSON value is, in JSON's words (for messages about input files): ``null``,
    ``true/false``, ``an integer``, ``a number``, ``a string``, ``a list``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a value of another kind"
