"""Tokenizers read from GGUF metadata that reproduce llama.cpp's token ids exactly.

>>> tok = Tokenizer.from_gguf("model.gguf")          # doctest: +SKIP
>>> tok.encode("Hello world")                        # doctest: +SKIP
[9707, 1879]

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE; the pre-tokenizer named by
``tokenizer.ggml.pre``, see :func:`supported_pre_tokenizers`) and ``"llama"`` (SentencePiece
with byte fallback). Special tokens, BOS/EOS and the ``add_bos``/``add_eos`` rules follow
llama.cpp's ``llama-vocab.cpp``.
"""

from __future__ import annotations

from ._errors import (
    GGUFReadError,
    MissingTokenizerError,
    TokenIdError,
    TokenizerError,
    UnsupportedTokenizerError,
    VocabularyError,
)
from ._gguf import read_tokenizer_metadata
from ._pretok import supported_pre_tokenizers
from ._tokenizer import TokenAttr, Tokenizer

__all__ = [
    "GGUFReadError",
    "MissingTokenizerError",
    "TokenAttr",
    "TokenIdError",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedTokenizerError",
    "VocabularyError",
    "read_tokenizer_metadata",
    "supported_pre_tokenizers",
]
