"""Code point classes as llama.cpp's pre-tokenizer sees them.

llama.cpp classifies every code point by its Unicode general category (letter, number,
punctuation, symbol, mark, separator, control, undefined) plus the ``White_Space`` property, and
runs its pre-tokenizer regexes on a *collapsed* copy of the text where each non-ASCII code point
is replaced by one byte standing for its class. Reproducing that collapse (rather than running a
Unicode-aware regex engine on the raw text) is what makes our splits identical to llama.cpp's,
including its quirks (e.g. ``\\p{N}`` matches only ``0-9`` among ASCII characters).

The category data come from Python's :mod:`unicodedata`; llama.cpp ships its own tables built
from a (possibly newer) UnicodeData.txt, so code points assigned after Python's Unicode version
may classify differently.
"""

from __future__ import annotations

import unicodedata

__all__ = [
    "COLLAPSED_LETTER",
    "COLLAPSED_MARK",
    "COLLAPSED_NUMBER",
    "COLLAPSED_OTHER",
    "COLLAPSED_PUNCT",
    "COLLAPSED_SYMBOL",
    "COLLAPSED_WHITESPACE",
    "collapse",
    "is_whitespace",
    "widen",
]

# The Unicode White_Space property (PropList.txt): what llama.cpp treats as whitespace.
# Note: U+001C..U+001F are *not* in it, although Python's str.isspace() says they are.
_WHITESPACE: frozenset[int] = frozenset(
    [
        *range(0x09, 0x0E),
        0x20,
        0x85,
        0xA0,
        0x1680,
        *range(0x2000, 0x200B),
        0x2028,
        0x2029,
        0x202F,
        0x205F,
        0x3000,
    ]
)

# One stand-in character per class, the same byte values llama.cpp uses.
COLLAPSED_OTHER = "\xd0"  # separators, controls, unassigned code points
COLLAPSED_NUMBER = "\xd1"
COLLAPSED_LETTER = "\xd2"
COLLAPSED_PUNCT = "\xd3"
COLLAPSED_MARK = "\xd4"
COLLAPSED_SYMBOL = "\xd5"
COLLAPSED_WHITESPACE = "\x0b"  # a vertical tab: matched by the ASCII \s of the regex engine

_BY_MAJOR_CATEGORY = {
    "L": COLLAPSED_LETTER,
    "N": COLLAPSED_NUMBER,
    "P": COLLAPSED_PUNCT,
    "M": COLLAPSED_MARK,
    "S": COLLAPSED_SYMBOL,
}


def is_whitespace(cp: int) -> bool:
    """True if llama.cpp treats code point ``cp`` as whitespace."""
    return cp in _WHITESPACE


def _collapsed_char(cp: int) -> str:
    if cp < 0x80:
        return chr(cp)
    if cp in _WHITESPACE:
        return COLLAPSED_WHITESPACE
    return _BY_MAJOR_CATEGORY.get(unicodedata.category(chr(cp))[0], COLLAPSED_OTHER)


class _LazyTable(dict[int, str]):
    """A ``str.translate`` table that fills itself on first use of each code point."""

    def __init__(self, fill) -> None:  # type: ignore[no-untyped-def]
        super().__init__({cp: chr(cp) for cp in range(0x80)})
        self._fill = fill

    def __missing__(self, cp: int) -> str:
        value = self._fill(cp)
        self[cp] = value
        return value


_COLLAPSE = _LazyTable(_collapsed_char)
_WIDEN = _LazyTable(lambda cp: COLLAPSED_WHITESPACE if cp in _WHITESPACE else chr(cp))


def collapse(text: str) -> str:
    """Text with every non-ASCII code point replaced by its class character (same length)."""
    return text if text.isascii() else text.translate(_COLLAPSE)


def widen(text: str) -> str:
    """Text with non-ASCII whitespace replaced by a vertical tab (same length).

    This is what llama.cpp feeds its regexes that use no Unicode category: their ``\\s`` must
    still match non-ASCII spaces.
    """
    return text if text.isascii() else text.translate(_WIDEN)
