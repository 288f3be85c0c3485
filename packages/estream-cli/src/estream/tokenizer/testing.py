"""Helpers for tests and benchmarks: find llama.cpp's vocabulary test vectors and read them.

The vectors ship inside estream-layout (``estream_layout/data/``, llama.cpp's MIT licence beside
them): ``ggml-vocab-NAME.gguf`` plus ``.inp`` (test strings separated by lines
``__ggml_vocab_test__``) and ``.out`` (expected ids, one line each), read exactly as llama.cpp's
``tests/test-tokenizer-0.cpp`` reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

from estream_layout.synth import VOCAB_DIR

__all__ = ["VOCAB_SEPARATOR", "find_vocab_dir", "read_vocab_tests", "vocab_files"]

VOCAB_SEPARATOR = "\n__ggml_vocab_test__\n"


def find_vocab_dir() -> Path:
    """The vocabulary directory: ``$ESTREAM_VOCAB_DIR`` if that variable is set (newer vectors
    to try), else the copy shipped with estream-layout. The caller checks what it needs is
    there, so a missing file fails loudly rather than skipping."""
    env = os.environ.get("ESTREAM_VOCAB_DIR")
    return Path(env) if env else VOCAB_DIR


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
