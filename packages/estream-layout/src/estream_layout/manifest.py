"""`manifest.json` of a packed model (docs/contracts.md §3): typed, validated view + writers.

Validation lives here, once, and every reader goes through it: `estream-pack --verify`, the
engine's load (streamed and resident), `inspect`. A manifest is checked field by field (types,
ranges, alignment, `order` a permutation, projections adding up to the record, layers and dense
tensors inside their files and not overlapping), against the files beside it (sizes, names that
stay inside the pack directory) and against its own sha256, so a hand-edited or bit-flipped
manifest is refused with the field named instead of crashing a reader or computing garbage.
Sizes are checked before anything is allocated from them.

Checksums of the *data* (crc32 of every expert record and dense tensor, of `model.gguf`) are
read only by `verify_checksums` (`--verify`): that reads every byte, validation reads none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from .errors import PackFormatError
from .gguf_model import FAMILIES
from .tiles import TILE, tile_nbytes

__all__ = [
    "DENSE_FORMATS",
    "FORMAT",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "MAX_EXPERTS",
    "PAGE",
    "VERSION",
    "DenseEntry",
    "LayerEntry",
    "Manifest",
    "ProjectionEntry",
    "dense_nbytes",
    "manifest_digest",
    "manifest_lock",
    "stream_config_problem",
    "update_manifest",
    "write_json_atomic",
]

FORMAT: Final = "estream-pack"
# 2: per-tensor crc32 of dense.bin, size + crc32 of model.gguf, the manifest's own sha256.
# 3: a tile format per expert projection and layer (native K-quant / Q8_0 experts), the
#    attention pattern (sliding window, NoPE layers) and router input in `spec`.
VERSION: Final = 3
PAGE: Final = 4096
MANIFEST_NAME: Final = "manifest.json"
LOCK_NAME: Final = ".manifest.lock"
MODEL_GGUF: Final = "model.gguf"
DENSE_FORMATS: Final = (
    "q4_0-t32r4", "q8_0-t32r4", "q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "mxfp4-t32r4",
    "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4", "iq4_xs-t32r4", "f16-t32r4",
    "bf16-t32r4", "f32",
)  # fmt: skip
# Tile formats of expert projections (each projection of each layer has its own).
EXPERT_FORMATS: Final = (
    "q4_0-t32r4", "q8_0-t32r4", "q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "mxfp4-t32r4",
    "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4", "iq4_xs-t32r4",
)  # fmt: skip
PROJECTIONS: Final = ("gate", "up", "down")
# Far above any real model (Qwen3-235B has 128 experts per layer); refused before allocating.
MAX_EXPERTS: Final = 1 << 16
_U32: Final = (1 << 32) - 1
_I64: Final = (1 << 63) - 1
# Keys left out of the manifest's own digest: `config` and `profile` are rewritten by
# `estream config` / `estream profile` after packing; everything else is fixed at pack time.
_MUTABLE: Final = ("integrity", "config", "profile")
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@attrs.frozen
class ProjectionEntry:
    """Where one projection (gate, up or down) sits inside an expert record."""

    rows: int
    cols: int
    offset_in_record: int
    bytes: int  # tile_nbytes(rows, cols, format)
    padded_bytes: int  # bytes rounded up to 4096: the arena slot stride of this plane
    format: str = "q4_0-t32r4"  # tile format, one of EXPERT_FORMATS


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
    format: str  # one of DENSE_FORMATS ("q4_0-t32r4", ..., "f16-t32r4", "bf16-t32r4", "f32")
    shape: tuple[int, ...]  # logical numpy shape ([N, K], [H, N, K] or [n])
    crc32: int = 0  # zlib.crc32 of the tensor's bytes


def dense_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a dense tensor of logical `shape` in `fmt` (3-D: one tiled matrix per head)."""
    if fmt == "f32":
        return math.prod(shape) * 4
    n_mats = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return n_mats * tile_nbytes(shape[-2], shape[-1], fmt)


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


