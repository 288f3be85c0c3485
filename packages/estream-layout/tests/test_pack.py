from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from estream_layout import (
    ARCHES,
    InvalidArgumentError,
    Manifest,
    ModelSpec,
    PackExistsError,
    PackFormatError,
    ProfileError,
    UnsupportedTensorTypeError,
    pack_model,
    storage_order,
    synth_model,
    verify_pack,
)
from estream_layout import pack as pack_mod
from estream_layout.manifest import VERSION
from estream_layout.tiles import dequantize_blocks, dequantize_tiles, tile_nbytes, unpack_tiles

PAGE = 4096


def ref_tiles(rows: np.ndarray, bs: int, n_groups: int, pad: int) -> bytes:
    """Tile-major bytes of one matrix of GGML blocks, per tile (independent of tiles.py)."""
    n, rb = rows.shape
    kb = rb // bs
    n_pad = -(-n // 32) * 32
    full = np.zeros((n_pad, kb, bs), np.uint8)
    full[:, :, 2:] = pad
    full[:n] = rows.reshape(n, kb, bs)
    out = []
    for i in range(n_pad // 32):
        for j in range(kb):
            tile = full[32 * i : 32 * i + 32, j]  # [32 rows, bs]
            q = tile[:, 2:].reshape(32, n_groups, 4).transpose(1, 0, 2)
            out.append(tile[:, :2].tobytes() + q.tobytes())
    return b"".join(out)


@pytest.fixture(scope="module")
def packed(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("packed")
    return {
        arch: pack_model(src, d / f"{arch}.estream", progress=False).root
        for arch, src in tiny_models.items()
    }


@pytest.mark.parametrize("arch", ARCHES)
def test_verify_against_source(
    arch: str, packed: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    report = verify_pack(packed[arch], against=tiny_models[arch])
    assert report.ok, report.problems
    assert report.compared_with_source and report.compared_tensors > 0
    assert report.checked_records == sum(
        la.n_experts for la in Manifest.from_path(packed[arch]).layers
    )


@pytest.mark.parametrize("arch", ARCHES)
def test_layout_read_independently(
    arch: str, packed: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    """Read experts.bin / dense.bin with the raw manifest JSON and gguf's own reader only."""
    root = packed[arch]
    doc = json.loads((root / "manifest.json").read_text())
    assert doc["format"] == "estream-pack" and doc["version"] == VERSION
    assert doc["tile_format"] == "q4_0-t32r4" and doc["config"] is None and doc["profile"] is None
    assert doc["experts"]["checksum"] == "crc32" and doc["experts"]["file"] == "experts.bin"
    src_bytes = tiny_models[arch].read_bytes()
    assert doc["source"]["bytes"] == len(src_bytes)
    import hashlib

    assert doc["source"]["sha256"] == hashlib.sha256(src_bytes).hexdigest()
    reader = gguf.GGUFReader(tiny_models[arch])
    src = {t.name: np.asarray(t.data) for t in reader.tensors}
    experts = (root / "experts.bin").read_bytes()
    assert len(experts) == doc["experts"]["bytes"]
    for layer in doc["layers"]:
        i = layer["index"]
        assert layer["offset"] % PAGE == 0 and layer["record_bytes"] % PAGE == 0
        gate = src[f"blk.{i}.ffn_gate_exps.weight"]
        d, ff = gate.shape[2] // 18 * 32, gate.shape[1]
        want_proj = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
        off = 0
        for j in ("gate", "up", "down"):
            p = layer["projections"][j]
            assert (p["rows"], p["cols"]) == want_proj[j]
            assert p["offset_in_record"] == off and p["padded_bytes"] % PAGE == 0
            assert p["bytes"] == -(-p["rows"] // 32) * (p["cols"] // 32) * 576
            off += p["padded_bytes"]
        assert off == layer["record_bytes"]
        for pos, e in enumerate(layer["order"]):
            start = layer["offset"] + pos * layer["record_bytes"]
            rec = experts[start : start + layer["record_bytes"]]
            assert zlib.crc32(rec) == layer["checksums"][pos]
            for j in ("gate", "up", "down"):
                p = layer["projections"][j]
                blocks = src[f"blk.{i}.ffn_{j}_exps.weight"][e]
                body = rec[p["offset_in_record"] : p["offset_in_record"] + p["bytes"]]
                assert body == ref_tiles(blocks, 18, 4, 0x88)
                pad = rec[
                    p["offset_in_record"] + p["bytes"] : p["offset_in_record"] + p["padded_bytes"]
                ]
                assert pad == b"\0" * len(pad)
    dense = (root / "dense.bin").read_bytes()
    types = {t.name: t.tensor_type for t in reader.tensors}
    for name, t in doc["dense"]["tensors"].items():
        assert t["offset"] % PAGE == 0
        body = dense[t["offset"] : t["offset"] + t["bytes"]]
        data = src[name]
        if t["format"] == "f32":
            want = np.asarray(data, np.float32).reshape(-1)
            assert np.array_equal(np.frombuffer(body, np.float32), want)
        elif t["format"] == "q4_0-t32r4":
            assert types[name] == gguf.GGMLQuantizationType.Q4_0
            rows = data.reshape(-1, *data.shape[-2:]) if data.ndim == 3 else data[None]
            assert body == b"".join(ref_tiles(m, 18, 4, 0x88) for m in rows)
            assert t["shape"] == [*data.shape[:-1], data.shape[-1] // 18 * 32]
        else:
            assert t["format"] == "q8_0-t32r4" and types[name] == gguf.GGMLQuantizationType.Q8_0
            assert body == ref_tiles(data, 34, 8, 0)
    # every tensor of the source is in exactly one place
    expert_names = {n for n in src if "_exps.weight" in n}  # gpt-oss's _exps.bias are dense
    assert set(doc["dense"]["tensors"]) == set(src) - expert_names


def test_padded_vocab_rows(packed: dict[str, Path], tiny_models: dict[str, Path]) -> None:
    m = Manifest.from_path(packed["olmoe"])
    t = m.dense["token_embd.weight"]
    assert t.shape == (301, 64) and t.bytes == 10 * 2 * 576  # 301 rows -> 10 row tiles
    reader = gguf.GGUFReader(tiny_models["olmoe"])
    src = next(np.asarray(x.data) for x in reader.tensors if x.name == "token_embd.weight")
    body = np.fromfile(m.dense_path, np.uint8, count=t.bytes, offset=t.offset)
    assert np.array_equal(unpack_tiles(body, 301, 64), src)


def test_model_gguf_has_metadata_only(
    packed: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    meta = gguf.GGUFReader(packed["qwen3moe"] / "model.gguf")
    src = gguf.GGUFReader(tiny_models["qwen3moe"])
    assert len(meta.tensors) == 0
    keys = lambda r: {k for k in r.fields if not k.startswith("GGUF.")}  # noqa: E731
    assert keys(meta) == keys(src)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "qwen3moe.expert_count"):
        assert meta.fields[k].contents() == src.fields[k].contents()


def test_profile_order(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    counts = [5, 90, 1, 40, 40, 0, 7, 3]
    co = np.zeros((8, 8))
    co[1, 6] = co[6, 1] = 50  # 6 fires with the hottest expert
    prof = {
        "layers": {"1": {"counts": counts, "coactivation": co.tolist()}, "0": {"counts": counts}}
    }
    pf = tmp_path / "profile.json"
    pf.write_text(json.dumps(prof))
    src = tiny_models["olmoe"]
    m = pack_model(src, tmp_path / "o.estream", order=pf, progress=False)
    assert m.layer(0).order == (1, 3, 4, 6, 0, 7, 2, 5)  # hottest first, ties by id
    assert m.layer(1).order[:2] == (1, 6)  # co-activated partner next
    assert sorted(m.layer(1).order) == list(range(8))
    assert verify_pack(m.root, against=src).ok
    # the record at position p holds expert order[p]
    reader = gguf.GGUFReader(src)
    gate = next(
        np.asarray(t.data) for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight"
    )
    la = m.layer(0)
    body = np.fromfile(
        m.experts_path, np.uint8, count=la.projections["gate"].bytes, offset=la.record_offset(2)
    )
    assert np.array_equal(unpack_tiles(body, 64, 64), gate[4])


def test_storage_order_properties() -> None:
    assert storage_order([1, 3, 2]) == [1, 2, 0]
    rng = np.random.default_rng(0)
    c = rng.integers(0, 100, 16)
    co = rng.integers(0, 10, (16, 16))
    co = co + co.T
    o = storage_order(c, co)
    assert sorted(o) == list(range(16)) and o[0] == int(np.argmax(c))


@pytest.mark.parametrize(
    "bad",
    [
        {"nolayers": 1},
        {"layers": {"0": {"counts": [1, 2]}}},
        {"layers": {"0": {}}},
        {"layers": {"7": {"counts": [1] * 8}}},
    ],
)
def test_bad_profiles(bad: dict, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ProfileError):
        pack_model(tiny_models["olmoe"], tmp_path / "x.estream", order=bad, progress=False)
    assert not list(tmp_path.iterdir())


def test_refuses_overwrite_then_force(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "m.estream"
    pack_model(tiny_models["mixtral"], dst, progress=False)
    before = (dst / "manifest.json").read_text()
    with pytest.raises(PackExistsError, match="--force"):
        pack_model(tiny_models["olmoe"], dst, progress=False)
    assert (dst / "manifest.json").read_text() == before
    m = pack_model(tiny_models["olmoe"], dst, force=True, progress=False)
    assert m.arch == "olmoe" and sorted(p.name for p in tmp_path.iterdir()) == ["m.estream"]


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failing_pack_leaves_nothing(
    exc: BaseException,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def boom(*a: object, **k: object) -> None:
        calls.append(1)
        raise exc

    monkeypatch.setattr(pack_mod, "_write_layer", boom)
    with pytest.raises(type(exc)):
        pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    assert calls and list(tmp_path.iterdir()) == []


def test_killed_pack_leaves_no_target(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A process killed mid-pack (no cleanup runs) leaves no NAME.estream, only a temp dir."""
    code = (
        "import os, sys\n"
        "from estream_layout import pack as p\n"
        "orig = p._write_layer\n"
        "def die(*a, **k):\n"
        "    orig(*a, **k)\n"
        "    os._exit(9)\n"
        "p._write_layer = die\n"
        "p.pack_model(sys.argv[1], sys.argv[2], progress=False)\n"
    )
    dst = tmp_path / "m.estream"
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_models["olmoe"]), str(dst)], check=False
    )
    assert r.returncode == 9
    assert not dst.exists()
    left = [p.name for p in tmp_path.iterdir()]
    assert all(n.startswith("m.estream.tmp-") for n in left)
    with pytest.raises(PackFormatError, match=r"no manifest\.json"):
        Manifest.from_path(tmp_path / left[0])


@pytest.mark.parametrize("etype", ["F16"])
def test_requantized_experts_warn_loudly(
    etype: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Experts of a type EStream does not compute, packed with requantize="q4_0": a loud
    warning, the manifest says so, and the Q4_0 tiles approximate the source within Q4_0's
    rounding bound (they really are re-quantized)."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type=etype)
    m = pack_model(src, tmp_path / "m.estream", progress=False, requantize="q4_0")
    err = capfd.readouterr().err
    assert "RE-QUANTIZED" in err and etype in err and "double quantization" in err
    assert m.source["requantized"] is True and m.source["expert_type"] == etype
    assert verify_pack(m.root, against=src).ok
    # the packed Q4_0 experts approximate the source weights
    reader = gguf.GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)[3]
    la = m.layer(0)
    p = la.projections["up"]
    body = np.fromfile(
        m.experts_path, np.uint8, count=p.bytes, offset=la.record_offset(3) + p.offset_in_record
    )
    got = dequantize_blocks(unpack_tiles(body, p.rows, p.cols)).astype(np.float64)
    amax = np.abs(w.reshape(-1, 32)).max(axis=1).reshape(p.rows, -1).repeat(32, axis=1)
    assert (np.abs(got - w) <= amax / 8 * 1.01 + 1e-7).all()
    assert np.abs(got - w).max() > 0  # really re-quantized


TILE_OF = {
    "Q4_0": "q4_0-t32r4",
    "Q8_0": "q8_0-t32r4",
    "Q4_K": "q4_k-t32r4",
    "Q5_K": "q5_k-t32r4",
    "Q6_K": "q6_k-t32r4",
    "MXFP4": "mxfp4-t32r4",
    "IQ4_NL": "iq4_nl-t32r4",
    "Q4_1": "q4_1-t32r4",
    "Q5_0": "q5_0-t32r4",
    "Q5_1": "q5_1-t32r4",
    "IQ4_XS": "iq4_xs-t32r4",
}


@pytest.mark.parametrize(
    ("etype", "down"),
    [
        ("Q4_0", None),
        ("Q8_0", None),
        ("Q4_K", "Q6_K"),
        ("Q6_K", None),
        ("Q4_K", "Q8_0"),
        ("MXFP4", None),
        ("MXFP4", "Q8_0"),
        ("Q5_K", "Q6_K"),
        ("IQ4_NL", "Q8_0"),
        ("Q4_1", None),
        ("Q5_0", "Q5_1"),
        ("IQ4_XS", None),
        ("IQ4_XS", "Q6_K"),
    ],
)
def test_source_expert_types_pack_losslessly(
    etype: str, down: str | None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, Q4_1, Q5_0, Q5_1 and IQ4_XS experts (alone, or mixed per projection as Q4_K_M mixes them) are
    re-laid, not re-quantized: no warning, the manifest records the source type and each
    projection's format, and every tile unpacks to the source's blocks."""
    kq = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
    dims = {"n_embd": 256, "n_ff_exp": 256} if etype in kq else {}
    src = synth_model(
        "qwen3moe", "tiny", tmp_path / "m.gguf", expert_type=etype, expert_down_type=down,
        dims=dims,
    )  # fmt: skip
    m = pack_model(src, tmp_path / "m.estream", progress=False)
    assert "RE-QUANTIZED" not in capfd.readouterr().err
    types = sorted({etype, down or etype})
    want_type = types[0] if len(types) == 1 else "mixed:" + ",".join(types)
    assert m.source["expert_type"] == want_type and m.source["requantized"] is False
    doc = json.loads((m.root / "manifest.json").read_text())
    for la in doc["layers"]:
        got = [la["projections"][j]["format"] for j in ("gate", "up", "down")]
        assert got == [TILE_OF[etype], TILE_OF[etype], TILE_OF[down or etype]]
    reader = gguf.GGUFReader(src)
    for la in m.layers:
        for j, p in la.projections.items():
            t = next(t for t in reader.tensors if t.name == f"blk.{la.index}.ffn_{j}_exps.weight")
            raw = np.asarray(t.data)
            assert p.bytes == tile_nbytes(p.rows, p.cols, p.format)
            for pos, e in enumerate(la.order):
                body = np.fromfile(m.experts_path, np.uint8, count=p.bytes,
                                   offset=la.record_offset(pos) + p.offset_in_record)  # fmt: skip
                got = unpack_tiles(body, p.rows, p.cols, p.format)
                assert np.array_equal(got.reshape(-1), raw[e].reshape(-1)), (la.index, j, e)
    assert verify_pack(m.root, against=src).ok


def test_kquant_dense_matrices_pack_as_stored(tmp_path: Path) -> None:
    """Q4_K dense matrices and embedding and a Q6_K output head (a Q4_K_M file's dense part)
    are kept as q4_k / q6_k tiles: the manifest holds each tensor's format, every tile unpacks
    to the source blocks, and verify --against agrees."""
    dims = {"n_embd": 256, "n_ff_exp": 256, "n_head": 4, "head_dim": 64, "n_ff": 256}
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type="Q4_K",
                      expert_down_type="Q6_K", dense_type="Q4_K", output_type="Q6_K",
                      dims=dims)  # fmt: skip
    m = pack_model(src, tmp_path / "m.estream", progress=False)
    reader = gguf.GGUFReader(src)
    want = {
        gguf.GGMLQuantizationType.Q4_K: "q4_k-t32r4",
        gguf.GGMLQuantizationType.Q6_K: "q6_k-t32r4",
    }
    dense = np.fromfile(m.dense_path, np.uint8)
    seen = set()
    for t in reader.tensors:
        if t.name not in m.dense or t.tensor_type not in want:
            continue
        e = m.dense[t.name]
        assert e.format == want[t.tensor_type], t.name
        raw = np.asarray(t.data)
        got = unpack_tiles(dense[e.offset : e.offset + e.bytes], *e.shape[-2:], e.format)
        assert np.array_equal(got.reshape(-1), raw.reshape(-1)), t.name
        seen.add(e.format)
    assert seen == {"q4_k-t32r4", "q6_k-t32r4"}
    assert m.dense["output.weight"].format == "q6_k-t32r4"
    assert m.dense["token_embd.weight"].format == "q4_k-t32r4"
    assert verify_pack(m.root, against=src).ok


def test_unsupported_expert_types_are_refused_by_name(tmp_path: Path) -> None:
    """Without requantize, experts of a type EStream does not compute are refused before
    anything is written: the error names the type, a tensor, the supported types and the
    option; nothing is left next to the target. A bad requantize value is refused too."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type="F16")
    with pytest.raises(UnsupportedTensorTypeError) as e:
        pack_model(src, tmp_path / "m.estream", progress=False)
    msg = str(e.value)
    assert "F16" in msg and "blk.0.ffn_gate_exps.weight" in msg
    supported = "Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS"
    assert supported in msg and "--requantize q4_0" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    with pytest.raises(InvalidArgumentError, match="requantize"):
        pack_model(src, tmp_path / "m.estream", progress=False, requantize="q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_q4_experts_pack_silently(
    tiny_models: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    assert "RE-QUANTIZED" not in capfd.readouterr().err


def test_verify_detects_corruption(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    m = pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    la = m.layers[1]
    with open(m.experts_path, "r+b") as fh:
        fh.seek(la.record_offset(5) + 100)
        b = fh.read(1)
        fh.seek(la.record_offset(5) + 100)
        fh.write(bytes([b[0] ^ 0x01]))
    r = verify_pack(m.root)
    assert not r.ok and any("storage position 5" in p for p in r.problems)
    os.truncate(m.experts_path, m.experts_bytes - 4096)
    with pytest.raises(PackFormatError, match=r"experts.bin: .*truncated"):
        verify_pack(m.root)


def test_verify_detects_wrong_source(
    packed: dict[str, Path], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    other = synth_model("olmoe", "tiny", tmp_path / "other.gguf", seed=99)
    r = verify_pack(packed["olmoe"], against=other)
    assert not r.ok and any("differ" in p for p in r.problems)


def test_direct_and_buffered_writes_agree(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = pack_model(tiny_models["deepseek2"], tmp_path / "a.estream", progress=False)
    monkeypatch.setenv("ESTREAM_PACK_NO_DIRECT", "1")
    b = pack_model(tiny_models["deepseek2"], tmp_path / "b.estream", progress=False)
    assert a.experts_path.read_bytes() == b.experts_path.read_bytes()
    assert a.dense_path.read_bytes() == b.dense_path.read_bytes()
    w = pack_mod._ChunkWriter(tmp_path / "probe.bin")
    assert w.direct is False  # the environment switch is honoured
    w.close()


def test_streaming_mode_for_big_layers_is_identical(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Layers larger than the buffer budget are read expert by expert: same bytes, same digest."""
    src = tiny_models["lfm2moe"]
    a = pack_model(src, tmp_path / "a.estream", progress=False)
    b = pack_model(src, tmp_path / "b.estream", progress=False, layer_buffer_bytes=0)
    assert a.experts_path.read_bytes() == b.experts_path.read_bytes()
    assert a.dense_path.read_bytes() == b.dense_path.read_bytes()
    assert a.source["sha256"] == b.source["sha256"]
    assert [la.checksums for la in a.layers] == [la.checksums for la in b.layers]
    assert verify_pack(b.root, against=src).ok


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_float16_dense_matrices_are_kept_as_stored(tmp_path: Path, dtype: str) -> None:
    """Dense matrices stored as F16 / BF16 are packed as `f16-t32r4` / `bf16-t32r4`: the
    manifest records the format, unpacking the tiles gives the file's bytes back, and the
    tiles' values are gguf-py's dequantization of the GGUF tensor bit for bit (no
    re-quantization); --verify against the source passes."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "k.gguf", dense_type=dtype, output_type=dtype)
    m = pack_model(src, tmp_path / "k.estream", progress=False)
    qtype = gguf.GGMLQuantizationType[dtype]
    fmt = dtype.lower() + "-t32r4"
    reader = gguf.GGUFReader(src)
    n_checked = 0
    for t in reader.tensors:
        if t.tensor_type != qtype or t.name not in m.dense:
            continue
        e = m.dense[t.name]
        assert e.format == fmt, t.name
        raw = np.asarray(t.data).view(np.uint8).reshape(*e.shape[:-1], -1)
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        body = np.fromfile(m.dense_path, np.uint8, count=e.bytes, offset=e.offset)
        assert np.array_equal(unpack_tiles(body, *e.shape, fmt), raw), t.name
        got = dequantize_tiles(body, *e.shape, fmt)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        n_checked += 1
    assert n_checked >= 6
    assert m.source["requantized"] is False
    assert verify_pack(m.root, against=src).ok


@pytest.mark.parametrize("ctype", ["Q8_0", "F16"])
def test_mixed_expert_types_keep_each_type(
    ctype: str, tiny_models: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Quantizer mixes (e.g. Q4_K_M) give some expert tensors another type: a Q8_0 one is kept
    as it is (its projection's format in the manifest, its blocks bit-exact), a type without a
    tile format (F16) alone is re-quantized; Q4_0 ones stay bit-exact."""
    src = tiny_models["olmoe"]
    reader = gguf.GGUFReader(src)
    mixed = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(mixed, "olmoe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    changed = "blk.1.ffn_down_exps.weight"
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == changed:
            f = gguf.quants.dequantize(data, t.tensor_type)
            qt = gguf.GGMLQuantizationType[ctype]
            q = gguf.quants.quantize(f, qt) if ctype == "Q8_0" else f.astype(np.float16)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    spec = ModelSpec.from_gguf(mixed)
    assert spec.expert_type == "mixed:" + ",".join(sorted(["Q4_0", ctype]))
    m = pack_model(mixed, tmp_path / "mixed.estream", progress=False, requantize="q4_0")
    err = capfd.readouterr().err
    formats = {(la.index, j): p.format for la in m.layers for j, p in la.projections.items()}
    if ctype == "Q8_0":
        assert "RE-QUANTIZED" not in err and m.source["requantized"] is False
        assert m.source["requantized_tensors"] == []
        assert formats.pop((1, "down")) == "q8_0-t32r4"
        la = m.layer(1)
        p = la.projections["down"]
        src_t = next(t for t in gguf.GGUFReader(mixed).tensors if t.name == changed)
        src_rows = np.asarray(src_t.data)
        for pos, e in enumerate(la.order):
            body = np.fromfile(m.experts_path, np.uint8, count=p.bytes,
                               offset=la.record_offset(pos) + p.offset_in_record)  # fmt: skip
            got = unpack_tiles(body, p.rows, p.cols, "q8_0-t32r4")
            assert np.array_equal(got.reshape(-1), src_rows[e].reshape(-1))
    else:
        assert "1 of the 6 expert tensors" in err and "RE-QUANTIZED" in err
        assert m.source["requantized_tensors"] == [changed]
    assert set(formats.values()) == {"q4_0-t32r4"}
    assert verify_pack(m.root, against=mixed).ok
    # the Q4_0 tensors of the mixed model pack exactly as in the all-Q4_0 original
    ref = pack_model(src, tmp_path / "ref.estream", progress=False)
    for la, lb in zip(ref.layers, m.layers):
        for j in ("gate", "up", "down"):
            if (la.index, j) == (1, "down"):
                continue
            p = la.projections[j]
            a = np.fromfile(
                ref.experts_path,
                np.uint8,
                count=p.bytes,
                offset=la.record_offset(3) + p.offset_in_record,
            )
            b = np.fromfile(
                m.experts_path,
                np.uint8,
                count=p.bytes,
                offset=lb.record_offset(3) + p.offset_in_record,
            )
            assert np.array_equal(a, b)


def test_o_direct_refused_midway_falls_back(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that accepts O_DIRECT at open but refuses the write (EINVAL): the writer
    switches to buffered writes and the pack is identical."""
    import errno

    ref = pack_model(tiny_models["olmoe"], tmp_path / "ref.estream", progress=False)
    real_write = os.write
    refused = []

    def flaky_write(fd: int, data: object) -> int:
        import fcntl

        if hasattr(os, "O_DIRECT") and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(pack_mod.os, "write", flaky_write)
    m = pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    monkeypatch.undo()
    assert m.experts_path.read_bytes() == ref.experts_path.read_bytes()
    assert verify_pack(m.root).ok
    assert refused or not hasattr(os, "O_DIRECT")


def test_write_error_cleans_up(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error in the writer thread (e.g. ENOSPC) surfaces as OSError; nothing is left."""
    import errno

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pack_mod.os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_progress_off_a_terminal_prints_each_step_once(capsys):
    """Off a terminal, pack progress prints each 10 % step once, in order, as the step crossed
    (uneven chunks that land on 19.6 % and 20.3 % must not both read "20%")."""
    from estream_layout.pack import _Progress

    prog = _Progress(1000, "packing m.gguf", enabled=True)
    for n in (196, 7, 95, 2, 300, 150, 250):
        prog.update(n)
    lines = capsys.readouterr().err.splitlines()
    steps = [int(line.rsplit(" ", 1)[1].rstrip("%")) for line in lines]
    assert steps == sorted(set(steps)), lines
    assert steps[-1] == 100 and all(s % 10 == 0 for s in steps), lines


def test_f32_dense_matrices_stay_f32(tmp_path: Path) -> None:
    """Dense matrices stored as F32 are packed as `f32`: the manifest records the source type
    and dense.bin holds the file's own values bit for bit (no re-quantization)."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "f.gguf", dense_type="F32", output_type="F32")
    m = pack_model(src, tmp_path / "f.estream", progress=False)
    reader = gguf.GGUFReader(src)
    n_checked = 0
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32 or t.name not in m.dense:
            continue
        e = m.dense[t.name]
        assert e.format == "f32", t.name
        body = np.fromfile(m.dense_path, np.float32, count=e.bytes // 4, offset=e.offset)
        assert np.array_equal(body.view(np.uint32), np.asarray(t.data).view(np.uint32).ravel())
        n_checked += len(e.shape) == 2
    assert n_checked >= 6
    assert m.source["requantized"] is False
    assert verify_pack(m.root, against=src).ok


@pytest.mark.parametrize(
    ("ggml_type", "shape", "want"),
    [
        ("F16", (64, 96), "f16-t32r4"),
        ("BF16", (2, 64, 32), "bf16-t32r4"),  # a per-head stack: one tiled matrix per head
        ("F32", (64, 96), "f32"),
        ("F16", (64, 3), "f32"),  # rows not a multiple of 32: not tiled
        ("BF16", (64, 3), "f32"),
        ("Q4_K", (64, 256), "q4_k-t32r4"),
        ("Q2_K", (64, 256), "q8_0-t32r4"),  # no kernel: re-quantized
        ("Q3_K", (64, 256), "q8_0-t32r4"),
        ("F16", (96,), "f32"),  # 1-D
    ],
)
def test_dense_format_of_each_source_type(ggml_type: str, shape: tuple, want: str) -> None:
    """The dense.bin format each source type and shape gets: F16 / BF16 matrices their own
    tiles, F32 `f32`, float matrices with rows not a multiple of 32 `f32`, quantized types
    with a kernel their tiles, the others `q8_0-t32r4`, 1-D tensors `f32`."""
    info = pack_mod.TensorInfo(f"blk.0.attn_q.{ggml_type}", ggml_type, shape, 0, 0)
    assert pack_mod.dense_format(info) == want
