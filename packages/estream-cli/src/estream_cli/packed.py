"""The packed model as the engine sees it: manifest, resident dense weights, expert extents.

Reads the files `estream-layout` writes (see docs/contracts.md). Dense weights are read once
into memory and kept resident; experts are only ever touched through the arena (stream modes) or
read whole into memory (resident mode).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from estream_layout import LayoutError, Manifest, ModelSpec
from estream_layout.manifest import write_json_atomic

from .errors import PackError

__all__ = ["DenseTensor", "ExpertLayer", "PackedModel", "read_gguf_kv", "save_manifest"]


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
    fmt: str  # q4_0-t32r4 | q8_0-t32r4 | f32
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False, repr=False)

    def f32(self) -> np.ndarray:
        if self.fmt != "f32":
            raise PackError(f"{self.name}: expected f32, found {self.fmt}")
        return self.data.view(np.float32).reshape(self.shape)


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
        doc = json.loads(mpath.read_text())
        parsed = Manifest.from_dict(doc, path)
    except (OSError, ValueError) as exc:
        raise PackError(f"{mpath}: unreadable manifest ({exc})") from exc
    except LayoutError as exc:
        raise PackError(f"{mpath}: {exc}") from exc
    if parsed.tile_format != "q4_0-t32r4":
        raise PackError(f"{mpath}: unsupported tile format {parsed.tile_format!r}")
    return doc, parsed


def save_manifest(path: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Atomically replace manifest.json (temporary file + fsync + rename)."""
    write_json_atomic(Path(path) / "manifest.json", manifest)


class PackedModel:
    """Manifest + architecture facts + resident dense weights of a packed model.

    ``hparams`` is the `ModelSpec` that estream-layout derived from the source GGUF when it
    packed the model (the manifest's "spec"): the one place architecture facts come from."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.manifest, parsed = _load_manifest(self.path)
        try:
            self.hparams: ModelSpec = ModelSpec.from_dict(parsed.spec)
        except LayoutError as exc:
            raise PackError(f"{self.path / 'manifest.json'}: {exc}") from None
        if self.hparams.n_ctx <= 0:
            raise PackError(f"{self.path}: the model has no context length (context_length)")
        self.experts_path = parsed.experts_path
        if not self.experts_path.is_file():
            raise PackError(f"{self.experts_path}: missing expert pool file")
        have = self.experts_path.stat().st_size
        if have != parsed.experts_bytes:
            raise PackError(
                f"{self.experts_path}: {have} bytes, manifest says {parsed.experts_bytes}: "
                "the pack is corrupt"
            )
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
            )
        shapes = {(lay.record_bytes, lay.plane_extents) for lay in self.layers.values()}
        if len(shapes) > 1:
            raise PackError("MoE layers with different expert shapes are not supported yet")
        self._dense_index = parsed.dense
        self._dense_path = parsed.dense_path
        self._dense_blob: np.ndarray | None = None

    # -- dense weights ---------------------------------------------------------------------
    def load_dense(self) -> None:
        """Read dense.bin into memory once (resident for the engine's lifetime)."""
        if self._dense_blob is not None:
            return
        dpath = self._dense_path
        try:
            blob = np.fromfile(dpath, dtype=np.uint8)
        except OSError as exc:
            raise PackError(f"{dpath}: cannot read dense weights ({exc})") from exc
        end = max((t.offset + t.bytes for t in self._dense_index.values()), default=0)
        if blob.size < end:
            raise PackError(f"{dpath}: truncated ({blob.size} bytes, need {end})")
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
    def record_bytes(self) -> int:
        return next(iter(self.layers.values())).record_bytes

    @property
    def plane_extents(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return next(iter(self.layers.values())).plane_extents

    @property
    def expert_bytes_total(self) -> int:
        return sum(lay.record_bytes * lay.n_experts for lay in self.layers.values())
