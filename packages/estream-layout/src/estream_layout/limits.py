"""Sane ranges for GGUF metadata, far beyond any published model, so that a corrupt or hostile
value is refused before anything is sized by it (block_count 2**31 must not build 2**31 of
anything). Read by `ModelSpec` and by the family records' own checks."""

from __future__ import annotations

from typing import Final

MAX_LAYERS: Final = 1 << 12
MAX_WIDTH: Final = 1 << 20  # embedding, FFN, head and LoRA widths
MAX_HEADS: Final = 1 << 14
MAX_EXPERTS: Final = 1 << 16
MAX_VOCAB: Final = 1 << 24
MAX_CONTEXT: Final = 1 << 24  # tokens
MIN_CONTEXT: Final = 16  # tokens: a context shorter than this is not a language model's
MAX_CONV_CACHE: Final = 1 << 10
MAX_INT: Final = (1 << 63) - 1
