"""Verify and inspect packed models.

`verify_pack` validates the manifest exactly as every load does, re-reads every byte of the pack
(crc32 of `model.gguf`, of each dense tensor and of each expert record) and, given the source GGUF, unpacks every tile back to GGML blocks and compares them with the source bit for
bit (re-quantized experts and converted dense tensors are compared with a fresh conversion).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .checks import check_pack
from .errors import ChecksumError, VerifyStoppedError
from .gguf_model import EXPERT_PROJECTIONS, ModelSpec, TensorReader, dequantize_rows
from .manifest import LayerEntry, Manifest
from .pack import _DENSE_PASSTHROUGH, dense_format
from .tiles import MXFP4_MAX_EXPONENT, quantize_q4_0, quantize_q8_0, tile_format, unpack_tiles

__all__ = [
    "VerifyReport",
    "check_dense_checksums",
    "check_record_checksums",
    "format_inspect",
    "inspect_pack",
    "nonfinite_dense",
    "nonfinite_record",
    "verify_checksums",
    "verify_pack",
]


@attrs.frozen
class VerifyReport:
    """Outcome of `verify_pack`: `ok` is true when `problems` is empty."""

    path: str
    checked_records: int
    checked_bytes: int
    compared_with_source: bool
    compared_tensors: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["ok"] = self.ok
        d["problems"] = list(self.problems)
        return d


def check_dense_checksums(m: Manifest, blob: np.ndarray) -> list[str]:
    """crc32 of every dense tensor of an in-memory dense.bin against the manifest."""
    problems = []
    for t in m.dense.values():
        if zlib.crc32(blob[t.offset : t.offset + t.bytes]) != t.crc32:
            problems.append(
                f"{m.dense_file}: checksum mismatch in dense tensor {t.name}; the file is "
                "corrupt or from another model, re-pack"
            )
    return problems


def check_record_checksums(m: Manifest, pool: np.ndarray) -> list[str]:
    """crc32 of every expert record of an in-memory experts.bin against the manifest."""
    problems = []
    for layer in m.layers:
        for pos in range(layer.n_experts):
            start = layer.record_offset(pos)
            if zlib.crc32(pool[start : start + layer.record_bytes]) != layer.checksums[pos]:
                problems.append(_record_problem(m, layer.index, pos, layer.order[pos]))
    return problems


def _record_problem(m: Manifest, layer: int, pos: int, expert: int) -> str:
    return (
        f"{m.experts_file}: layer {layer}: checksum mismatch at storage position {pos} "
        f"(expert {expert}); the file is corrupt, re-pack"
    )


def nonfinite_dense(m: Manifest, blob: np.ndarray) -> list[str]:
    """Dense tensors of an in-memory dense.bin with NaN/Inf values (f32, f16-t32r4, bf16-t32r4)
    or block scales (other tiled formats: the first 64 bytes of every tile are its 32 fp16 row
    scales). Cheap (it reads the float tensors and ~11% of the quantized ones) and catches what a crc32 cannot be asked for on every
    load: a weight that would turn activations into NaN, which int8 activations then hide."""
    out = []
    for t in m.dense.values():
        buf = blob[t.offset : t.offset + t.bytes]
        if not _finite(buf, _tile_bytes(t.format), t.format):
            out.append(_dense_nan_problem(m, t.name))
    return out


def _tile_bytes(fmt: str) -> int:
    """Bytes of one tile of a tiled format; 0 for f32."""
    return 0 if fmt == "f32" else tile_format(fmt).tile_bytes


def _finite(buf: Any, tile: int, fmt: str) -> bool:
    """Whether `buf` (whole tiles of `tile` bytes of format `fmt`, or float32 values when `tile`
    is 0) holds only finite weights: every f32 value, or the fp16 row scales at the start of
    every tile (32 `d`; q4_k-t32r4 has 32 `dmin` after them), or for mxfp4-t32r4 the 32 E8M0
    exponent bytes, each at most `MXFP4_MAX_EXPONENT`, or every 16-bit value of f16-t32r4 /
    bf16-t32r4 tiles."""
    a = np.frombuffer(buf, dtype=np.uint8)
    if not tile:
        return bool(np.isfinite(a.view(np.float32)).all())
    if fmt == "mxfp4-t32r4":
        return bool((a.reshape(-1, tile)[:, :32] <= MXFP4_MAX_EXPONENT).all())
    if fmt == "f16-t32r4":  # every value (no scales)
        return bool(np.isfinite(a.view(np.float16)).all())
    if fmt == "bf16-t32r4":  # every value: exponent bits all ones is Inf or NaN
        return bool(((a.view("<u2") & 0x7F80) != 0x7F80).all())
    floats = _FP16_HEADER.get(fmt, 64)
    return bool(np.isfinite(a.reshape(-1, tile)[:, :floats].copy().view(np.float16)).all())


# Bytes of fp16 row scales at the start of a tile, per tile format (docs/format.md).
_FP16_HEADER = {"q4_k-t32r4": 128, "q5_k-t32r4": 128, "q4_1-t32r4": 128, "q5_1-t32r4": 128}


def _dense_nan_problem(m: Manifest, name: str) -> str:
    return f"{m.dense_file}: dense tensor {name} holds NaN or infinite values"


def nonfinite_record(m: Manifest, layer: LayerEntry, record: Any) -> list[str]:
    """The projections of one expert record (bytes of `layer.record_bytes`) whose tiles hold a
    NaN or infinite fp16 scale: a weight that turns every activation it meets into NaN."""
    out = []
    for j, p in layer.projections.items():
        body = record[p.offset_in_record : p.offset_in_record + p.bytes]
        if not _finite(body, tile_format(p.format).tile_bytes, p.format):
            out.append(j)
    return out


def verify_checksums(
    m: Manifest, problems: list[str], stop: Callable[[], bool] | None = None
) -> tuple[int, int]:
    """Read every byte of the pack and compare it with the manifest's checksums (model.gguf,
    every dense tensor, every expert record); appends what differs to `problems`. Returns
    (expert records, bytes) checked. Reads in bounded chunks: memory does not grow with the
    model. ``stop``: asked before each chunk and record; when it says True the check raises
    VerifyStoppedError at once (another thread ending a check it no longer needs)."""

    def go_on() -> None:
        if stop is not None and stop():
            raise VerifyStoppedError(f"{m.root}: the check was stopped before it read every byte")

    n_bytes = 0
    data = m.model_gguf_path.read_bytes()
    n_bytes += len(data)
    if zlib.crc32(data) != m.model_gguf_crc32:
        problems.append(
            "model.gguf: checksum mismatch; the metadata is corrupt or from another model, re-pack"
        )
    del data
    with open(m.dense_path, "rb") as fh:
        for t in sorted(m.dense.values(), key=lambda t: t.offset):
            fh.seek(t.offset)
            tile = _tile_bytes(t.format)
            step = max(1, (16 << 20) // tile) * tile if tile else 16 << 20  # whole tiles
            crc, left, finite = 0, t.bytes, True
            while left:
                go_on()
                chunk = fh.read(min(left, step))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
                finite = finite and (
                    len(chunk) % (tile or 4) != 0 or _finite(chunk, tile, t.format)
                )
            n_bytes += t.bytes
            if left or crc != t.crc32:
                problems.append(
                    f"{m.dense_file}: checksum mismatch in dense tensor {t.name}; the file is "
                    "corrupt or from another model, re-pack"
                )
            elif not finite:  # what every load refuses (the crc only says the bytes are intact)
                problems.append(_dense_nan_problem(m, t.name))
    n_records = 0
    with open(m.experts_path, "rb") as fh:
        for layer in m.layers:
            fh.seek(layer.offset)
            for pos in range(layer.n_experts):
                go_on()
                rec = fh.read(layer.record_bytes)
                if len(rec) != layer.record_bytes:
                    problems.append(f"{m.experts_file}: layer {layer.index}: record {pos} is short")
                    break
                if zlib.crc32(rec) != layer.checksums[pos]:
                    problems.append(_record_problem(m, layer.index, pos, layer.order[pos]))
                elif bad := nonfinite_record(m, layer, rec):
                    problems.append(
                        f"{m.experts_file}: layer {layer.index}: expert {layer.order[pos]} "
                        f"(storage position {pos}) has NaN or infinite block scales in "
                        f"{', '.join(bad)}; the pack is corrupt, re-pack"
                    )
                n_records += 1
                n_bytes += len(rec)
    return n_records, n_bytes


def verify_pack(
    path: str | os.PathLike[str],
    against: str | os.PathLike[str] | None = None,
    *,
    stop: Callable[[], bool] | None = None,
) -> VerifyReport:
    """Check a packed model: the manifest validation every load runs (types, ranges, sizes
    against the files, its own sha256), then every checksum (model.gguf, each dense tensor,
    each expert record), and (with `against`, the source GGUF) that every packed tile unpacks
    to the source's blocks bit for bit. Every check a load runs comes first (`check_pack`): a
    manifest or pack that would not load raises PackFormatError (or ChecksumError) with the
    message the load gives; checksum differences, NaN/infinite weights (which a load refuses
    too) and source differences are reported in `problems`. ``stop``: see `verify_checksums`
    (the source comparison is not stopped)."""
    m = Manifest.from_path(path)
    with contextlib.suppress(ChecksumError):  # model.gguf's: reported below with the others
        check_pack(m)
    problems: list[str] = []
    n_records, n_bytes = verify_checksums(m, problems, stop)
    compared = 0
    if against is not None and not problems:
        compared = _compare_with_source(m, Path(against), problems)
    return VerifyReport(
        path=str(m.root),
        checked_records=n_records,
        checked_bytes=n_bytes,
        compared_with_source=against is not None,
        compared_tensors=compared,
        problems=tuple(problems),
    )


def _compare_with_source(m: Manifest, src: Path, problems: list[str]) -> int:
    spec = ModelSpec.from_gguf(src)
    if spec.file_bytes != m.source.get("bytes"):
        problems.append(
            f"{src} has {spec.file_bytes} bytes but the pack was made from a "
            f"{m.source.get('bytes')}-byte file"
        )
        return 0
    compared = 0
    experts = np.memmap(m.experts_path, dtype=np.uint8, mode="r") if m.experts_bytes else None
    dense = np.memmap(m.dense_path, dtype=np.uint8, mode="r")
    with TensorReader(src) as reader:
        for layer in m.layers:
            for j in EXPERT_PROJECTIONS:
                info = spec.expert_tensor(layer.index, j)
                p = layer.projections[j]
                for pos, expert in enumerate(layer.order):
                    start = layer.record_offset(pos) + p.offset_in_record
                    assert experts is not None
                    got = unpack_tiles(experts[start : start + p.bytes], p.rows, p.cols, p.format)
                    raw = reader.expert(info, expert)
                    want = (
                        raw
                        if tile_format(p.format).ggml_type.name == info.ggml_type
                        else quantize_q4_0(dequantize_rows(raw, info))
                    )
                    if not np.array_equal(got, want):
                        problems.append(
                            f"layer {layer.index} expert {expert} {j}: packed blocks differ from "
                            "the source"
                        )
                compared += 1
        for name, t in m.dense.items():
            info = spec.tensors.get(name)
            if info is None:
                problems.append(f"dense tensor {name} is not in {src}")
                continue
            if dense_format(info) != t.format:
                problems.append(
                    f"dense tensor {name}: format {t.format}, expected {dense_format(info)}"
                )
                continue
            raw = reader.rows(info, 0, info.n_rows).reshape(*info.shape[:-1], info.row_bytes)
            buf = dense[t.offset : t.offset + t.bytes]
            if t.format == "f32":
                want = dequantize_rows(raw.reshape(-1, info.row_bytes), info).reshape(-1)
                ok = np.array_equal(buf.view(np.float32), want.astype(np.float32))
            else:
                got = unpack_tiles(buf, info.shape[-2], info.shape[-1], t.format)
                if _DENSE_PASSTHROUGH.get(info.qtype) == t.format:
                    want = raw
                else:
                    want = quantize_q8_0(dequantize_rows(raw, info))
                ok = np.array_equal(got.reshape(want.shape), want)
            if not ok:
                problems.append(f"dense tensor {name} differs from the source")
            compared += 1
    return compared


def inspect_pack(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able summary of a packed model (what `estream-pack --inspect --json` prints)."""
    m = Manifest.from_path(path)
    formats: dict[str, dict[str, int]] = {}
    for t in m.dense.values():
        f = formats.setdefault(t.format, {"tensors": 0, "bytes": 0})
        f["tensors"] += 1
        f["bytes"] += t.bytes
    dense_size = m.dense_path.stat().st_size if m.dense_path.is_file() else 0
    spec = m.spec
    first = m.layers[0] if m.layers else None
    return {
        "path": str(m.root),
        "format": m.format,
        "version": m.version,
        "arch": m.arch,
        "family": spec.get("family"),
        "name": spec.get("name"),
        "source": dict(m.source),
        "n_layers": spec.get("n_layers"),
        "moe_layers": list(m.moe_layers),
        "n_experts": spec.get("n_experts"),
        "n_experts_used": spec.get("n_experts_used"),
        "n_embd": spec.get("n_embd"),
        "n_ff_exp": spec.get("n_ff_exp"),
        "n_vocab": spec.get("n_vocab"),
        "experts_bytes": m.experts_bytes,
        "dense_bytes": dense_size,
        "record_bytes": first.record_bytes if first else 0,
        "projections": {j: attrs.asdict(p) for j, p in first.projections.items()} if first else {},
        "dense_formats": formats,
        "expert_formats": [
            {"layer": la.index, **{j: p.format for j, p in la.projections.items()}}
            for la in m.layers
        ],
        "reordered_layers": [la.index for la in m.layers if list(la.order) != sorted(la.order)],
        "config": m.config,
    }


