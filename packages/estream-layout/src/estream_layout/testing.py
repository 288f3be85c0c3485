"""Hypothesis strategies for tests of code that consumes EStream's formats.

Public so that other packages' tests (and `integration/`) can draw the same awkward inputs:
random GGML Q4_0 / Q8_0 block matrices with row counts that are not multiples of 32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

from .tiles import tile_format

__all__ = [
    "DROP",
    "ManifestMutation",
    "block_matrices",
    "finite_scales",
    "manifest_mutations",
    "mutate_gguf",
    "q4_0_blocks",
    "q8_0_blocks",
    "reseal",
]

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
    str -> STRING, float -> FLOAT32 (FLOAT64 beyond its range), int -> the original integer
    type if it holds the value, else INT32, INT64 or UINT64) and tensors
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
    if isinstance(value, float):  # FLOAT64 only when FLOAT32 cannot hold it (inf and nan can)
        return (t.FLOAT64 if abs(value) > 3.4e38 and value != float("inf") else t.FLOAT32), None
    ranges = {
        t.UINT8: (0, 255), t.INT8: (-128, 127), t.UINT16: (0, 65535),
        t.INT16: (-32768, 32767), t.UINT32: (0, 2**32 - 1), t.INT32: (-(2**31), 2**31 - 1),
        t.UINT64: (0, 2**64 - 1), t.INT64: (-(2**63), 2**63 - 1),
    }  # fmt: skip

    def int_type(lo: int, hi: int, own: Any) -> Any:
        # the key's own type if the values fit it, else the narrowest of INT32, INT64, UINT64
        for cand in (own, t.INT32, t.INT64, t.UINT64):
            if cand in ranges and ranges[cand][0] <= lo and hi <= ranges[cand][1]:
                return cand
        raise ValueError(f"{lo}..{hi} does not fit any GGUF integer type")

    if isinstance(value, int):
        return int_type(value, value, vtype), None
    if isinstance(value, list):
        if not value:
            return t.ARRAY, sub if sub is not None else t.INT32
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return t.ARRAY, int_type(min(value), max(value), sub)
        kinds = {_value_type(v, None, None)[0] for v in value}
        if len(kinds) > 1:
            raise TypeError("cannot write a GGUF array of mixed types")
        return t.ARRAY, kinds.pop()
    raise TypeError(f"cannot write {type(value).__name__} as GGUF metadata")


# ------------------------------------------------------------------------------ manifests
class ManifestMutation(NamedTuple):
    """One systematic corruption of a manifest document."""

    field: str  # the path as the validator names it: layers[0].order, dense.tensors['x'].offset
    kind: str  # "type" | "range" | "inconsistent" | "missing"
    value: Any  # the new value (DROP for a removed key)
    doc: dict[str, Any]  # the corrupted document (integrity digest NOT updated)


def reseal(doc: dict[str, Any]) -> dict[str, Any]:
    """Recompute a manifest document's integrity digest in place (a deliberate edit, or a
    buggy writer): what is left for the field checks to catch."""
    from .manifest import manifest_digest

    try:
        doc["integrity"] = {"sha256": manifest_digest(doc)}
    except (TypeError, ValueError):  # NaN / non-JSON values: the digest itself refuses them
        doc["integrity"] = {"sha256": "0" * 64}
    return doc


def _bad_values(v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, bool):
        return [("type", "yes"), ("type", 2)]
    if isinstance(v, int):
        return [
            ("type", str(v)),
            ("type", None),
            ("type", v + 0.5),
            ("type", True),
            ("range", -1),
            ("range", -(2**40)),
            ("range", 2**62),
            ("inconsistent", v + 1),
            ("inconsistent", v + 4096),
            ("inconsistent", max(v - 4096, 0) if v else 4096),
        ]
    if isinstance(v, float):
        return [("type", "1.0"), ("range", -1.0), ("range", float("nan")), ("range", 1e300)]
    if isinstance(v, str):
        return [("type", 7), ("type", None), ("range", ""), ("inconsistent", "../" + v)]
    if isinstance(v, list):
        out: list[tuple[str, Any]] = [("type", {}), ("range", [])]
        if v:
            out += [("inconsistent", v + v[:1]), ("inconsistent", v[:-1])]
        if len(v) > 1:
            out += [("inconsistent", [v[0], *v[:-1]]), ("inconsistent", v[::-1])]
        return out
    if isinstance(v, dict):
        return [("type", []), ("range", {})]
    return [("type", 1)]


def _leaves(node: Any, path: str) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(validator-style path, key path) of every value worth corrupting: every dict entry,
    and the first and last element of each list (long lists are many copies of one rule)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "integrity":
                continue
            sub = f"{path}[{k!r}]" if path.endswith("tensors") else f"{path}.{k}" if path else k
            yield sub, (k,)
            for p, keys in _leaves(v, sub):
                yield p, (k, *keys)
    elif isinstance(node, list):
        for i in sorted({0, len(node) - 1}) if node else ():
            yield f"{path}[{i}]", (i,)
            for p, keys in _leaves(node[i], f"{path}[{i}]"):
                yield p, (i, *keys)


def manifest_mutations(doc: Mapping[str, Any]) -> Iterator[ManifestMutation]:
    """Every field of a manifest document x {wrong type, out of range, inconsistent, missing}:
    ~10 corruptions per field, each on a fresh copy. The digest is left as it was: `reseal`
    the result to test the field checks behind it."""
    import copy

    base = copy.deepcopy(dict(doc))
    for field, keys in list(_leaves(base, "")):
        parent: Any = base
        for k in keys[:-1]:
            parent = parent[k]
        value = parent[keys[-1]]
        cases = _bad_values(value)
        if isinstance(parent, dict):
            cases.append(("missing", DROP))
        for kind, bad in cases:
            new = copy.deepcopy(base)
            target: Any = new
            for k in keys[:-1]:
                target = target[k]
            if bad is DROP:
                del target[keys[-1]]
            else:
                target[keys[-1]] = bad
            if new != base:  # e.g. reversing a symmetric list changes nothing
                yield ManifestMutation(field, kind, bad, new)
