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

from .errors import PackError
from .hparams import HParams, read_gguf_kv

__all__ = ["DenseTensor", "ExpertLayer", "PackedModel", "save_manifest"]


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


def _load_manifest(path: Path) -> dict[str, Any]:
    mpath = path / "manifest.json"
    if not path.is_dir():
        raise PackError(f"{path}: no such packed model (expected a NAME.estream directory)")
    if not mpath.is_file():
        raise PackError(
            f"{path}: manifest.json is missing — the pack did not finish; pack the model again"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackError(f"{mpath}: unreadable manifest ({exc})") from exc
    if manifest.get("format") != "estream-pack":
        raise PackError(f"{mpath}: not an EStream pack (format={manifest.get('format')!r})")
    if manifest.get("tile_format") != "q4_0-t32r4":
        raise PackError(f"{mpath}: unsupported tile format {manifest.get('tile_format')!r}")
    return manifest


def save_manifest(path: str | Path, manifest: dict[str, Any]) -> None:
    """Atomically replace manifest.json (temporary file + rename)."""
    mpath = Path(path) / "manifest.json"
    tmp = mpath.with_name(f".manifest.json.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, mpath)
    finally:
        tmp.unlink(missing_ok=True)


class PackedModel:
    """Manifest + hyper-parameters + resident dense weights of a packed model."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.manifest = _load_manifest(self.path)
        kv = read_gguf_kv(self.path / "model.gguf")
        self.kv = kv
        self.hparams = HParams.from_kv(kv)
        self.experts_path = self.path / self.manifest["experts"]["file"]
        if not self.experts_path.is_file():
            raise PackError(f"{self.experts_path}: missing expert pool file")
        want = int(self.manifest["experts"]["bytes"])
        have = self.experts_path.stat().st_size
        if have != want:
            raise PackError(
                f"{self.experts_path}: {have} bytes, manifest says {want}: the pack is corrupt"
            )
        self.layers: dict[int, ExpertLayer] = {}
        for rec in self.manifest["layers"]:
            order = np.asarray(rec["order"], dtype=np.int32)
            position = np.empty_like(order)
            position[order] = np.arange(order.size, dtype=np.int32)
            self.layers[int(rec["index"])] = ExpertLayer(
                index=int(rec["index"]),
                n_experts=int(rec["n_experts"]),
                order=order,
                position=position,
                offset=int(rec["offset"]),
                record_bytes=int(rec["record_bytes"]),
                proj={k: dict(v) for k, v in rec["projections"].items()},
                checksums=tuple(int(c) for c in rec["checksums"]) if rec.get("checksums") else None,
            )
        shapes = {(lay.record_bytes, lay.plane_extents) for lay in self.layers.values()}
        if len(shapes) > 1:
            raise PackError("MoE layers with different expert shapes are not supported yet")
        self._dense_index = self.manifest["dense"]["tensors"]
        self._dense_blob: np.ndarray | None = None

    # -- dense weights ---------------------------------------------------------------------
    def load_dense(self) -> None:
        """Read dense.bin into memory once (resident for the engine's lifetime)."""
        if self._dense_blob is not None:
            return
        dpath = self.path / self.manifest["dense"]["file"]
        try:
            blob = np.fromfile(dpath, dtype=np.uint8)
        except OSError as exc:
            raise PackError(f"{dpath}: cannot read dense weights ({exc})") from exc
        end = max(
            (int(t["offset"]) + int(t["bytes"]) for t in self._dense_index.values()), default=0
        )
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
        off, nb = int(t["offset"]), int(t["bytes"])
        return DenseTensor(
            name=name,
            fmt=str(t["format"]),
            shape=tuple(int(s) for s in t["shape"]),
            data=self._dense_blob[off : off + nb],
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
