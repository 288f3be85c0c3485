"""The packed model as the engine sees it: manifest, resident dense weights, expert extents.

Reads the files `estream-layout` writes (see docs/contracts.md). Dense weights are read once
into memory and kept resident; experts are only ever touched through the arena (stream modes) or
read whole into memory (resident mode).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import estream_arena as ea
import estream_htp as htp
from estream_layout import (
    ChecksumError,
    LayoutError,
    Manifest,
    ModelSpec,
    check_pack,
    update_manifest,
)
from estream_layout.manifest import read_manifest_doc
from estream_layout.verify import check_dense_checksums, nonfinite_dense

from .errors import PackError
from .memory import format_bytes

__all__ = [
    "DenseTensor",
    "ExpertLayer",
    "PackedModel",
    "read_gguf_kv",
    "read_whole",
    "save_manifest",
]

#: Bytes per read() of :func:`read_whole`: large enough for the disk's sequential bandwidth,
#: small enough that a Ctrl-C is seen between reads.
READ_CHUNK = 64 << 20


def read_whole(path: str | Path, backend: htp.Backend | None = None) -> np.ndarray:
    """A whole file read into a page-aligned private anonymous mapping advised onto transparent
    huge pages (``estream_arena.private_mapping``, what a private arena plane is), in
    ``READ_CHUNK`` reads; with a ``backend``, into memory its ops read in place
    (`estream_htp.Backend.buffer`: that mapping when they run in this process, shared memory
    the executor maps otherwise).

    ``np.fromfile`` reads into malloc's buffer, which starts 16 bytes past a page boundary. On
    this project's machines, reading 3.4 GiB from the page cache took 1.7-5.4 s into that
    buffer, 0.95-1.3 s into the same buffer page-aligned, 2.6-3.9 s into a page-aligned mapping
    on 4 KiB pages and 0.7-1.8 s into this one. The mapping lives as long as the returned array
    (numpy holds the buffer). Raises OSError from open/read, MemoryError (naming the file and
    the size) when the mapping cannot be made."""
    with open(path, "rb", buffering=0) as f:
        n = os.fstat(f.fileno()).st_size
        try:
            out = (
                _private_pages(n)
                if backend is None
                else backend.buffer(n, np.uint8, private=_private_pages)
            )
        except OSError as exc:  # ENOMEM: more than the process may map (ulimit -v, overcommit)
            raise MemoryError(
                f"{path}: cannot allocate {format_bytes(n)} to read it into memory "
                f"({exc.strerror or exc})"
            ) from exc
        view = memoryview(out).cast("B")
        off = 0
        while off < n:
            got = f.readinto(view[off : off + READ_CHUNK])
            if not got:  # the file shrank while it was read: the caller's size check reports it
                return out[:off]
            off += got
    return out


def _private_pages(n: int) -> np.ndarray:
    return np.frombuffer(ea.private_mapping(n), dtype=np.uint8, count=n)


def read_gguf_kv(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (header only: fast)."""
    from estream_layout.gguf_header import read_header

    try:
        return dict(read_header(path).kv)
    except FileNotFoundError:
        raise PackError(f"{path}: no such file") from None
    except Exception as exc:  # truncated / corrupt header
        raise PackError(f"{path}: not a readable GGUF file ({exc})") from exc


@attrs.frozen
class DenseTensor:
    name: str
    fmt: str  # a dense format of the manifest: q4_0-t32r4, ..., f16-t32r4, bf16-t32r4, f32
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False, repr=False)
    #: f32 matrices only: ``data`` holds the matrix transposed, ``[in, out]``, the layout the
    #: f32 matmul kernel reads (a matrix derived at bind is made so, and needs no transposed
    #: copy); `f32` still gives the ``shape`` ``[out, in]`` matrix, as a transposed view
    in_out: bool = False

    def f32(self) -> np.ndarray:
        if self.fmt != "f32":
            raise PackError(f"{self.name}: expected f32, found {self.fmt}")
        a = self.data.view(np.float32)
        return a.reshape(self.shape[::-1]).T if self.in_out else a.reshape(self.shape)


