"""`estream-pack --verify` runs every check a load runs (`check_pack`, the finiteness of the
weights) plus the checksums: a pack that a load refuses never verifies as OK, even when its
checksums and digest were rewritten to match. The manifest's `arch` and stored configuration
are validated like every other field."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estream_layout import Manifest, PackFormatError, pack_model, synth_model, verify_pack
from estream_layout.checks import check_pack
from estream_layout.cli import pack_main
from estream_layout.manifest import stream_config_problem, update_manifest
from estream_layout.testing import reseal
from estream_layout.verify import nonfinite_dense


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("loadchecks")
    src = synth_model("olmoe", "tiny", d / "a.gguf", seed=1)
    return pack_model(src, d / "a.estream", progress=False).root


def _copy(pack: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "a.estream"
    shutil.copytree(pack, dst)
    return dst


def _edit_manifest(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest and rewrite its digest (a deliberate edit, or a buggy writer)."""
    doc = json.loads((root / "manifest.json").read_text())
    change(doc)
    (root / "manifest.json").write_text(json.dumps(reseal(doc)))


def _poison_dense(root: Path, name: str) -> None:
    """A NaN in dense tensor `name` (an f32 value, or a tile's first fp16 scale), with the
    tensor's crc32 recomputed: the checksums alone cannot tell."""
    m = Manifest.from_path(root)
    t = m.dense[name]
    blob = bytearray((root / "dense.bin").read_bytes())
    nan = np.array([np.nan], np.float32 if t.format == "f32" else np.float16).tobytes()
    blob[t.offset : t.offset + len(nan)] = nan
    (root / "dense.bin").write_bytes(bytes(blob))
    crc = zlib.crc32(blob[t.offset : t.offset + t.bytes])
    _edit_manifest(root, lambda d: d["dense"]["tensors"][name].__setitem__("crc32", crc))


@pytest.mark.parametrize("name", ["output_norm.weight", "blk.1.attn_q.weight", "output.weight"])
def test_nan_dense_weights_fail_verify_like_a_load(pack: Path, tmp_path: Path, name: str) -> None:
    """NaN in dense.bin with its crc32 recomputed: a load refuses it (`nonfinite_dense`, what
    the engine runs on every load of dense.bin); --verify reports the same message."""
    root = _copy(pack, tmp_path)
    _poison_dense(root, name)
    m = Manifest.from_path(root)
    load_says = nonfinite_dense(m, np.fromfile(root / "dense.bin", np.uint8))
    assert load_says == [f"dense.bin: dense tensor {name} holds NaN or infinite values"]
    report = verify_pack(root)
    assert not report.ok and list(report.problems) == load_says


def test_nan_expert_scales_fail_verify(pack: Path, tmp_path: Path) -> None:
    """A NaN block scale in an expert record, crc32 recomputed: --verify names the layer, the
    expert and the projection."""
    root = _copy(pack, tmp_path)
    m = Manifest.from_path(root)
    la = m.layers[1]
    pos = 3
    p = la.projections["down"]
    at = la.record_offset(pos) + p.offset_in_record + 2 * 5  # row 5's scale of the first tile
    data = bytearray((root / "experts.bin").read_bytes())
    data[at : at + 2] = np.array([np.inf], np.float16).tobytes()
    (root / "experts.bin").write_bytes(bytes(data))
    start = la.record_offset(pos)
    crc = zlib.crc32(data[start : start + la.record_bytes])
    _edit_manifest(root, lambda d: d["layers"][1]["checksums"].__setitem__(pos, crc))
    report = verify_pack(root)
    assert not report.ok
    assert report.problems == (
        f"experts.bin: layer {la.index}: expert {la.order[pos]} (storage position {pos}) has "
        "NaN or infinite block scales in down; the pack is corrupt, re-pack",
    )


