"""Helpers for tests and benchmarks: find llama.cpp's vocabulary test vectors and read them.

The vectors live in ``<shared>/data/vocab/``: ``ggml-vocab-NAME.gguf`` plus ``.inp`` (test
strings separated by lines ``__ggml_vocab_test__``) and ``.out`` (expected ids, one line each),
read exactly as llama.cpp's ``tests/test-tokenizer-0.cpp`` reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["VOCAB_SEPARATOR", "find_vocab_dir", "read_vocab_tests", "vocab_files"]

VOCAB_SEPARATOR = "\n__ggml_vocab_test__\n"
_REL = Path("data") / "vocab"


def find_vocab_dir(start: str | Path | None = None) -> Path | None:
    """The vocabulary directory: ``$ESTREAM_SHARED/data/vocab`` if that variable is set, else
    the first ``shared/data/vocab`` found beside ``start`` (default: this file) or any of its
    parents. None if there is none."""
    env = os.environ.get("ESTREAM_SHARED")
    if env:
        cand = Path(env) / _REL
        return cand if cand.is_dir() else None
    here = Path(start if start is not None else __file__).resolve()
    for parent in [here, *here.parents]:
        cand = parent / "shared" / _REL
        if cand.is_dir():
            return cand
    return None


def vocab_files(vocab_dir: Path) -> list[Path]:
    """The ``ggml-vocab-*.gguf`` files of ``vocab_dir``, sorted by name."""
    return sorted(vocab_dir.glob("ggml-vocab-*.gguf"))


def read_vocab_tests(gguf_path: str | Path) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) pairs of ``gguf_path`` + ``.inp`` / ``.out``.

    Raises ValueError if the two files disagree on the number of tests.
    """
    gguf_path = Path(gguf_path)
    raw = Path(f"{gguf_path}.inp").read_bytes().decode("utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(VOCAB_SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(VOCAB_SEPARATOR)
    lines = Path(f"{gguf_path}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise ValueError(
            f"{gguf_path}: {len(texts)} test strings in .inp but {len(lines)} lines in .out"
        )
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]
