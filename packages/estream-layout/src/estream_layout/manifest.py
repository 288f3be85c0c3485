"""`manifest.json` of a packed model (docs/contracts.md §3): typed, read-only view + writer."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from .errors import PackFormatError

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "PAGE",
    "VERSION",
    "DenseEntry",
    "LayerEntry",
    "Manifest",
    "ProjectionEntry",
    "write_json_atomic",
]

FORMAT: Final = "estream-pack"
VERSION: Final = 1
PAGE: Final = 4096
MANIFEST_NAME: Final = "manifest.json"
MODEL_GGUF: Final = "model.gguf"


@attrs.frozen
class ProjectionEntry:
    """Where one projection (gate, up or down) sits inside an expert record."""

    rows: int
    cols: int
    offset_in_record: int
    bytes: int  # tile_nbytes(rows, cols)
    padded_bytes: int  # bytes rounded up to 4096: the arena slot stride of this plane


@attrs.frozen
class LayerEntry:
    """The expert records of one MoE layer in experts.bin."""

    index: int
    n_experts: int
    order: tuple[int, ...]  # storage position -> expert id
    offset: int  # file offset of storage position 0
    record_bytes: int
    checksums: tuple[int, ...]  # zlib.crc32 of each record, by storage position
    projections: Mapping[str, ProjectionEntry]

    def record_offset(self, position: int) -> int:
        """File offset of the record at a storage position."""
        return self.offset + position * self.record_bytes

    def position_of(self, expert: int) -> int:
        """Storage position of an expert id."""
        return self.order.index(expert)

    @property
    def nbytes(self) -> int:
        return self.n_experts * self.record_bytes


@attrs.frozen
class DenseEntry:
    """One non-expert tensor in dense.bin."""

    name: str
    offset: int
    bytes: int
    format: str  # "q4_0-t32r4" | "q8_0-t32r4" | "f32"
    shape: tuple[int, ...]  # logical numpy shape ([N, K], [H, N, K] or [n])


def _proj(d: Mapping[str, Any]) -> ProjectionEntry:
    return ProjectionEntry(
        rows=int(d["rows"]),
        cols=int(d["cols"]),
        offset_in_record=int(d["offset_in_record"]),
        bytes=int(d["bytes"]),
        padded_bytes=int(d["padded_bytes"]),
    )


@attrs.frozen(eq=False)
class Manifest:
    """A packed model's manifest. `Manifest.from_path(dir)` reads and validates it."""

    root: Path
    arch: str
    tile_format: str
    source: Mapping[str, Any]
    spec: Mapping[str, Any]
    dense_file: str
    dense: Mapping[str, DenseEntry]
    experts_file: str
    experts_bytes: int
    checksum: str
    layers: tuple[LayerEntry, ...]
    config: Mapping[str, Any] | None = None
    profile: Mapping[str, Any] | None = None
    format: str = FORMAT
    version: int = VERSION

    # --------------------------------------------------------------- paths and lookups
    @property
    def experts_path(self) -> Path:
        return self.root / self.experts_file

    @property
    def dense_path(self) -> Path:
        return self.root / self.dense_file

    @property
    def model_gguf_path(self) -> Path:
        return self.root / MODEL_GGUF

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def layer(self, index: int) -> LayerEntry:
        """The entry of MoE layer `index` (a model layer index, not a list position)."""
        for entry in self.layers:
            if entry.index == index:
                return entry
        raise KeyError(f"layer {index} is not a MoE layer of this pack")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(entry.index for entry in self.layers)

    # --------------------------------------------------------------- (de)serialisation
    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Manifest:
        """Read `NAME.estream/manifest.json` (or the manifest file itself)."""
        p = Path(path)
        mpath = p if p.is_file() else p / MANIFEST_NAME
        if not mpath.is_file():
            raise PackFormatError(
                f"{p}: no {MANIFEST_NAME}; not a packed model, or its packing did not finish "
                "(run `estream-pack SRC.gguf -o NAME.estream` again)"
            )
        try:
            data = json.loads(mpath.read_text())
        except (OSError, ValueError) as e:
            raise PackFormatError(f"{mpath}: unreadable manifest ({e})") from None
        return cls.from_dict(data, mpath.parent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], root: str | os.PathLike[str]) -> Manifest:
        if data.get("format") != FORMAT:
            raise PackFormatError(f"manifest format is {data.get('format')!r}, expected {FORMAT!r}")
        if data.get("version") != VERSION:
            raise PackFormatError(
                f"manifest version {data.get('version')!r} is not supported (this estream-layout "
                f"reads version {VERSION}); repack the model"
            )
        try:
            dense = {
                name: DenseEntry(
                    name=name,
                    offset=int(t["offset"]),
                    bytes=int(t["bytes"]),
                    format=str(t["format"]),
                    shape=tuple(int(x) for x in t["shape"]),
                )
                for name, t in data["dense"]["tensors"].items()
            }
            layers = tuple(
                LayerEntry(
                    index=int(layer["index"]),
                    n_experts=int(layer["n_experts"]),
                    order=tuple(int(x) for x in layer["order"]),
                    offset=int(layer["offset"]),
                    record_bytes=int(layer["record_bytes"]),
                    checksums=tuple(int(x) for x in layer["checksums"]),
                    projections={j: _proj(v) for j, v in layer["projections"].items()},
                )
                for layer in data["layers"]
            )
            return cls(
                root=Path(root),
                arch=str(data["arch"]),
                tile_format=str(data["tile_format"]),
                source=dict(data["source"]),
                spec=dict(data["spec"]),
                dense_file=str(data["dense"]["file"]),
                dense=dense,
                experts_file=str(data["experts"]["file"]),
                experts_bytes=int(data["experts"]["bytes"]),
                checksum=str(data["experts"]["checksum"]),
                layers=layers,
                config=data.get("config"),
                profile=data.get("profile"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PackFormatError(f"malformed manifest: {type(e).__name__}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (contracts §3 field names)."""
        return {
            "format": self.format,
            "version": self.version,
            "arch": self.arch,
            "tile_format": self.tile_format,
            "source": dict(self.source),
            "spec": dict(self.spec),
            "dense": {
                "file": self.dense_file,
                "tensors": {
                    n: {
                        "offset": t.offset,
                        "bytes": t.bytes,
                        "format": t.format,
                        "shape": list(t.shape),
                    }
                    for n, t in self.dense.items()
                },
            },
            "experts": {
                "file": self.experts_file,
                "bytes": self.experts_bytes,
                "checksum": self.checksum,
            },
            "layers": [
                {
                    "index": layer.index,
                    "n_experts": layer.n_experts,
                    "order": list(layer.order),
                    "offset": layer.offset,
                    "record_bytes": layer.record_bytes,
                    "checksums": list(layer.checksums),
                    "projections": {j: attrs.asdict(p) for j, p in layer.projections.items()},
                }
                for layer in self.layers
            ],
            "config": None if self.config is None else dict(self.config),
            "profile": None if self.profile is None else dict(self.profile),
        }

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write atomically (temp file + fsync + rename) to `path` or `root/manifest.json`."""
        target = Path(path) if path is not None else self.manifest_path
        write_json_atomic(target, self.to_dict())
        return target


def write_json_atomic(target: Path, doc: Any) -> None:
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
