"""Hypothesis strategies for tests of code that consumes EStream's formats.

Public so that other packages' tests (and `integration/`) can draw the same awkward inputs:
random GGML Q4_0 / Q8_0 block matrices with row counts that are not multiples of 32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .tiles import tile_format

__all__ = ["block_matrices", "finite_scales", "mutate_gguf", "q4_0_blocks", "q8_0_blocks"]

_DROP: Any = object()  # `mutate_gguf(..., set_kv={key: DROP})` removes a key
DROP = _DROP


def finite_scales(
    rng: np.random.Generator, shape: tuple[int, ...], max_abs: float = 1.0
) -> np.ndarray:
    """Finite, mostly small fp16 scales as raw bytes `[..., 2]` (some exact zeros and negatives)."""
    d = rng.uniform(-max_abs, max_abs, size=shape).astype(np.float16)
    d[rng.random(shape) < 0.05] = 0
    return d.view(np.uint8).reshape(*shape, 2)


@st.composite
def block_matrices(
    draw: Any,
    fmt: str = "q4_0-t32r4",
    *,
    max_rows: int = 97,
    max_blocks: int = 6,
    max_batch: int = 1,
    finite: bool = False,
) -> np.ndarray:
    """uint8 GGML block rows `[N, K/32*bs]` (or `[B, N, ...]` when `max_batch > 1`).

    Row counts 1..max_rows (mostly not multiples of 32). With `finite=False` the scale bytes are
    arbitrary (NaN/inf patterns included: packing must still be bit-exact); with `finite=True`
    scales are finite fp16 so the matrix can be dequantized and compared numerically.
    """
    f = tile_format(fmt)
    n = draw(st.integers(1, max_rows))
    kb = draw(st.integers(1, max_blocks))
    batch = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (batch, n, kb, f.block_bytes)
    blocks = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if finite:
        blocks[..., :2] = finite_scales(rng, shape[:-1])
    out = blocks.reshape(batch, n, kb * f.block_bytes)
    return out if max_batch > 1 else out[0]


def q4_0_blocks(**kw: Any) -> st.SearchStrategy[np.ndarray]:
    """`block_matrices` of GGML Q4_0 blocks (18 bytes: fp16 scale + 16 nibble bytes)."""
    return block_matrices("q4_0-t32r4", **kw)


def q8_0_blocks(**kw: Any) -> st.SearchStrategy[np.ndarray]:
    """`block_matrices` of GGML Q8_0 blocks (34 bytes: fp16 scale + 32 int8)."""
    return block_matrices("q8_0-t32r4", **kw)


def mutate_gguf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    set_kv: Mapping[str, Any] | None = None,
    edit_tensor: Mapping[str, Callable[[np.ndarray], None]] | None = None,
) -> Path:
    """Copy the GGUF `src` to `dst` with metadata changed (`set_kv={key: value}`; `DROP`
    removes the key; a value keeps the key's GGUF type unless its Python type forces another:
    str -> STRING, float -> FLOAT32, int -> the original integer type or INT32) and tensors
    edited in place (`edit_tensor={name: fn(raw_uint8_or_float_array)}`). For fault-injection
    tests: nonsense metadata, NaN weights, poisoned scales."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    changes = dict(set_kv or {})
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    skip = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, field in reader.fields.items():
        if name in skip:
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name in changes:
            value = changes.pop(name)
            if value is _DROP:
                continue
            vtype, sub = _value_type(value, vtype, sub)
        writer.add_key_value(name, value, vtype, sub)
    for name, value in changes.items():
        if value is not _DROP:
            vtype, sub = _value_type(value, None, None)
            writer.add_key_value(name, value, vtype, sub)
    edits = dict(edit_tensor or {})
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name in edits:
            edits.pop(t.name)(data)
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, data, raw_shape=tuple(reversed(t.shape.tolist())))
        else:
            writer.add_tensor(t.name, data, raw_dtype=qtype)
    if edits:
        raise KeyError(f"no tensors named {sorted(edits)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def _value_type(value: Any, vtype: Any, sub: Any) -> tuple[Any, Any]:
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, bool):
        return t.BOOL, None
    if isinstance(value, str):
        return t.STRING, None
    if isinstance(value, float):
        return t.FLOAT32, None
    if isinstance(value, int):
        ints = (t.UINT8, t.INT8, t.UINT16, t.INT16, t.UINT32, t.INT32, t.UINT64, t.INT64)
        if vtype in ints and not (value < 0 and vtype in (t.UINT8, t.UINT16, t.UINT32, t.UINT64)):
            return vtype, None
        return t.INT32, None
    if isinstance(value, list):
        return t.ARRAY, sub if sub is not None else _value_type(value[0], None, None)[0]
    raise TypeError(f"cannot write {type(value).__name__} as GGUF metadata")
