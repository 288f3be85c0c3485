"""Exceptions raised by the tokenizer; all derive from :class:`TokenizerError`."""

from __future__ import annotations

__all__ = [
    "GGUFReadError",
    "MissingTokenizerError",
    "TokenIdError",
    "TokenizerError",
    "UnsupportedTokenizerError",
    "VocabularyError",
]


class TokenizerError(Exception):
    """Base class of every tokenizer error."""


class GGUFReadError(TokenizerError):
    """The path is not a readable GGUF file (or packed model directory holding one)."""


class MissingTokenizerError(TokenizerError):
    """The GGUF has no usable tokenizer metadata (``tokenizer.ggml.*`` keys)."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer model or pre-tokenizer named in the GGUF is not implemented."""


class TokenIdError(TokenizerError, IndexError):
    """A token id outside ``[0, n_vocab)`` was given to a decoding function."""


class VocabularyError(TokenizerError):
    """The tokenizer metadata is inconsistent (duplicate tokens, missing BOS id, ...)."""