# ------------------------------------------------------------------------------ typed access
class _Reader:
    """Typed field access that names the offending field (`layers[3].order`) in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, msg: str) -> PackFormatError:
        return PackFormatError(f"{self.where}: {field}: {msg}")

    def obj(self, v: Any, field: str) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.fail(field, f"expected an object, got {_kind(v)}")
        return v

    def get(self, d: Mapping[str, Any], key: str, field: str) -> Any:
        if key not in d:
            raise self.fail(field, "missing")
        return d[key]

    def integer(self, v: Any, field: str, lo: int = 0, hi: int = _I64) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(field, f"expected an integer, got {_kind(v)}")
        if not lo <= v <= hi:
            raise self.fail(field, f"{v} is out of range [{lo}, {hi}]")
        return v

    def string(self, v: Any, field: str) -> str:
        if not isinstance(v, str):
            raise self.fail(field, f"expected a string, got {_kind(v)}")
        return v

    def array(self, v: Any, field: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"expected a list, got {_kind(v)}")
        return v

    def ints(self, v: Any, field: str, lo: int, hi: int) -> tuple[int, ...]:
        items = self.array(v, field)
        for i, x in enumerate(items):
            self.integer(x, f"{field}[{i}]", lo, hi)
        return tuple(items)

    def file_name(self, v: Any, field: str) -> str:
        name = self.string(v, field)
        if not _NAME_RE.match(name) or name in (".", ".."):
            raise self.fail(field, f"{name!r} is not a plain file name inside the pack")
        return name


def _expert_format(r: _Reader, p: Mapping[str, Any], field: str) -> str:
    """A projection's tile format: one of EXPERT_FORMATS (a manifest without it is from an
    older estream-layout: the model must be packed again)."""
    fmt = r.string(r.get(p, "format", field + ".format"), field + ".format")
    if fmt not in EXPERT_FORMATS:
        raise r.fail(field + ".format", f"{fmt!r}, expected one of {list(EXPERT_FORMATS)}")
    return fmt


def _kind(v: Any) -> str:
    return "null" if v is None else f"{type(v).__name__} {v!r}"[:60]


def manifest_digest(doc: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a manifest document without its mutable parts."""
    fixed = {k: v for k, v in doc.items() if k not in _MUTABLE}
    text = json.dumps(fixed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------ the manifest
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
    dense_bytes: int = 0  # size of dense.bin
    model_gguf_bytes: int = 0
    model_gguf_crc32: int = 0

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
    def from_path(cls, path: str | os.PathLike[str], *, check_files: bool = True) -> Manifest:
        """Read and validate `NAME.estream/manifest.json` (or the manifest file itself),
        including the sizes of the files it describes (`check_files`)."""
        p = Path(path)
        mpath = p if p.is_file() else p / MANIFEST_NAME
        if not mpath.is_file():
            raise PackFormatError(
                f"{p}: no {MANIFEST_NAME}; not a packed model, or its packing did not finish "
                "(run `estream-pack SRC.gguf -o NAME.estream` again)"
            )
        return cls.from_dict(read_manifest_doc(mpath), mpath.parent, check_files=check_files)

    @classmethod
    def from_dict(
        cls, data: Any, root: str | os.PathLike[str], *, check_files: bool = True
    ) -> Manifest:
        """Validate a manifest document (and, with `check_files`, the files beside it)."""
        root = Path(root)
        r = _Reader(str(root / MANIFEST_NAME))
        data = r.obj(data, "document")
        if data.get("format") != FORMAT:
            raise r.fail("format", f"{data.get('format')!r}, expected {FORMAT!r}")
        version = data.get("version")
        if type(version) is not int or version != VERSION:  # 3.0 and true are not 3
            raise r.fail(
                "version",
                f"{data.get('version')!r} is not supported (this estream-layout reads version "
                f"{VERSION}); re-pack the model with `estream-pack SRC.gguf -o DIR --force`",
            )
        m = _parse(r, data, root)
        _validate(r, m)
        # Field checks first (they name the field); the digest then catches any other edit,
        # e.g. a permuted but valid `order`.
        integrity = r.obj(r.get(data, "integrity", "integrity"), "integrity")
        want = r.string(r.get(integrity, "sha256", "integrity.sha256"), "integrity.sha256")
        try:
            got = manifest_digest(data)
        except (TypeError, ValueError) as e:
            raise r.fail("document", f"not canonical JSON ({e})") from None
        if got != want:
            raise PackFormatError(
                f"{root / MANIFEST_NAME}: integrity.sha256 does not match the manifest's content "
                "(edited or corrupted); re-pack the model"
            )
        if check_files:
            _check_files(r, m)
        return m

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (contracts §3 field names), with its `integrity.sha256`."""
        doc: dict[str, Any] = {
            "format": self.format,
            "version": self.version,
            "arch": self.arch,
            "tile_format": self.tile_format,
            "source": dict(self.source),
            "spec": dict(self.spec),
            "model_gguf": {
                "file": MODEL_GGUF,
                "bytes": self.model_gguf_bytes,
                "crc32": self.model_gguf_crc32,
            },
            "dense": {
                "file": self.dense_file,
                "bytes": self.dense_bytes,
                "checksum": "crc32",
                "tensors": {
                    n: {
                        "offset": t.offset,
                        "bytes": t.bytes,
                        "format": t.format,
                        "shape": list(t.shape),
                        "crc32": t.crc32,
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
        doc["integrity"] = {"sha256": manifest_digest(doc)}
        return doc

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write atomically (temp file + fsync + rename) to `path` or `root/manifest.json`."""
        target = Path(path) if path is not None else self.manifest_path
        write_json_atomic(target, self.to_dict())
        return target


def read_manifest_doc(mpath: Path) -> Any:
    """The raw JSON document of a manifest file (a PackFormatError when unreadable)."""
    try:
        size = mpath.stat().st_size
        if size > 256 << 20:  # a real manifest is well under 10 MB
            raise PackFormatError(f"{mpath}: {size} bytes, not a manifest")
        return json.loads(mpath.read_bytes().decode("utf-8"))
    except PackFormatError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise PackFormatError(f"{mpath}: unreadable manifest ({e})") from None


def _parse(r: _Reader, data: Mapping[str, Any], root: Path) -> Manifest:
    # long: the manifest's field validator, one check per field of the format
    g = r.get
    arch = r.string(g(data, "arch", "arch"), "arch")
    if not re.fullmatch(r"[a-z0-9_]+(-[a-z0-9_]+)*", arch):  # GGUF's: "olmoe", "gpt-oss"
        raise r.fail("arch", f"{arch!r} is not an architecture name")
    tile = r.string(g(data, "tile_format", "tile_format"), "tile_format")
    if tile != "q4_0-t32r4":
        raise r.fail("tile_format", f"{tile!r}, expected 'q4_0-t32r4'")
    source = r.obj(g(data, "source", "source"), "source")
    spec = r.obj(g(data, "spec", "spec"), "spec")
    mg = r.obj(g(data, "model_gguf", "model_gguf"), "model_gguf")
    if g(mg, "file", "model_gguf.file") != MODEL_GGUF:
        raise r.fail("model_gguf.file", f"expected {MODEL_GGUF!r}")
    mg_bytes = r.integer(g(mg, "bytes", "model_gguf.bytes"), "model_gguf.bytes", 1)
    mg_crc = r.integer(g(mg, "crc32", "model_gguf.crc32"), "model_gguf.crc32", 0, _U32)

    dd = r.obj(g(data, "dense", "dense"), "dense")
    dense_file = r.file_name(g(dd, "file", "dense.file"), "dense.file")
    dense_bytes = r.integer(g(dd, "bytes", "dense.bytes"), "dense.bytes")
    if g(dd, "checksum", "dense.checksum") != "crc32":
        raise r.fail("dense.checksum", "expected 'crc32'")
    tensors = r.obj(g(dd, "tensors", "dense.tensors"), "dense.tensors")
    dense: dict[str, DenseEntry] = {}
    for name, t in tensors.items():
        f = f"dense.tensors[{name!r}]"
        t = r.obj(t, f)
        fmt = r.string(g(t, "format", f + ".format"), f + ".format")
        if fmt not in DENSE_FORMATS:
            raise r.fail(f + ".format", f"{fmt!r} is not one of {', '.join(DENSE_FORMATS)}")
        shape = r.ints(g(t, "shape", f + ".shape"), f + ".shape", 1, 1 << 31)
        if not (1 if fmt == "f32" else 2) <= len(shape) <= 3:
            raise r.fail(f + ".shape", f"{list(shape)}: a {fmt} tensor has 1 to 3 dimensions "
                         "(2 or 3 when tiled)")  # fmt: skip
        dense[name] = DenseEntry(
            name=name,
            offset=r.integer(g(t, "offset", f + ".offset"), f + ".offset"),
            bytes=r.integer(g(t, "bytes", f + ".bytes"), f + ".bytes"),
            format=fmt,
            shape=shape,
            crc32=r.integer(g(t, "crc32", f + ".crc32"), f + ".crc32", 0, _U32),
        )

    ed = r.obj(g(data, "experts", "experts"), "experts")
    experts_file = r.file_name(g(ed, "file", "experts.file"), "experts.file")
    experts_bytes = r.integer(g(ed, "bytes", "experts.bytes"), "experts.bytes")
    checksum = r.string(g(ed, "checksum", "experts.checksum"), "experts.checksum")
    if checksum != "crc32":
        raise r.fail("experts.checksum", f"{checksum!r}, expected 'crc32'")

    layers: list[LayerEntry] = []
    for i, la in enumerate(r.array(g(data, "layers", "layers"), "layers")):
        f = f"layers[{i}]"
        la = r.obj(la, f)
        n = r.integer(g(la, "n_experts", f + ".n_experts"), f + ".n_experts", 1, MAX_EXPERTS)
        order = r.ints(g(la, "order", f + ".order"), f + ".order", 0, n - 1)
        if len(order) != n:
            raise r.fail(f + ".order", f"{len(order)} entries for n_experts={n}")
        if len(set(order)) != n:
            dup = next(e for e in order if order.count(e) > 1)
            raise r.fail(f + ".order", f"not a permutation of 0..{n - 1} (expert {dup} twice)")
        sums = r.ints(g(la, "checksums", f + ".checksums"), f + ".checksums", 0, _U32)
        if len(sums) != n:
            raise r.fail(f + ".checksums", f"{len(sums)} entries for n_experts={n}")
        pd = r.obj(g(la, "projections", f + ".projections"), f + ".projections")
        if sorted(pd) != sorted(PROJECTIONS):
            raise r.fail(f + ".projections", f"has {sorted(pd)}, expected {list(PROJECTIONS)}")
        projections = {}
        for j in PROJECTIONS:
            pf = f"{f}.projections.{j}"
            p = r.obj(pd[j], pf)
            projections[j] = ProjectionEntry(
                **{
                    k: r.integer(
                        g(p, k, f"{pf}.{k}"), f"{pf}.{k}", 1 if k != "offset_in_record" else 0
                    )
                    for k in ("rows", "cols", "offset_in_record", "bytes", "padded_bytes")
                },
                format=_expert_format(r, p, pf),
            )
        layers.append(
            LayerEntry(
                index=r.integer(g(la, "index", f + ".index"), f + ".index", 0, 1 << 20),
                n_experts=n,
                order=order,
                offset=r.integer(g(la, "offset", f + ".offset"), f + ".offset"),
                record_bytes=r.integer(
                    g(la, "record_bytes", f + ".record_bytes"), f + ".record_bytes", 1
                ),
                checksums=sums,
                projections=projections,
            )
        )
    config = g(data, "config", "config")
    if config is not None:
        config = r.obj(config, "config")
        for k in ("G", "Q", "B"):
            r.integer(g(config, k, f"config.{k}"), f"config.{k}", 1, MAX_EXPERTS)
    profile = g(data, "profile", "profile")
    if profile is not None:
        profile = r.obj(profile, "profile")
    return Manifest(
        root=root,
        arch=arch,
        tile_format=tile,
        source=dict(source),
        spec=dict(spec),
        dense_file=dense_file,
        dense=dense,
        experts_file=experts_file,
        experts_bytes=experts_bytes,
        checksum=checksum,
        layers=tuple(layers),
        config=None if config is None else dict(config),
        profile=None if profile is None else dict(profile),
        version=VERSION,
        dense_bytes=dense_bytes,
        model_gguf_bytes=mg_bytes,
        model_gguf_crc32=mg_crc,
    )


def stream_config_problem(G: int, Q: int, B: int, n_experts: int) -> tuple[str, str] | None:
    """What is wrong with streaming a layer of `n_experts` experts in groups of `G`, `Q` reads
    in flight and `B` arena banks (None when nothing): 1 <= G <= n_experts and
    1 <= Q <= B <= 2 x ceil(n_experts / G), one layer's groups and the next's (what the
    configurator chooses from and what the layer mode uses). Returns (the parameter, why)."""
    if not 1 <= G <= n_experts:
        return "G", f"{G} must be between 1 and n_experts = {n_experts}"
    banks = 2 * -(-n_experts // G)
    if not 1 <= B <= banks:
        return "B", (
            f"{B} must be between 1 and 2 x ceil(n_experts / G) = {banks} banks (one layer's "
            "groups and the next's)"
        )
    if not 1 <= Q <= B:
        return "Q", f"{Q} must be between 1 and B = {B} (a read in flight fills a bank)"
    return None


def _validate(r: _Reader, m: Manifest) -> None:
    """Cross-field checks: everything a reader relies on before it touches a byte."""
    # long: a validator, one cross-field check after another
    spec = m.spec
    family = FAMILIES.get(m.arch)
    if family is None:
        raise r.fail("arch", f"{m.arch!r} is not an architecture estream-layout packs")
    if spec.get("arch") != m.arch or spec.get("family") != family:
        raise r.fail(
            "arch",
            f"{m.arch!r} (a {family} model), but spec.arch is {spec.get('arch')!r} and "
            f"spec.family {spec.get('family')!r}",
        )
    n_layers = r.integer(spec.get("n_layers"), "spec.n_layers", 1, 1 << 20)
    n_embd = r.integer(spec.get("n_embd"), "spec.n_embd", 1, 1 << 24)
    n_experts = r.integer(spec.get("n_experts"), "spec.n_experts", 1, MAX_EXPERTS)
    r.integer(spec.get("n_experts_used"), "spec.n_experts_used", 1, n_experts)
    moe = r.ints(spec.get("moe_layers"), "spec.moe_layers", 0, n_layers - 1)
    if not m.layers:
        raise r.fail("layers", "empty: a pack has at least one MoE layer")
    if tuple(la.index for la in m.layers) != moe:
        raise r.fail(
            "layers",
            f"indices {[la.index for la in m.layers]} differ from spec.moe_layers {list(moe)} "
            "(duplicated, missing or out of order)",
        )
    end = 0
    for i, la in enumerate(m.layers):
        f = f"layers[{i}]"
        if la.n_experts != n_experts:
            raise r.fail(f + ".n_experts", f"{la.n_experts}, spec.n_experts is {n_experts}")
        if la.offset % PAGE:
            raise r.fail(f + ".offset", f"{la.offset} is not a multiple of {PAGE}")
        if la.record_bytes % PAGE:
            raise r.fail(f + ".record_bytes", f"{la.record_bytes} is not a multiple of {PAGE}")
        if la.offset < end:
            raise r.fail(f + ".offset", f"{la.offset} overlaps the previous layer (ends at {end})")
        end = la.offset + la.nbytes
        if end > m.experts_bytes:
            raise r.fail(
                f + ".offset",
                f"the layer's {la.n_experts} records of {la.record_bytes} B end at byte {end}, "
                f"past experts.bytes={m.experts_bytes}",
            )
        off = 0
        gate, up, down = (la.projections[j] for j in PROJECTIONS)
        for j, p in la.projections.items():
            pf = f"{f}.projections.{j}"
            if p.offset_in_record != off:
                raise r.fail(pf + ".offset_in_record", f"{p.offset_in_record}, expected {off}")
            if p.cols % TILE:
                raise r.fail(pf + ".cols", f"{p.cols} is not a multiple of {TILE}")
            if p.bytes != tile_nbytes(p.rows, p.cols, p.format):
                raise r.fail(pf + ".bytes", f"{p.bytes}, a {p.rows}x{p.cols} {p.format} matrix "
                             f"needs {tile_nbytes(p.rows, p.cols, p.format)}")  # fmt: skip
            if p.padded_bytes < _round_up(p.bytes) or p.padded_bytes % PAGE:
                raise r.fail(pf + ".padded_bytes", f"{p.padded_bytes}, expected a multiple of "
                             f"{PAGE} of at least {_round_up(p.bytes)}")  # fmt: skip
            off += p.padded_bytes
        if off != la.record_bytes:
            raise r.fail(f + ".record_bytes", f"{la.record_bytes}, projections add up to {off}")
        if not (gate.rows == up.rows == down.cols and gate.cols == up.cols == down.rows == n_embd):
            raise r.fail(
                f + ".projections",
                f"shapes gate {gate.rows}x{gate.cols}, up {up.rows}x{up.cols}, down "
                f"{down.rows}x{down.cols} do not fit n_embd={n_embd}",
            )
    if end != m.experts_bytes:
        raise r.fail("experts.bytes", f"{m.experts_bytes}, the layers end at byte {end}")
    prev_end, prev = 0, ""
    for t in sorted(m.dense.values(), key=lambda t: t.offset):
        f = f"dense.tensors[{t.name!r}]"
        if t.offset % PAGE:
            raise r.fail(f + ".offset", f"{t.offset} is not a multiple of {PAGE}")
        try:
            need = dense_nbytes(t.format, t.shape)
        except ValueError as e:
            raise r.fail(f + ".shape", f"{list(t.shape)} cannot be {t.format} ({e})") from None
        if t.bytes != need:
            raise r.fail(f + ".bytes", f"{t.bytes}, a {t.format} {list(t.shape)} tensor has {need}")
        if t.offset < prev_end:
            raise r.fail(f + ".offset", f"{t.offset} overlaps {prev} (ends at {prev_end})")
        prev_end, prev = t.offset + t.bytes, t.name
    if prev_end > m.dense_bytes:
        raise r.fail("dense.bytes", f"{m.dense_bytes}, but {prev} ends at byte {prev_end}")
    n_vocab = r.integer(spec.get("n_vocab"), "spec.n_vocab", 1, 1 << 24)
    # Shapes every family shares (the rest differ per architecture and are checked by size).
    fixed = {"output_norm.weight": (n_embd,)}
    for name in m.dense:
        if name.endswith(".ffn_gate_inp.weight"):
            fixed[name] = (n_experts, n_embd)
        elif name in ("token_embd.weight", "output.weight"):
            fixed[name] = (n_vocab, n_embd)
    for name, want in fixed.items():
        t = m.dense.get(name)
        if t is not None and t.shape != want:
            f = f"dense.tensors[{name!r}].shape"
            raise r.fail(f, f"{list(t.shape)}, expected {list(want)} from spec")
    if m.config is not None:
        field, problem = stream_config_problem(
            m.config["G"], m.config["Q"], m.config["B"], n_experts
        ) or (None, None)
        if problem:
            raise r.fail(f"config.{field}", problem)


def _check_files(r: _Reader, m: Manifest) -> None:
    """The files exist, are regular files inside the pack, and have the recorded sizes."""
    root = os.path.realpath(m.root)
    for name, want, field in (
        (MODEL_GGUF, m.model_gguf_bytes, "model_gguf.bytes"),
        (m.dense_file, m.dense_bytes, "dense.bytes"),
        (m.experts_file, m.experts_bytes, "experts.bytes"),
    ):
        path = m.root / name
        real = os.path.realpath(path)
        if os.path.dirname(real) != root:
            raise PackFormatError(f"{path}: resolves to {real}, outside the pack directory")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PackFormatError(
                f"{path}: missing; the pack is incomplete, re-pack the model"
            ) from None
        except OSError as e:
            raise PackFormatError(f"{path}: cannot stat ({e.strerror})") from None
        if not os.path.isfile(path):
            raise PackFormatError(f"{path}: not a regular file")
        if st.st_size != want:
            raise PackFormatError(
                f"{path}: {st.st_size} bytes, the manifest says {want} ({field}); the file "
                "was truncated, extended or replaced: re-pack the model"
            )


# ------------------------------------------------------------------------------ writers
def write_json_atomic(target: Path, doc: Any) -> None:
    """Write JSON to `target` atomically: a uniquely named temporary file beside it (so two
    writers never share one), fsync, rename over the target. The temporary is removed on
    any failure."""
    target = Path(target)
    # the name first, the file made under it inside the `try` that removes it: an interrupt at
    # any moment leaves nothing behind
    tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    made: Path | None = tmp  # what the handler below removes (None: nothing made here)
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            made = None
            raise
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=1, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if made is not None:
            with contextlib.suppress(OSError):
                os.unlink(made)
        raise


@contextlib.contextmanager
def manifest_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive advisory lock (flock on `root/.manifest.lock`) for a read-modify-write."""
    fd = os.open(Path(root) / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_manifest(
    root: str | os.PathLike[str], change: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Read-modify-write `root/manifest.json` under `manifest_lock`: re-reads the current
    document (another writer may have changed it), validates it, applies `change` (which may
    only touch `config` / `profile`), re-validates and writes it atomically."""
    root = Path(root)
    with manifest_lock(root):
        doc = read_manifest_doc(root / MANIFEST_NAME)
        Manifest.from_dict(doc, root, check_files=False)
        change(doc)
        Manifest.from_dict(doc, root, check_files=False)
        write_json_atomic(root / MANIFEST_NAME, doc)
    return doc