def test_a_dense_tensor_missing_from_the_manifest_fails_verify_like_a_load(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense tensor the family needs, removed from the manifest (digest rewritten): the load
    check and --verify refuse it with the same message, and the command says so in one line."""
    root = _copy(pack, tmp_path)
    _edit_manifest(root, lambda d: d["dense"]["tensors"].pop("blk.1.attn_v.weight"))
    m = Manifest.from_path(root)  # the manifest itself is consistent
    with pytest.raises(PackFormatError) as load:
        check_pack(m)
    assert "dense tensor blk.1.attn_v.weight is missing" in str(load.value)
    with pytest.raises(PackFormatError) as verify:
        verify_pack(root)
    assert str(verify.value) == str(load.value)
    assert pack_main(["--verify", str(root)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "attn_v.weight is missing" in lines[0]


def test_a_dense_tensor_of_the_wrong_shape_fails_verify(pack: Path, tmp_path: Path) -> None:
    """A dense tensor whose shape no longer fits the spec (layer 0's attn_k given half its
    rows, its size and the digest consistent with that) is refused before any checksum."""
    root = _copy(pack, tmp_path)

    def change(d: dict[str, Any]) -> None:
        t = d["dense"]["tensors"]
        t["blk.0.attn_k.weight"]["shape"] = [32, 64]
        t["blk.0.attn_k.weight"]["bytes"] = 1152

    _edit_manifest(root, change)
    with pytest.raises(PackFormatError, match=r"attn_k\.weight has shape \[32, 64\], expected"):
        verify_pack(root)


@pytest.mark.parametrize(
    ("arch", "spec_arch", "needle"),
    [
        ("gpt2", "olmoe", "'gpt2' is not an architecture estream-layout packs"),
        ("llama", "olmoe", r"'llama' \(a mixtral model\), but spec\.arch is 'olmoe'"),
        ("qwen3moe", "qwen3moe", r"spec\.arch is 'qwen3moe' and spec\.family 'olmoe'"),
    ],
)
def test_arch_of_another_family_is_refused(
    pack: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arch: str,
    spec_arch: str,
    needle: str,
) -> None:
    """The manifest's arch set to another family (digest recomputed) is refused by validation,
    so --inspect cannot print `arch=gpt2 (olmoe)`."""
    root = _copy(pack, tmp_path)

    def change(d: dict[str, Any]) -> None:
        d["arch"] = arch
        d["spec"]["arch"] = spec_arch

    _edit_manifest(root, change)
    with pytest.raises(PackFormatError, match=needle):
        Manifest.from_path(root)
    assert pack_main(["--inspect", str(root)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(needle, lines[0]), lines


def test_a_consistent_manifest_of_another_family_disagrees_with_model_gguf(
    pack: Path, tmp_path: Path
) -> None:
    """arch, spec.arch and spec.family all changed together (a coherent forgery): model.gguf,
    crc32-checked, still says olmoe, and the load check refuses the pack."""
    root = _copy(pack, tmp_path)

    def change(d: dict[str, Any]) -> None:
        d["arch"] = d["spec"]["arch"] = d["spec"]["family"] = "qwen3moe"
        d["spec"]["qk_norm"] = "head"

    _edit_manifest(root, change)
    m = Manifest.from_path(root)
    with pytest.raises(PackFormatError, match=r"arch is 'qwen3moe', but model\.gguf is a 'olmoe'"):
        check_pack(m)
    with pytest.raises(PackFormatError, match=r"model\.gguf is a 'olmoe' model"):
        verify_pack(root)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"G": 1, "Q": 65536, "B": 65536}, r"config\.B: 65536 must be between 1 and 2 x ceil"),
        ({"G": 2, "Q": 3, "B": 2}, r"config\.Q: 3 must be between 1 and B = 2"),
        ({"G": 9, "Q": 1, "B": 1}, r"config\.G: 9 must be between 1 and n_experts = 8"),
        ({"G": 4, "Q": 2, "B": 5}, r"config\.B: 5 must be between 1 and 2 x ceil\(n_experts / "
                                   r"G\) = 4 banks"),
    ],
)  # fmt: skip
def test_stored_configs_are_bounded_by_the_experts(
    pack: Path, tmp_path: Path, config: dict[str, int], needle: str
) -> None:
    """A stored (G, Q, B) outside 1 <= G <= E, 1 <= Q <= B <= 2 ceil(E / G) fails validation
    (before any loader thread could start), and cannot be written by `update_manifest`."""
    root = _copy(pack, tmp_path)
    with pytest.raises(PackFormatError, match=needle):
        update_manifest(root, lambda d: d.__setitem__("config", config))
    _edit_manifest(root, lambda d: d.__setitem__("config", config))
    with pytest.raises(PackFormatError, match=needle):
        Manifest.from_path(root)


def test_configs_the_configurator_and_the_modes_use_are_accepted(pack: Path) -> None:
    """The bound admits what is used: configurator choices (Q <= B <= ceil(E/G)), the layer
    mode (G = E, Q = B = 2), naive (1, 1, 3), and two concurrent writers' (G, 1, 2)."""
    for g, q, b in ((1, 1, 8), (2, 2, 4), (8, 2, 2), (1, 1, 3), (4, 1, 2), (1, 16, 16)):
        assert stream_config_problem(g, q, b, 8) is None, (g, q, b)
    assert stream_config_problem(1, 1, 17, 8) is not None


@pytest.mark.parametrize(
    ("etype", "at"),
    [("Q8_0", 0), ("Q4_K", 0), ("Q4_K", 64), ("Q6_K", 62)],
    ids=["q8_0-d", "q4_k-d", "q4_k-dmin", "q6_k-d"],
)
def test_nan_expert_scales_of_every_tile_format_fail_verify(
    tmp_path: Path, etype: str, at: int
) -> None:
    """Each expert tile format's fp16 row scales (`d`, and Q4_K's `dmin`) are checked: one set
    to NaN, its record's crc32 recomputed, fails --verify naming the projection; the untouched
    pack verifies (the other header bytes, integers, are never read as floats)."""
    dims = {"n_embd": 256, "n_ff_exp": 256}
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type=etype, dims=dims)
    root = pack_model(src, tmp_path / "m.estream", progress=False).root
    assert verify_pack(root).ok
    m = Manifest.from_path(root)
    la, pos = m.layers[0], 1
    p = la.projections["up"]
    assert p.format == etype.lower() + "-t32r4"
    data = bytearray((root / "experts.bin").read_bytes())
    start = la.record_offset(pos)
    data[start + p.offset_in_record + at : start + p.offset_in_record + at + 2] = np.array(
        [np.nan], np.float16
    ).tobytes()
    (root / "experts.bin").write_bytes(bytes(data))
    crc = zlib.crc32(data[start : start + la.record_bytes])
    _edit_manifest(root, lambda d: d["layers"][0]["checksums"].__setitem__(pos, crc))
    report = verify_pack(root)
    assert len(report.problems) == 1 and "block scales in up;" in report.problems[0]