def _format_mix(rows: list[dict[str, Any]]) -> list[str]:
    """One line per distinct (gate, up, down) tile-format mix, with the MoE layers that have it."""
    mixes: dict[tuple[str, ...], list[int]] = {}
    for r in rows:
        mixes.setdefault(tuple(r[j] for j in EXPERT_PROJECTIONS), []).append(r["layer"])
    return [
        "  expert formats: "
        + " ".join(f"{j}={f}" for j, f in zip(EXPERT_PROJECTIONS, mix))
        + f" (layers {layers})"
        for mix, layers in mixes.items()
    ]


def format_inspect(info: dict[str, Any]) -> str:
    """Human-readable rendering of `inspect_pack`'s dict."""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    lines = [
        f"{info['path']}",
        f"  {info['format']} v{info['version']}  arch={info['arch']} ({info['family']})  "
        f"name={info['name']!r}",
        f"  source: {info['source'].get('file')} ({mib(info['source'].get('bytes', 0))}), "
        f"experts {info['source'].get('expert_type')}"
        + ("  [RE-QUANTIZED]" if info["source"].get("requantized") else ""),
        f"  layers: {info['n_layers']} ({len(info['moe_layers'])} MoE: {info['moe_layers']})",
        f"  experts: {info['n_experts']} per layer, top-{info['n_experts_used']}, "
        f"d={info['n_embd']}, ff={info['n_ff_exp']}, vocab={info['n_vocab']}",
        f"  experts.bin: {mib(info['experts_bytes'])}, record {info['record_bytes']:,} B "
        + " ".join(
            f"{j}={p['rows']}x{p['cols']}@{p['offset_in_record']}"
            for j, p in info["projections"].items()
        ),
        *_format_mix(info.get("expert_formats", [])),
        f"  dense.bin: {mib(info['dense_bytes'])} "
        + ", ".join(f"{k}: {v['tensors']} tensors" for k, v in info["dense_formats"].items()),
        f"  storage order: {'profiled in layers ' + str(info['reordered_layers']) if info['reordered_layers'] else 'identity'}",
        f"  config: {info['config'] if info['config'] else 'not configured'}",
    ]
    return "\n".join(lines)
