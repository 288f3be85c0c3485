"""Read the tokenizer metadata (``tokenizer.ggml.*``) from a GGUF header.

The header is parsed by estream-layout's reader (`estream_layout.gguf_header.read_header`, a
direct reader of the key/value section: :class:`gguf.GGUFReader` builds one numpy view per
array element, which takes 5-10 s for a 150k-token vocabulary). Token texts are decoded with
``surrogateescape`` so that bytes which are not UTF-8 survive; numeric arrays come back as
numpy arrays. This module turns the reader's errors into the tokenizer's
(:class:`GGUFReadError`, :class:`MissingTokenizerError`). Tests cross-check the result with
:class:`gguf.GGUFReader` on the shipped vocabularies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from estream_layout.gguf_header import read_header

from ._errors import GGUFReadError, MissingTokenizerError

__all__ = ["read_tokenizer_metadata", "resolve_gguf_path"]

_PACKED_GGUF = "model.gguf"
_MAGIC = b"GGUF"


def resolve_gguf_path(path: str | Path) -> Path:
    """The GGUF file for ``path``: the file itself, or ``model.gguf`` of a packed model dir."""
    p = Path(path)
    if p.is_dir():
        inner = p / _PACKED_GGUF
        if not inner.is_file():
            raise GGUFReadError(
                f"{p} is a directory without {_PACKED_GGUF}: give a GGUF file or a packed "
                "model directory (NAME.estream)"
            )
        return inner
    if not p.is_file():
        raise GGUFReadError(f"{p} does not exist (expected a GGUF file or a packed model dir)")
    return p


def _wanted(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") or key == "general.name"


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` keys of a GGUF (and ``general.name``), decoded.

    String arrays become ``list[str]`` (token texts keep undecodable bytes as surrogate
    escapes), numeric arrays ``numpy`` arrays, scalars Python values.
    """
    gguf_path = resolve_gguf_path(path)
    try:
        with gguf_path.open("rb") as f:
            magic = f.read(4)
        if magic != _MAGIC:
            raise GGUFReadError(f"{gguf_path} is not a GGUF file (it does not start with b'GGUF')")
        header = read_header(gguf_path, strings="surrogateescape")
    except OSError as exc:
        raise GGUFReadError(f"cannot read {gguf_path}: {exc.strerror or exc}") from None
    except EOFError as exc:
        raise GGUFReadError(f"{gguf_path}: truncated GGUF header ({exc})") from None
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise GGUFReadError(f"{gguf_path}: corrupt GGUF header ({exc})") from None
    out: dict[str, Any] = {}
    for key, value in header.kv.items():
        if not _wanted(key):
            continue
        vtype, sub = header.kv_types[key]
        if vtype == GGUFValueType.ARRAY and sub in GGUFReader.gguf_scalar_to_np:
            value = np.asarray(value, dtype=GGUFReader.gguf_scalar_to_np[sub])
        out[key] = value
    if "tokenizer.ggml.model" not in out:
        raise MissingTokenizerError(
            f"{gguf_path} has no tokenizer metadata (no 'tokenizer.ggml.model' key); "
            "was it converted with its vocabulary?"
        )
    tokens = out.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise MissingTokenizerError(f"{gguf_path} has no 'tokenizer.ggml.tokens' string array")
    return out