@pytest.mark.parametrize("exponent", [253, 255])
def test_overflowing_mxfp4_exponent_fails_verify(tmp_path: Path, exponent: int) -> None:
    """An mxfp4-t32r4 expert tile's E8M0 exponent byte (row 31's, the header's last) set above
    252 (values overflow float32, or OCP's NaN), its record's crc32 recomputed, fails --verify
    naming the projection; the untouched pack verifies."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type="MXFP4")
    root = pack_model(src, tmp_path / "m.estream", progress=False).root
    assert verify_pack(root).ok
    m = Manifest.from_path(root)
    la, pos = m.layers[1], 2
    p = la.projections["down"]
    assert p.format == "mxfp4-t32r4"
    data = bytearray((root / "experts.bin").read_bytes())
    start = la.record_offset(pos)
    data[start + p.offset_in_record + 544 + 31] = exponent  # the second tile, row 31
    (root / "experts.bin").write_bytes(bytes(data))
    crc = zlib.crc32(data[start : start + la.record_bytes])
    _edit_manifest(root, lambda d: d["layers"][1]["checksums"].__setitem__(pos, crc))
    report = verify_pack(root)
    assert len(report.problems) == 1 and "block scales in down;" in report.problems[0]


@pytest.mark.parametrize("at", [0, 64], ids=["d", "dmin"])
def test_nan_in_k_quant_dense_scales_fails_verify_like_a_load(tmp_path: Path, at: int) -> None:
    """A q4_k-t32r4 dense tensor's `d` or `dmin` set to NaN (crc32 recomputed): the load's
    check (`nonfinite_dense`) and --verify report it alike."""
    dims = {"n_embd": 256, "n_ff_exp": 256, "n_head": 4, "head_dim": 64, "n_ff": 256}
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type="Q4_K",
                      dense_type="Q4_K", dims=dims)  # fmt: skip
    root = pack_model(src, tmp_path / "m.estream", progress=False).root
    name = "blk.0.attn_q.weight"
    t = Manifest.from_path(root).dense[name]
    assert t.format == "q4_k-t32r4"
    blob = bytearray((root / "dense.bin").read_bytes())
    blob[t.offset + at : t.offset + at + 2] = np.array([np.nan], np.float16).tobytes()
    (root / "dense.bin").write_bytes(bytes(blob))
    crc = zlib.crc32(blob[t.offset : t.offset + t.bytes])
    _edit_manifest(root, lambda d: d["dense"]["tensors"][name].__setitem__("crc32", crc))
    load_says = nonfinite_dense(Manifest.from_path(root), np.fromfile(root / "dense.bin", np.uint8))
    assert load_says == [f"dense.bin: dense tensor {name} holds NaN or infinite values"]
    assert list(verify_pack(root).problems) == load_says


@pytest.mark.parametrize(("dtype", "bad"), [("F16", 0x7C00), ("BF16", 0x7FC0)], ids=["f16", "bf16"])
def test_nonfinite_value_in_float16_dense_tiles_fails_verify_like_a_load(
    tmp_path: Path, dtype: str, bad: int
) -> None:
    """One value deep inside an f16-t32r4 / bf16-t32r4 dense tensor (no scales: any value can
    be the bad one) set to Inf / NaN, crc32 recomputed: the load's check and --verify report
    it alike; the untouched pack passes both."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", dense_type=dtype)
    root = pack_model(src, tmp_path / "m.estream", progress=False).root
    name = "blk.0.attn_q.weight"
    t = Manifest.from_path(root).dense[name]
    assert t.format == dtype.lower() + "-t32r4"
    assert (
        nonfinite_dense(Manifest.from_path(root), np.fromfile(root / "dense.bin", np.uint8)) == []
    )
    blob = bytearray((root / "dense.bin").read_bytes())
    at = t.offset + t.bytes - 2 * 37  # a value of the last tile, not its first bytes
    blob[at : at + 2] = np.array([bad], "<u2").tobytes()
    (root / "dense.bin").write_bytes(bytes(blob))
    crc = zlib.crc32(blob[t.offset : t.offset + t.bytes])
    _edit_manifest(root, lambda d: d["dense"]["tensors"][name].__setitem__("crc32", crc))
    load_says = nonfinite_dense(Manifest.from_path(root), np.fromfile(root / "dense.bin", np.uint8))
    assert load_says == [f"dense.bin: dense tensor {name} holds NaN or infinite values"]
    assert list(verify_pack(root).problems) == load_says