@attrs.frozen
class ExpertLayer:
    index: int
    n_experts: int
    order: np.ndarray  # storage position -> expert id
    position: np.ndarray  # expert id -> storage position
    offset: int
    record_bytes: int
    proj: dict[str, dict[str, int]]
    checksums: tuple[int, ...] | None
    # tile formats of gate, up, down (the manifest's projection formats)
    formats: tuple[str, str, str] = ("q4_0-t32r4",) * 3

    @property
    def plane_extents(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return tuple(  # type: ignore[return-value]
            (int(self.proj[p]["offset_in_record"]), int(self.proj[p]["padded_bytes"]))
            for p in ("gate", "up", "down")
        )


def _load_manifest(path: Path) -> tuple[dict[str, Any], Manifest]:
    """The manifest as a document (for config/profile updates) and parsed by estream-layout."""
    if not path.is_dir():
        raise PackError(f"{path}: no such packed model (expected a NAME.estream directory)")
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise PackError(
            f"{path}: manifest.json is missing — the pack did not finish; pack the model again"
        )
    try:
        # estream-layout's validator, the same one `estream-pack --verify` runs
        doc = read_manifest_doc(mpath)
        parsed = Manifest.from_dict(doc, path)
    except ChecksumError:
        raise
    except LayoutError as exc:
        raise PackError(str(exc)) from None
    return doc, parsed


def save_manifest(path: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Replace `config` and `profile` of manifest.json with those of `manifest`, under the
    manifest lock (read-modify-write: a concurrent writer's other changes are kept)."""

    def change(doc: dict[str, Any]) -> None:
        for key in ("config", "profile"):
            if key in manifest:
                doc[key] = manifest[key]

    try:
        update_manifest(path, change)
    except LayoutError as exc:
        raise PackError(str(exc)) from None


def update_config(path: str | os.PathLike[str], key: str, value: Any) -> dict[str, Any]:
    """Set `config` or `profile` of a pack's manifest (locked read-modify-write, atomic)."""
    if key not in ("config", "profile"):
        raise ValueError(f"only config and profile may change after packing, not {key!r}")
    try:
        return update_manifest(path, lambda doc: doc.__setitem__(key, value))
    except LayoutError as exc:
        raise PackError(str(exc)) from None


class PackedModel:
    """Manifest + architecture facts + resident dense weights of a packed model.

    ``hparams`` is the `ModelSpec` that estream-layout derived from the source GGUF when it
    packed the model (the manifest's "spec"): the one place architecture facts come from."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.manifest, parsed = _load_manifest(self.path)
        self.parsed = parsed
        # estream-layout's load checks, the ones `estream-pack --verify` runs too: model.gguf's
        # crc32 (a flipped hyper-parameter never computes silently wrong), the spec against
        # model.gguf and the manifest's arch, the MoE layers and every dense tensor's shape
        try:
            self.hparams: ModelSpec = check_pack(parsed)
        except ChecksumError:
            raise
        except LayoutError as exc:
            raise PackError(str(exc)) from None
        self.experts_path = parsed.experts_path
        self.layers: dict[int, ExpertLayer] = {}
        for rec in parsed.layers:
            order = np.asarray(rec.order, dtype=np.int32)
            position = np.empty_like(order)
            position[order] = np.arange(order.size, dtype=np.int32)
            self.layers[rec.index] = ExpertLayer(
                index=rec.index,
                n_experts=rec.n_experts,
                order=order,
                position=position,
                offset=rec.offset,
                record_bytes=rec.record_bytes,
                proj={
                    k: {"offset_in_record": p.offset_in_record, "padded_bytes": p.padded_bytes}
                    for k, p in rec.projections.items()
                },
                checksums=tuple(rec.checksums) or None,
                formats=tuple(rec.projections[k].format for k in ("gate", "up", "down")),  # type: ignore[arg-type]
            )
        # one record shape for every layer (the packer pads projections to the largest); the
        # tile formats may differ per layer and go with each layer's expert ops
        shapes = {(lay.record_bytes, lay.plane_extents) for lay in self.layers.values()}
        if len(shapes) > 1:
            raise PackError("MoE layers with different expert shapes are not supported yet")
        self._dense_index = parsed.dense
        self._dense_path = parsed.dense_path
        self._dense_blob: np.ndarray | None = None

    # -- dense weights ---------------------------------------------------------------------
    def load_dense(self, *, verify: bool = False) -> None:
        """Read dense.bin into memory once (resident for the engine's lifetime).

        Always checks that no weight is NaN/Inf (cheap: f32 tensors and tile scales); with
        `verify`, also every tensor's crc32 (one pass over bytes already in memory)."""
        if self._dense_blob is not None:
            return
        dpath = self._dense_path
        try:
            blob = read_whole(dpath)
        except OSError as exc:
            raise PackError(f"{dpath}: cannot read dense weights ({exc})") from exc
        if blob.size != self.parsed.dense_bytes:
            raise PackError(
                f"{dpath}: {blob.size} bytes, the manifest says {self.parsed.dense_bytes} "
                "(changed while loading?)"
            )
        if verify:
            problems = check_dense_checksums(self.parsed, blob)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ChecksumError(f"{self.path}: {problems[0]}{more}")
        bad = nonfinite_dense(self.parsed, blob)
        if bad:
            raise PackError(f"{self.path}: {bad[0]}; the pack is corrupt, re-pack")
        self._dense_blob = blob

    def has(self, name: str) -> bool:
        return name in self._dense_index

    def dense(self, name: str) -> DenseTensor:
        self.load_dense()
        assert self._dense_blob is not None
        try:
            t = self._dense_index[name]
        except KeyError:
            raise PackError(f"{self.path}: dense tensor {name!r} is missing") from None
        return DenseTensor(
            name=name,
            fmt=t.format,
            shape=tuple(t.shape),
            data=self._dense_blob[t.offset : t.offset + t.bytes],
        )

    @property
    def dense_bytes(self) -> int:
        return 0 if self._dense_blob is None else int(self._dense_blob.nbytes)

    @property
    def dense_blob(self) -> np.ndarray | None:
        """The dense weights in memory (None before `load_dense`): every `dense` tensor's
        data is a view of it."""
        return self._dense_blob

    @property
    def record_bytes(self) -> int:
        return next(iter(self.layers.values())).record_bytes

    @property
    def plane_extents(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return next(iter(self.layers.values())).plane_extents

    @property
    def expert_formats(self) -> tuple[str, str, str]:
        """Tile formats of the first MoE layer's gate, up and down (each layer has its own:
        `ExpertLayer.formats`)."""
        if not self.layers:
            return ("q4_0-t32r4",) * 3
        return next(iter(self.layers.values())).formats

    @property
    def expert_bytes_total(self) -> int:
        return sum(lay.record_bytes * lay.n_experts for lay in self.layers.values())
