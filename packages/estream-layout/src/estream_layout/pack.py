"""Pack a GGUF MoE model into `NAME.estream/` (docs/design.md §4, docs/format.md).

Streaming: tensors are read with `pread` into reused buffers, converted and appended to the
output files, so memory stays bounded (a few chunk buffers) whatever the model size. The pack is
built in `NAME.estream.tmp-XXXX` beside the target and renamed into place only after the
manifest (written last) is on disk: an interrupted pack never leaves a `NAME.estream`.

Only an existing EStream pack (recognised by its manifest, holding nothing but pack files) is
ever replaced, and only with `force`; the swap is one atomic `renameat2` exchange that is undone
if the target changed while packing. Source weights that are NaN or infinite are refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import queue
import re
import secrets
import shutil
import stat
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

import attrs
import numpy as np
from gguf import GGMLQuantizationType

from .diskspace import check_disk_space
from .errors import (
    InvalidArgumentError,
    LayoutError,
    NonFiniteWeightsError,
    PackExistsError,
    PackTargetError,
    ProfileError,
    UnalignedReductionError,
    UnsupportedTensorTypeError,
)
from .gguf_header import read_header
from .gguf_model import (
    EXPERT_PROJECTIONS,
    ModelSpec,
    TensorInfo,
    TensorReader,
    dequantize_rows,
    parse_expert_tensor_name,
)
from .manifest import (
    FORMAT,
    LOCK_NAME,
    MANIFEST_NAME,
    MAX_EXPERTS,
    MODEL_GGUF,
    PAGE,
    DenseEntry,
    LayerEntry,
    Manifest,
    ProjectionEntry,
    dense_nbytes,
    read_manifest_doc,
)
from .tiles import (
    MXFP4_MAX_EXPONENT,
    TILE,
    pack_tiles,
    quantize_q4_0,
    quantize_q8_0,
    tile_nbytes,
)

__all__ = [
    "DENSE_FILE",
    "EXPERTS_FILE",
    "dense_format",
    "load_routing_profile",
    "pack_model",
    "planned_pack_bytes",
    "storage_order",
    "write_metadata_gguf",
]

DENSE_FILE: Final = "dense.bin"
EXPERTS_FILE: Final = "experts.bin"
_QUANT_PASSTHROUGH: Final = {
    GGMLQuantizationType.Q4_0: "q4_0-t32r4",
    GGMLQuantizationType.Q8_0: "q8_0-t32r4",
    GGMLQuantizationType.Q4_K: "q4_k-t32r4",
    GGMLQuantizationType.Q5_K: "q5_k-t32r4",
    GGMLQuantizationType.Q6_K: "q6_k-t32r4",
    GGMLQuantizationType.MXFP4: "mxfp4-t32r4",
    GGMLQuantizationType.IQ4_NL: "iq4_nl-t32r4",
    GGMLQuantizationType.Q4_1: "q4_1-t32r4",
    GGMLQuantizationType.Q5_0: "q5_0-t32r4",
    GGMLQuantizationType.Q5_1: "q5_1-t32r4",
    GGMLQuantizationType.IQ4_XS: "iq4_xs-t32r4",
}
# Dense matrices kept as they are (lossless re-layout): the quantized types with a kernel, and
# F16 / BF16 (16-bit float tiles, computed in fp32; F32 matrices stay plain `f32`).
_DENSE_PASSTHROUGH: Final = {
    **_QUANT_PASSTHROUGH,
    GGMLQuantizationType.F16: "f16-t32r4",
    GGMLQuantizationType.BF16: "bf16-t32r4",
}
_FLOAT_TYPES: Final = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
}


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


# ------------------------------------------------------------------------------ dense rules
def dense_format(info: TensorInfo) -> str:
    """The dense.bin format of a non-expert tensor.

    * 1-D tensors, routers (`ffn_gate_inp`), biases (`*.bias`: addends, not matrices, e.g.
      gpt-oss's per-expert `ffn_*_exps.bias` `[E, rows]`) and float matrices whose row length
      is not a multiple of 32 (e.g. lfm2's short-convolution kernels) -> `f32`;
    * Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 matrices -> `q4_0-t32r4`, `q8_0-t32r4`, `q4_k-t32r4`,
      `q5_k-t32r4`, `q6_k-t32r4`, `mxfp4-t32r4` (lossless), IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS ->
      `iq4_nl-t32r4`, `q4_1-t32r4`, `q5_0-t32r4`, `q5_1-t32r4`, `iq4_xs-t32r4`;
    * F32 matrices -> `f32` (lossless: the engine computes them with fp32 activations);
    * F16 / BF16 matrices -> `f16-t32r4` / `bf16-t32r4` (lossless: the file's 16-bit values,
      computed in fp32 like `f32` matrices);
    * other matrices (other quantized types ...) -> dequantized, re-quantized to Q8_0 ->
      `q8_0-t32r4` (one rounding step, Q8_0's).

    The kept types are `_DENSE_PASSTHROUGH`'s.
    """
    if len(info.shape) == 1 or info.name.endswith(("ffn_gate_inp.weight", ".bias")):
        return "f32"
    qt = info.qtype
    if qt == GGMLQuantizationType.F32:
        return "f32"
    if info.shape[-1] % TILE:
        if qt in _FLOAT_TYPES:
            return "f32"
        raise UnalignedReductionError(
            f"{info.name}: {info.ggml_type} matrix with reduction dimension {info.shape[-1]}, "
            "not a multiple of 32, cannot be tiled"
        )
    return _DENSE_PASSTHROUGH.get(qt, "q8_0-t32r4")


def _dense_nbytes(info: TensorInfo, fmt: str) -> int:
    return dense_nbytes(fmt, info.shape)


# ------------------------------------------------------------------------------ finite weights
# block bytes and the offsets of the fp16 scales in a block, per type kept as it is
_BLOCK_BYTES: Final = {
    GGMLQuantizationType.Q4_0: (18, (0,)),
    GGMLQuantizationType.Q8_0: (34, (0,)),
    GGMLQuantizationType.IQ4_NL: (18, (0,)),
    GGMLQuantizationType.Q4_1: (20, (0, 2)),
    GGMLQuantizationType.Q5_0: (22, (0,)),
    GGMLQuantizationType.Q5_1: (24, (0, 2)),
    GGMLQuantizationType.Q4_K: (144, (0, 2)),
    GGMLQuantizationType.Q5_K: (176, (0, 2)),
    GGMLQuantizationType.Q6_K: (210, (208,)),
    GGMLQuantizationType.IQ4_XS: (136, (0,)),
}


def _check_finite(info: TensorInfo, what: str, values: Any = None, raw: Any = None) -> None:
    """Refuse NaN/Inf source weights: a float tensor's values, or the fp16 block scales of raw
    Q4_0/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_NL/Q4_1/Q5_0/Q5_1/IQ4_XS rows (their only floating-point part),
    or the E8M0 exponents of MXFP4 rows (above `MXFP4_MAX_EXPONENT` a block's values overflow
    float32 or are NaN). A NaN weight would otherwise pack, load and silently poison every
    activation that meets it."""
    if values is not None:
        bad = ~np.isfinite(values)
    elif info.qtype == GGMLQuantizationType.MXFP4:
        bad = raw.reshape(-1, 17)[:, 0] > MXFP4_MAX_EXPONENT
    else:
        bb, offsets = _BLOCK_BYTES[info.qtype]
        blocks = raw.reshape(-1, bb)
        bad = np.concatenate(
            [
                ~np.isfinite(np.ascontiguousarray(blocks[:, o : o + 2]).view(np.float16))
                for o in offsets
            ]
        )
    if bad.any():
        raise NonFiniteWeightsError(
            f"{info.name}{what}: {int(bad.sum())} NaN or infinite "
            f"{'values' if values is not None else 'block scales'} in the source model; it is "
            "corrupt (re-download or re-convert it), refusing to pack"
        )


def _dequantize_checked(raw: np.ndarray, info: TensorInfo, what: str = "") -> np.ndarray:
    values = dequantize_rows(raw, info)
    _check_finite(info, what, values=values)
    return values


# ------------------------------------------------------------------------------ storage order
# A profile holds a few numbers per expert and layer (plus an optional E x E matrix): a real one
# is well under a megabyte; this bounds what a hostile file can make the parser do.
MAX_PROFILE_BYTES: Final = 64 << 20
_LAYER_KEY: Final = re.compile(r"[0-9]{1,7}")


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range of a finite number")
    return value


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _read_profile_json(path: Path) -> Any:
    """The JSON document of a profile file, strictly: no NaN/Infinity, no number that overflows
    to infinity, no key twice in an object, bounded size and nesting."""
    where = f"routing profile {path}"
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ProfileError(f"{where}: not a regular file")
        if size > MAX_PROFILE_BYTES:
            raise ProfileError(f"{where}: {size} bytes, more than a profile can be")
        text = path.read_bytes().decode("utf-8")
        return json.loads(
            text,
            parse_constant=_json_constant,
            parse_float=_json_float,
            object_pairs_hook=_json_object,
        )
    except OSError as e:
        raise ProfileError(f"cannot read {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{where}: not UTF-8 text") from None
    except RecursionError:
        raise ProfileError(f"{where}: nested too deeply to be a routing profile") from None
    except ValueError as e:
        raise ProfileError(f"{where}: not valid JSON ({e})") from None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _profile_numbers(where: str, v: Any, field: str, n: int | None = None) -> np.ndarray:
    """A list of finite, non-negative numbers (of length `n` if given) as float64."""
    if not isinstance(v, list):
        raise ProfileError(f"{where}: {field} must be a list of numbers, not {_kind(v)}")
    if n is not None and len(v) != n:
        raise ProfileError(f"{where}: {field} has {len(v)} entries, expected {n}")
    for i, x in enumerate(v):
        if not _is_number(x):
            raise ProfileError(f"{where}: {field}[{i}] is {_kind(x)}, not a number")
        try:
            finite = math.isfinite(x) and x >= 0  # an int past float's range: OverflowError
        except OverflowError:
            finite = False
        if not finite:
            shown = x if isinstance(x, float) or abs(x) < 10**20 else "a huge integer"
            raise ProfileError(f"{where}: {field}[{i}] = {shown} is not a finite number >= 0")
    return np.asarray(v, dtype=np.float64)


def _kind(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def load_routing_profile(
    profile: str | os.PathLike[str] | Mapping[str, Any],
) -> dict[int, dict[str, Any]]:
    """Read and validate a routing profile:
    `{"layers": {"<layer>": {"counts": [E], "coactivation": [[E]*E]}}}`.

    `layers` may also be a list of `{"index": l, "counts": ..., "coactivation": ...}`.
    `counts[e]` is how many routed tokens chose expert `e`; `coactivation[a][b]` (optional) how
    often `a` and `b` were chosen for the same token. Returns layer -> {"counts", "coactivation"}
    (float64 arrays). The one validator of profiles: anything else -- strings or booleans for
    numbers, NaN, infinities, negative counts, a layer named twice or by a non-integer, a
    coactivation that is not E x E, deep nesting -- is a ProfileError naming the file and the
    problem (one line).
    """
    if isinstance(profile, Mapping):
        where = "routing profile"
    else:
        where = f"routing profile {profile}"
        profile = _read_profile_json(Path(profile))
    if not isinstance(profile, Mapping) or "layers" not in profile:
        raise ProfileError(f'{where}: needs a "layers" field (see docs/format.md)')
    layers = profile["layers"]
    items: list[tuple[int, Any]] = []
    if isinstance(layers, Mapping):
        for k, v in layers.items():
            if not isinstance(k, int | str) or isinstance(k, bool):
                raise ProfileError(f"{where}: layer key {_kind(k)} is not a layer index")
            if isinstance(k, str) and not _LAYER_KEY.fullmatch(k):
                raise ProfileError(f"{where}: layer key {k!r} is not a layer index (0, 1, ...)")
            items.append((int(k), v))
    elif isinstance(layers, list):
        for i, v in enumerate(layers):
            index = v.get("index") if isinstance(v, Mapping) else None
            if not _is_number(index) or not isinstance(index, int) or index < 0:
                raise ProfileError(
                    f'{where}: layers[{i}] needs an "index" (a layer number), got {_kind(index)}'
                )
            items.append((index, v))
    else:
        raise ProfileError(f'{where}: "layers" must be an object or a list, not {_kind(layers)}')
    out: dict[int, dict[str, Any]] = {}
    for index, entry in items:
        at = f"{where}: layer {index}"
        if index in out:
            raise ProfileError(f"{at} appears twice")
        if not isinstance(entry, Mapping) or "counts" not in entry:
            raise ProfileError(f'{at}: needs "counts" (one number per expert)')
        counts = _profile_numbers(at, entry["counts"], "counts")
        if not 1 <= counts.size <= MAX_EXPERTS:
            raise ProfileError(f"{at}: counts has {counts.size} entries, not one per expert")
        co = entry.get("coactivation")
        if co is not None:
            n = counts.size
            if not isinstance(co, list) or len(co) != n:
                raise ProfileError(
                    f"{at}: coactivation must be {n}x{n} (a list of {n} rows), got {_kind(co)}"
                )
            co = np.stack(
                [_profile_numbers(at, row, f"coactivation[{a}]", n) for a, row in enumerate(co)]
            )
        out[index] = {"counts": counts, "coactivation": co}
    return out


def storage_order(counts: Sequence[float], coactivation: Any = None, window: int = 4) -> list[int]:
    """Storage order (position -> expert id) from a routing profile.

    Without co-activation: hottest expert first (ties by id). With it: start with the hottest,
    then repeatedly append the unplaced expert most co-activated with the last `window` placed
    ones (ties: hotter first), so experts that fire together sit in the same group extents.
    """
    c = np.asarray(counts, dtype=np.float64)
    n = c.size
    if coactivation is None:
        return [int(e) for e in sorted(range(n), key=lambda e: (-c[e], e))]
    co = np.asarray(coactivation, dtype=np.float64)
    order = [int(sorted(range(n), key=lambda e: (-c[e], e))[0])]
    placed = np.zeros(n, dtype=bool)
    placed[order[0]] = True
    while len(order) < n:
        score = co[order[-window:]].sum(axis=0)
        cand = [e for e in range(n) if not placed[e]]
        best = max(cand, key=lambda e: (score[e], c[e], -e))
        order.append(int(best))
        placed[best] = True
    return order


def _resolve_orders(
    spec: ModelSpec, order: Any
) -> tuple[dict[int, list[int]], dict[str, Any] | None]:
    """Per-layer storage orders from `order` (None | profile path/dict | {layer: [ids]})."""
    identity = {layer: list(range(spec.n_experts)) for layer in spec.moe_layers}
    if order is None:
        return identity, None
    if isinstance(order, Mapping) and "layers" not in order:
        where = "explicit order"
        out = dict(identity)
        for k, v in order.items():
            ok_key = isinstance(k, int) or (isinstance(k, str) and _LAYER_KEY.fullmatch(k))
            if isinstance(k, bool) or not ok_key or not isinstance(v, list | tuple):
                raise ProfileError(
                    'an order must be a routing profile {"layers": ...} or {layer: [expert ids]}'
                )
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ProfileError(f"{where}: layer {k}: expert ids must be integers")
            layer = int(k)
            if layer not in identity:
                raise ProfileError(f"order given for layer {layer}, which is not a MoE layer")
            out[layer] = list(v)
        summary = {"source": "explicit"}
    else:
        where = "routing profile" + ("" if isinstance(order, Mapping) else f" {order}")
        prof = load_routing_profile(order)
        out = dict(identity)
        for layer, entry in prof.items():
            if layer not in identity:
                raise ProfileError(
                    f"{where}: names layer {layer}, not a MoE layer of the model "
                    f"({_moe_span(spec.moe_layers)})"
                )
            if entry["counts"].size != spec.n_experts:
                raise ProfileError(
                    f"{where}: layer {layer}: {entry['counts'].size} counts for "
                    f"{spec.n_experts} experts"
                )
            out[layer] = storage_order(entry["counts"], entry["coactivation"])
        summary = {"source": str(order) if not isinstance(order, Mapping) else "dict"}
    for layer, o in out.items():
        if sorted(o) != list(range(spec.n_experts)):
            raise ProfileError(
                f"{where}: layer {layer}: order is not a permutation of 0..{spec.n_experts - 1}"
            )
    return out, summary


def _moe_span(layers: tuple[int, ...]) -> str:
    contiguous = layers == tuple(range(layers[0], layers[-1] + 1))
    return f"layers {layers[0]}..{layers[-1]}" if contiguous else f"layers {list(layers)}"


# ------------------------------------------------------------------------------ progress
class _Progress:
    """A dependency-free progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tty = sys.stderr.isatty()
        self.next_pct = 10

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        pct = 100 * self.done / self.total
        if self.tty and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 1e6
            sys.stderr.write(
                f"\r{self.label}: {pct:5.1f}% {self.done / 1e6:,.0f}/{self.total / 1e6:,.0f} MB "
                f"{rate:,.0f} MB/s"
            )
            sys.stderr.flush()
        elif not self.tty and pct >= self.next_pct:
            while self.next_pct <= pct:  # the last threshold crossed, printed once
                self.next_pct += 10
            sys.stderr.write(f"{self.label}: {self.next_pct - 10}%\n")

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


# ------------------------------------------------------------------------------ writers
def write_metadata_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Write a tensor-less GGUF at `dst` holding every KV pair of `src` (tokenizer included).

    The KV section is copied byte for byte, so types and values are exactly the source's; the
    header says 0 tensors. Any GGUF reader (llama.cpp's, gguf-py's) opens it.
    """
    header = read_header(src)
    start, end = header.kv_span
    with open(src, "rb") as fh:
        fh.seek(start)
        kv = fh.read(end - start)
    with open(dst, "wb") as out:
        out.write(struct.pack("<IIQQ", 0x46554747, header.version, 0, header.n_kv))
        out.write(kv)


def _pad_file(fh: IO[bytes], to: int = PAGE) -> int:
    pos = fh.tell()
    pad = _round_up(pos, to) - pos
    if pad:
        fh.write(b"\0" * pad)
    return pos + pad


class _SourcePass:
    """Reads the source GGUF and computes its sha256.

    Normally (`sequential=True`) the file is read exactly once, front to back: tensors in file
    order, gaps (header, alignment padding) too, and every buffer read is hashed on a background
    thread (hashlib releases the GIL; the packer never modifies those buffers). When the packer
    must read out of order (layers too big to buffer), a separate thread hashes the file with its
    own sequential reads instead.
    """

    def __init__(self, reader: TensorReader, size: int, *, sequential: bool = True) -> None:
        self.reader = reader
        self.size = size
        self.sequential = sequential
        self.pos = 0
        self._hash = hashlib.sha256()
        self._queue: queue.Queue[memoryview | None] = queue.Queue(maxsize=3)
        target = self._run if sequential else self._hash_whole_file
        self._thread = threading.Thread(target=target, name="estream-pack-sha256", daemon=True)
        self._stop = False
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._hash.update(item)

    def _hash_whole_file(self) -> None:
        buf = np.empty(8 << 20, dtype=np.uint8)
        with TensorReader(self.reader.path) as own:
            for pos in range(0, self.size, buf.size):
                if self._stop:
                    return
                n = min(buf.size, self.size - pos)
                self._hash.update(own.read_into(pos, buf[:n]))

    def _skip_to(self, offset: int) -> None:
        if offset < self.pos:
            raise AssertionError(f"source read out of order: {offset} < {self.pos}")
        while self.pos < offset:
            n = min(offset - self.pos, 8 << 20)
            part = self.reader.read_into(self.pos, np.empty(n, dtype=np.uint8))
            self._queue.put(memoryview(part))
            self.pos += n

    def read(self, offset: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` from `offset` (in sequential mode: not before the previous read's end)."""
        if not self.sequential:
            return self.reader.read_into(offset, out)
        self._skip_to(offset)
        self.reader.read_into(offset, out)
        self._queue.put(memoryview(out.reshape(-1)))
        self.pos = offset + out.nbytes
        return out

    def rows(self, info: TensorInfo, start: int, count: int) -> np.ndarray:
        out = np.empty((count, info.row_bytes), dtype=np.uint8)
        return self.read(info.offset + start * info.row_bytes, out)

    def sha256(self) -> str:
        if self.sequential:
            self._skip_to(self.size)
            self._queue.put(None)
        self._thread.join()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            if self.sequential:
                self._queue.put(None)
            self._thread.join()


def _write_dense_tensor(
    src: _SourcePass, info: TensorInfo, fmt: str, fh: IO[bytes], chunk_bytes: int
) -> int:
    """Convert one tensor chunk by chunk (row chunks of whole 32-row tiles) and append it;
    returns the crc32 of the bytes written."""
    crc = 0

    def write(data: Any) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)
        fh.write(data)

    if len(info.shape) == 1:
        raw = src.rows(info, 0, 1)
        write(_dequantize_checked(raw, info).astype(np.float32).tobytes())
        return crc
    rows_per_mat = info.shape[-2]
    n_mats = info.n_rows // rows_per_mat
    rb = max(info.row_bytes, 1)
    step = max(TILE, (chunk_bytes // rb) // TILE * TILE)
    for m in range(n_mats):
        for start in range(0, rows_per_mat, step):
            count = min(step, rows_per_mat - start)
            raw = src.rows(info, m * rows_per_mat + start, count)
            if fmt == "f32":
                write(np.ascontiguousarray(_dequantize_checked(raw, info), np.float32).tobytes())
                continue
            src_fmt = _DENSE_PASSTHROUGH.get(info.qtype)
            if src_fmt == fmt:
                if info.qtype in _FLOAT_TYPES:  # F16 / BF16: every value is checked
                    _dequantize_checked(raw, info)
                else:
                    _check_finite(info, "", raw=raw)
                blocks = raw
            else:
                blocks = quantize_q8_0(_dequantize_checked(raw, info))
            write(pack_tiles(blocks, fmt).data)
    return crc


# Expert tensor types kept as they are (lossless re-layout), and their tile formats: the quantized
# types with a kernel (`_QUANT_PASSTHROUGH`, the one list; the refusal names these).
EXPERT_TILE_FORMATS: Final = {qt.name: fmt for qt, fmt in _QUANT_PASSTHROUGH.items()}


def expert_format(info: TensorInfo) -> str:
    """The tile format an expert tensor is packed in: its own type's where there is one,
    else `q4_0-t32r4` (re-quantized)."""
    return EXPERT_TILE_FORMATS.get(info.ggml_type, "q4_0-t32r4")


def _requant_tensors(spec: ModelSpec) -> list[TensorInfo]:
    """Expert tensors of a type without a tile format (they get dequantized and
    re-quantized to Q4_0)."""
    return [
        spec.expert_tensor(layer, j)
        for layer in spec.moe_layers
        for j in EXPERT_PROJECTIONS
        if spec.expert_tensor(layer, j).ggml_type not in EXPERT_TILE_FORMATS
    ]


def _warn_requant(spec: ModelSpec, tensors: list[TensorInfo]) -> None:
    bar = "!" * 78
    types = sorted({t.ggml_type for t in tensors})
    n_all = len(spec.moe_layers) * len(EXPERT_PROJECTIONS)
    sys.stderr.write(
        f"{bar}\nWARNING: {len(tensors)} of the {n_all} expert tensors of "
        f"{Path(spec.path).name} are {', '.join(types)}, which EStream has no kernels for.\n"
        "They will be dequantized and RE-QUANTIZED to Q4_0 (double quantization): those packed\n"
        "experts are NOT bit-identical to the source and lose accuracy. For best quality pack\n"
        "a GGUF quantized to Q4_0 from the original weights (llama-quantize ... Q4_0).\n"
        f"{bar}\n"
    )
    sys.stderr.flush()


def projection_slots(spec: ModelSpec) -> dict[str, int]:
    """Bytes of each projection's place in a record: its tiles padded to 4096, the largest over
    the MoE layers, so that every layer's records have one shape (a file may store a projection
    in another type in some layers, as Q4_K_M does with ffn_down) and one arena serves them."""
    slots = dict.fromkeys(EXPERT_PROJECTIONS, 0)
    for layer in spec.moe_layers:
        for j in EXPERT_PROJECTIONS:
            info = spec.expert_tensor(layer, j)
            _, rows, cols = info.shape
            slots[j] = max(slots[j], _round_up(tile_nbytes(rows, cols, expert_format(info))))
    return slots


def planned_pack_bytes(spec: ModelSpec) -> int:
    """Bytes a pack of `spec` will occupy: dense.bin, experts.bin (page-padded records) and the
    metadata GGUF (bounded by the source's header); the manifest is small change (1 MiB)."""
    dense = sum(_round_up(_dense_nbytes(spec.tensors[n], dense_format(spec.tensors[n])))
                for n in spec.dense_tensor_names)  # fmt: skip
    experts = len(spec.moe_layers) * spec.n_experts * sum(projection_slots(spec).values())
    header = min(spec.tensors.values(), key=lambda t: t.offset).offset
    return dense + experts + header + (1 << 20)


# ------------------------------------------------------------------------------ main entry
def _temp_name(dst: Path) -> Path:
    """A fresh name next to ``dst`` for the pack to be built under, then renamed into place.
    The name comes first and the directory is made under it inside the `try` that removes it,
    so an interrupt at any moment leaves nothing behind."""
    return dst.parent / f"{dst.name}.tmp-{secrets.token_hex(6)}"


def _check_requantize(spec: ModelSpec, requantize: str | None) -> list[TensorInfo]:
    """The expert tensors `pack_model` re-quantizes to Q4_0 (those of a type it does not
    compute), refused unless ``requantize`` is "q4_0" (then with a loud warning)."""
    if requantize not in (None, "q4_0"):
        raise InvalidArgumentError(f"requantize must be 'q4_0' or None, got {requantize!r}")
    requant_tensors = _requant_tensors(spec)
    if requant_tensors and requantize is None:
        types = sorted({t.ggml_type for t in requant_tensors})
        raise UnsupportedTensorTypeError(
            f"{Path(spec.path).name}: {len(requant_tensors)} expert tensors are of type "
            f"{', '.join(types)} (e.g. {requant_tensors[0].name}), which EStream does not compute; "
            f"supported expert types: {', '.join(EXPERT_TILE_FORMATS)}. Pack with --requantize "
            "q4_0 to re-quantize them to Q4_0 (double quantization, less accurate)"
        )
    if requant_tensors:
        _warn_requant(spec, requant_tensors)
    return requant_tensors


def _write_data(
    spec: ModelSpec,
    tmp: Path,
    dense_plan: list[tuple[Any, str]],
    orders: Any,
    chunk_bytes: int,
    layer_buffer_bytes: int,
    progress: bool,
) -> tuple[dict[str, DenseEntry], list[LayerEntry], int, int, str]:
    """dense.bin and experts.bin of a pack in ``tmp``, in one pass over the source in file
    order: the dense entries, the MoE layers, dense.bin's and experts.bin's sizes and the
    source's sha256."""
    dense_total = sum(_dense_nbytes(i, f) for i, f in dense_plan)
    bar = _Progress(dense_total + spec.expert_bytes, f"packing {Path(spec.path).name}", progress)
    formats = dict((info.name, fmt) for info, fmt in dense_plan)
    in_file_order = sorted(spec.tensors.values(), key=lambda t: t.offset)
    dense_entries: dict[str, DenseEntry] = {}
    pending: dict[int, dict[str, Any]] = {}  # MoE layer -> projection -> [E, rows, rb]
    layers: list[LayerEntry] = []
    with TensorReader(spec.path) as reader, open(tmp / DENSE_FILE, "wb") as fh:
        layer_bytes = max(
            sum(spec.expert_tensor(la, j).nbytes for j in EXPERT_PROJECTIONS)
            for la in spec.moe_layers
        )
        buffer_layers = layer_bytes <= layer_buffer_bytes
        source = _SourcePass(reader, spec.file_bytes, sequential=buffer_layers)
        writer = _ChunkWriter(tmp / EXPERTS_FILE)
        try:
            for k, info in enumerate(in_file_order):
                for ahead in in_file_order[k + 1 : k + 3]:  # overlap disk reads with work
                    reader.prefetch(ahead)
                parsed = parse_expert_tensor_name(info.name)
                if parsed is None:
                    fmt = formats[info.name]
                    offset = _pad_file(fh)
                    crc = _write_dense_tensor(source, info, fmt, fh, chunk_bytes)
                    nbytes = fh.tell() - offset
                    assert nbytes == _dense_nbytes(info, fmt), info.name
                    dense_entries[info.name] = DenseEntry(
                        info.name, offset, nbytes, fmt, info.shape, crc
                    )
                    bar.update(nbytes)
                    continue
                layer, proj = parsed
                if buffer_layers:  # the whole stacked tensor, read once, in file order
                    buf = np.empty((*info.shape[:-1], info.row_bytes), dtype=np.uint8)
                    pending.setdefault(layer, {})[proj] = source.read(info.offset, buf)
                else:  # one expert at a time, when its record is assembled
                    pending.setdefault(layer, {})[proj] = _ExpertRows(reader, info)
                if len(pending[layer]) == len(EXPERT_PROJECTIONS):
                    layers.append(
                        _write_layer(
                            pending.pop(layer), spec, layer, orders[layer], writer,
                            chunk_bytes, bar,
                        )
                    )  # fmt: skip
            dense_bytes = _pad_file(fh)
            sha256 = source.sha256()
        finally:
            try:
                writer.close()
            finally:
                source.close()
        experts_bytes = writer.position
        assert experts_bytes == (tmp / EXPERTS_FILE).stat().st_size
        assert not pending and len(layers) == len(spec.moe_layers)
        layers = [attrs.evolve(la, checksums=tuple(la.checksums)) for la in layers]
        assert all(len(la.checksums) == la.n_experts for la in layers)
    bar.close()
    return dense_entries, layers, dense_bytes, experts_bytes, sha256


def pack_model(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    order: Any = None,
    force: bool = False,
    progress: bool = True,
    chunk_bytes: int = 32 << 20,
    layer_buffer_bytes: int = 384 << 20,
    requantize: str | None = None,
) -> Manifest:
    """Pack the GGUF MoE model `src` into the directory `dst` (conventionally `NAME.estream`).

    `order`: None (identity storage order), a routing-profile JSON path or dict (hot and
    co-activated experts first, see `load_routing_profile`), or `{layer: [expert ids]}`.
    Refuses to replace an existing `dst` unless `force`. Returns the written manifest.

    Expert tensors keep their type (`EXPERT_TILE_FORMATS`: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4,
    IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS).
    A file with expert tensors of another type is refused (`UnsupportedTensorTypeError`, naming
    them and the supported types) unless `requantize="q4_0"`: then those tensors, and only those, are
    dequantized and re-quantized to Q4_0 (double quantization, with a loud warning).

    Raises `InsufficientDiskSpaceError` before writing anything when `dst`'s filesystem cannot
    hold `planned_pack_bytes(spec)`.

    Memory: a MoE layer's three expert tensors are read whole (one sequential pass over the
    source) when they fit in `layer_buffer_bytes`; bigger layers (e.g. Mixtral-8x7B's ~800 MB)
    are read one expert at a time instead, so peak memory stays bounded either way.
    """
    # long: a third is the docstring; the body is check, write to a temporary, place
    spec = ModelSpec.from_gguf(src)
    dst_path = Path(dst).absolute()
    replacing = _check_target(dst_path, Path(spec.path), force)
    orders, order_summary = _resolve_orders(spec, order)
    dense_plan = [(spec.tensors[n], dense_format(spec.tensors[n])) for n in spec.dense_tensor_names]
    requant_tensors = _check_requantize(spec, requantize)
    requant = bool(requant_tensors)

    check_disk_space(
        dst_path.parent, planned_pack_bytes(spec), f"packing {Path(spec.path).name}"
    )  # the old pack, if any, is removed only once the new one is complete: no credit for it
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(dst_path)
    made: Path | None = tmp  # what the handler below removes (None: nothing made here)
    try:
        try:
            os.mkdir(tmp, 0o777)  # the permissions the umask gives a new directory
        except OSError:
            made = None
            raise
        write_metadata_gguf(spec.path, tmp / MODEL_GGUF)
        dense_entries, layers, dense_bytes, experts_bytes, sha256 = _write_data(
            spec, tmp, dense_plan, orders, chunk_bytes, layer_buffer_bytes, progress
        )
        manifest = Manifest(
            root=tmp,
            arch=spec.arch,
            tile_format="q4_0-t32r4",
            source={
                "file": Path(spec.path).name,
                "bytes": spec.file_bytes,
                "sha256": sha256,
                "expert_type": spec.expert_type,
                "requantized": requant,
                "requantized_tensors": [t.name for t in requant_tensors],
                "order": order_summary,
            },
            spec=spec.summary(),
            dense_file=DENSE_FILE,
            dense=dense_entries,
            experts_file=EXPERTS_FILE,
            experts_bytes=experts_bytes,
            checksum="crc32",
            layers=tuple(layers),
            dense_bytes=dense_bytes,
            model_gguf_bytes=(tmp / MODEL_GGUF).stat().st_size,
            model_gguf_crc32=zlib.crc32((tmp / MODEL_GGUF).read_bytes()),
        )
        for name in (DENSE_FILE, MODEL_GGUF):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        manifest.write(tmp / MANIFEST_NAME)  # last: a pack without it is never valid
        Manifest.from_path(tmp)  # what every reader will check, before it becomes visible
        _place(tmp, dst_path, replacing)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return Manifest.from_path(dst_path)


# ------------------------------------------------------------------------------ the target
_RENAME_NOREPLACE: Final = 1
_RENAME_EXCHANGE: Final = 2


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    """Linux renameat2(2): atomic no-replace rename / exchange (OSError ENOSYS elsewhere)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


def _pack_files(path: Path) -> set[str]:
    """Names a pack directory may hold (so replacing it deletes nothing of the user's)."""
    names = {MANIFEST_NAME, MODEL_GGUF, LOCK_NAME, DENSE_FILE, EXPERTS_FILE}
    try:
        doc = read_manifest_doc(path / MANIFEST_NAME)
        for key in ("dense", "experts"):
            name = doc[key]["file"]
            if isinstance(name, str) and "/" not in name:
                names.add(name)
    except (LayoutError, KeyError, TypeError):
        pass
    return names


def _check_pack_dir(path: Path) -> None:
    """Raise PackTargetError unless `path` is an EStream pack with nothing else in it."""
    if not (path / MANIFEST_NAME).is_file():
        raise PackTargetError(
            f"{path} is a directory but not an EStream pack (no {MANIFEST_NAME}); refusing to "
            "replace it: choose another -o"
        )
    try:
        doc = read_manifest_doc(path / MANIFEST_NAME)
    except LayoutError as e:
        raise PackTargetError(f"{path}: refusing to replace it: {e}") from None
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise PackTargetError(
            f"{path}/{MANIFEST_NAME} is not an EStream manifest; refusing to replace {path}"
        )
    allowed = _pack_files(path)
    extra = []
    for entry in os.scandir(path):
        is_tmp = entry.name.startswith(f".{MANIFEST_NAME}.") and entry.name.endswith(".tmp")
        if (entry.name not in allowed and not is_tmp) or not entry.is_file(follow_symlinks=False):
            extra.append(entry.name)
    if extra:
        raise PackTargetError(
            f"{path} holds {', '.join(sorted(extra)[:3])}{' ...' if len(extra) > 3 else ''}, "
            "which an EStream pack does not have; refusing to replace it (and delete them)"
        )


def _check_target(dst: Path, src: Path, force: bool) -> tuple[int, int] | None:
    """What is at `dst` now: None (nothing), or the (device, inode) of an EStream pack that
    `force` allows replacing. Anything else is refused before any work is done."""
    src_real = os.path.realpath(src)
    dst_real = os.path.realpath(dst)
    if src_real == dst_real or src_real.startswith(dst_real.rstrip("/") + "/"):
        raise PackTargetError(f"the output {dst} would replace the source {src}; choose another -o")
    try:
        st = os.lstat(dst)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise PackTargetError(f"{dst} is a symbolic link; refusing to replace it")
    if not stat.S_ISDIR(st.st_mode):
        raise PackTargetError(
            f"{dst} exists and is not a directory; refusing to replace it: choose another -o"
        )
    _check_pack_dir(dst)  # first: never suggest --force for something it would not replace
    if not force:
        raise PackExistsError(f"{dst} already exists; pass --force to replace it")
    return (st.st_dev, st.st_ino)


def _place(tmp: Path, dst: Path, replacing: tuple[int, int] | None) -> None:
    """Make the finished pack `tmp` visible at `dst` atomically.

    A new target: rename without replacing (a target that appeared meanwhile, e.g. another
    pack's, is left alone and reported). Replacing: exchange the two directories in one step,
    then make sure what came out is the pack checked at the start; if not, swap back."""
    if replacing is None:
        try:
            _renameat2(tmp, dst, _RENAME_NOREPLACE)
        except FileExistsError:
            raise PackTargetError(
                f"{dst} appeared while packing (another estream-pack to the same place?); "
                "left it alone, this pack was not written"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
            if os.path.lexists(dst):  # no renameat2 here: a small window remains
                raise PackTargetError(f"{dst} appeared while packing; left it alone") from None
            os.rename(tmp, dst)
        return
    try:
        _renameat2(tmp, dst, _RENAME_EXCHANGE)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL):
            raise
        old = Path(tempfile.mkdtemp(prefix=dst.name + ".old-", dir=dst.parent))
        os.rename(dst, old / "x")
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
        return
    # `tmp` now holds what was at `dst`
    st = os.lstat(tmp)
    try:
        if (st.st_dev, st.st_ino) != replacing:
            raise PackTargetError(f"{dst} was replaced while packing; left it alone")
        try:  # the same inode may have been reused for a new directory
            _check_pack_dir(tmp)
        except PackTargetError:
            raise PackTargetError(
                f"{dst} was replaced while packing (it is no longer an EStream pack); left it alone"
            ) from None
    except PackTargetError:
        with contextlib.suppress(OSError):
            _renameat2(tmp, dst, _RENAME_EXCHANGE)  # put it back
        # `tmp` holds the new pack again: the caller removes it
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # the old pack


class _ChunkWriter:
    """Writes experts.bin from a background thread, so converting the next chunk overlaps writing
    the previous one (`os.write` releases the GIL).

    Writes use O_DIRECT where the filesystem allows it: every chunk is whole 4096-byte records
    from page-aligned buffers, so the data goes to the device without a kernel copy or a pile of
    dirty page-cache pages (which would otherwise throttle the writer and count against the
    machine's memory). Falls back to buffered writes (e.g. tmpfs). Buffers come from a pool of
    three: the one being filled, the one queued, the one being written.
    """

    def __init__(self, path: Path, *, direct: bool | None = None) -> None:
        if direct is None:  # ESTREAM_PACK_NO_DIRECT=1 forces buffered writes
            direct = os.environ.get("ESTREAM_PACK_NO_DIRECT", "") in ("", "0")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        self._fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                self._fd = -1
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)
        self.position = 0
        self._queue: queue.Queue[tuple[memoryview, list[int], int] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._pool: list[np.ndarray] = []
        self._next = 0
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name="estream-pack-writer", daemon=True)
        t.start()
        return t

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            try:
                n = os.write(self._fd, view[done:])
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                # the filesystem refused O_DIRECT after all: continue buffered
                fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
                self.direct = False
                continue
            if n <= 0:
                raise OSError(errno.EIO, "short write to experts.bin")
            done += n

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                view, checksums, record_bytes = item
                try:
                    for start in range(0, view.nbytes, record_bytes):
                        checksums.append(zlib.crc32(view[start : start + record_bytes]))
                    self._write_all(view)
                except BaseException as e:  # reported by the next submit()/close()
                    self._error = e

    def buffer(self, n_rows: int, row_bytes: int) -> np.ndarray:
        """A zeroed-once, page-aligned `[n_rows, row_bytes]` buffer no pending write is using."""
        if not self._pool or self._pool[0].shape != (n_rows, row_bytes):
            self.drain()
            self._pool = [
                np.frombuffer(mmap.mmap(-1, n_rows * row_bytes), dtype=np.uint8).reshape(
                    n_rows, row_bytes
                )
                for _ in range(3)
            ]
            self._next = 0
        buf = self._pool[self._next]
        self._next = (self._next + 1) % len(self._pool)
        return buf

    def submit(self, records: np.ndarray, checksums: list[int]) -> None:
        """Queue `[n, record_bytes]` records: the writer thread appends each record's crc32 to
        `checksums` (in order), then writes them."""
        if self._error is not None:
            raise self._error
        view = memoryview(records).cast("B")
        self._queue.put((view, checksums, records.shape[1]))
        self.position += view.nbytes

    def drain(self) -> None:
        """Wait until everything submitted is written."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._thread = self._start()

    def close(self) -> None:
        """Finish all writes, fsync and close; re-raises a write error."""
        try:
            self._queue.put(None)
            self._thread.join()
            if self._error is not None:
                raise self._error
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._pool = []


class _ExpertRows:
    """`rows[e]` reads expert `e` of a stacked tensor on demand into a reused buffer."""

    def __init__(self, reader: TensorReader, info: TensorInfo) -> None:
        self.reader = reader
        self.info = info
        self.buf = np.empty((info.shape[1], info.row_bytes), dtype=np.uint8)

    def __getitem__(self, expert: int) -> np.ndarray:
        return self.reader.expert(self.info, expert, out=self.buf)


def _write_layer(
    sources: dict[str, Any],
    spec: ModelSpec,
    layer: int,
    order: list[int],
    out: _ChunkWriter,
    chunk_bytes: int,
    bar: _Progress,
) -> LayerEntry:
    """Write one MoE layer's records from its three stacked expert tensors (raw source rows
    `[E, rows, row_bytes]` in memory): in storage order, a chunk of records at a time."""
    infos = {j: spec.expert_tensor(layer, j) for j in EXPERT_PROJECTIONS}
    slots = projection_slots(spec)
    projections: dict[str, ProjectionEntry] = {}
    off = 0
    for j in EXPERT_PROJECTIONS:
        _, rows, cols = infos[j].shape
        fmt = expert_format(infos[j])
        nbytes = tile_nbytes(rows, cols, fmt)
        padded = slots[j]
        projections[j] = ProjectionEntry(rows, cols, off, nbytes, padded, fmt)
        off += padded
    record_bytes = off
    layer_offset = out.position
    assert layer_offset % PAGE == 0
    n_chunk = max(1, min(len(order), chunk_bytes // record_bytes))
    checksums: list[int] = []
    src_bytes_per_expert = sum(infos[j].nbytes for j in EXPERT_PROJECTIONS) // spec.n_experts
    for c0 in range(0, len(order), n_chunk):
        ids = order[c0 : c0 + n_chunk]
        records = out.buffer(n_chunk, record_bytes)  # padding bytes are zero and stay zero
        for c, expert in enumerate(ids):
            for j in EXPERT_PROJECTIONS:
                p = projections[j]
                raw = sources[j][expert]
                if infos[j].ggml_type not in EXPERT_TILE_FORMATS:  # warned about up front
                    blocks = quantize_q4_0(
                        _dequantize_checked(raw, infos[j], f" (expert {expert})")
                    )
                else:
                    _check_finite(infos[j], f" (expert {expert})", raw=raw)
                    blocks = raw
                pack_tiles(
                    blocks,
                    p.format,
                    out=records[c, p.offset_in_record : p.offset_in_record + p.bytes],
                )
        out.submit(records[: len(ids)], checksums)
        bar.update(len(ids) * src_bytes_per_expert)
    return LayerEntry(
        index=layer,
        n_experts=spec.n_experts,
        order=tuple(order),
        offset=layer_offset,
        record_bytes=record_bytes,
        checksums=checksums,  # type: ignore[arg-type]  # filled by the writer; frozen later
        projections=projections,
    )
