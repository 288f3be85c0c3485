"""Integrity and fault safety of packs: the manifest validator, checksums, finite
weights, metadata sanity, and a packer that never deletes what it did not create."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import re
import shutil
import struct
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from estream_layout import (
    ChecksumError,
    InvalidGGUFError,
    InvalidMetadataError,
    Manifest,
    NonFiniteWeightsError,
    PackExistsError,
    PackFormatError,
    PackTargetError,
    pack_model,
    synth_model,
    update_manifest,
    verify_pack,
)
from estream_layout import pack as pack_mod
from estream_layout.gguf_header import read_header
from estream_layout.manifest import VERSION
from estream_layout.testing import DROP, manifest_mutations, mutate_gguf, reseal

# Fields that only the manifest digest (or, for data checksums, `--verify`) can protect: a
# consistent edit of them that also rewrites the digest is a forgery, not a corruption.
_DIGEST_ONLY = re.compile(
    r"^(source\b|spec\.(?!(n_layers|n_embd|n_experts|n_experts_used|moe_layers|n_vocab)\b)"
    r"|model_gguf\.crc32$|dense\.tensors\[.*\]\.crc32$|layers\[\d+\]\.checksums"
    r"|layers\[\d+\]\.order$|dense\.tensors(\[[^\]]*\])?$)"
)

_ENGINE_CHECKED = ("spec.n_layers", "spec.n_experts_used")


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("integrity")
    src = synth_model("olmoe", "tiny", d / "a.gguf", seed=1)
    other = synth_model("olmoe", "tiny", d / "b.gguf", seed=2)  # same sizes, other weights
    pack_model(src, d / "a.estream", progress=False)
    pack_model(other, d / "b.estream", progress=False)
    return {"src": src, "other": other, "a": d / "a.estream", "b": d / "b.estream", "dir": d}


def _copy(pack: dict[str, Path], tmp_path: Path, name: str = "a") -> Path:
    dst = tmp_path / f"{name}.estream"
    shutil.copytree(pack[name], dst)
    return dst


def _doc(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


# ------------------------------------------------------------------------------ the validator
def test_every_manifest_field_corruption_is_refused_naming_the_field(
    pack: dict[str, Path],
) -> None:
    """Every field x {wrong type, out of range, inconsistent, missing}: a corrupted manifest is
    refused (by its digest); with the digest rewritten to match (a deliberate edit or a buggy
    writer), by the field checks, which name the field. Never another exception type."""
    root = pack["a"]
    doc = _doc(root)
    n = 0
    for mut in manifest_mutations(doc):
        n += 1
        with pytest.raises(PackFormatError, match=r"manifest\.json: "):
            Manifest.from_dict(mut.doc, root)
        sealed = reseal(mut.doc)
        try:
            Manifest.from_dict(sealed, root)
        except PackFormatError as e:
            msg = str(e)
            field_error = re.search(r"manifest\.json: [\w\[\]'.\-]+: ", msg)
            size_error = re.search(
                r"\.(bin|gguf): \d+ bytes, the manifest says \d+ \(\w+\.bytes\)", msg
            )
            assert field_error or size_error, msg
            if mut.kind in ("type", "missing") and not _DIGEST_ONLY.match(mut.field):
                named = re.search(r"manifest\.json: ([^ ]+): |\((\w+\.bytes)\)", msg)
                named = named.group(1) or named.group(2)  # type: ignore[union-attr]
                assert mut.field.startswith(named) or named.startswith(mut.field), (mut, msg)
        else:
            # n_layers / n_experts_used in range but wrong: the engine compares them with
            # model.gguf (integration/test_faults.py)
            engine_checked = mut.kind == "inconsistent" and mut.field in _ENGINE_CHECKED
            assert _DIGEST_ONLY.match(mut.field) or engine_checked, (
                f"accepted: {mut.field} {mut.kind} {mut.value!r}"
            )
    assert n > 1000  # the generator covers the document, not a handful of cases


def test_permuted_but_valid_order_is_caught_by_the_manifest_digest(pack: dict[str, Path]) -> None:
    doc = _doc(pack["a"])
    doc["layers"][1]["order"] = doc["layers"][1]["order"][::-1]
    with pytest.raises(PackFormatError, match=r"integrity\.sha256 does not match"):
        Manifest.from_dict(doc, pack["a"])


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("offset", 1 << 40, r"layers\[0\]\.offset: .* past experts\.bytes"),  # was SIGSEGV
        ("offset", -4096, r"layers\[0\]\.offset: -4096 is out of range"),
        ("offset", 100, r"layers\[0\]\.offset: 100 is not a multiple of 4096"),
        ("record_bytes", 4096, r"layers\[0\]\.record_bytes: 4096, projections add up"),
        ("order", [0, 0, 2, 3, 4, 5, 6, 7], r"layers\[0\]\.order: not a permutation"),
        ("n_experts", 1 << 40, r"layers\[0\]\.n_experts: .* out of range"),
        ("n_experts", 60000, r"layers\[0\]\.order: 8 entries for n_experts=60000"),
        ("index", 1, r"layers: indices \[1, 1\] differ from spec\.moe_layers"),
    ],
)
def test_resident_crash_reproductions_are_refused(
    pack: dict[str, Path], field: str, value: object, needle: str
) -> None:
    """Manifests whose layer fields would crash `--mode resident` or allocate without bound are
    refused, even with a matching digest, before anything is read or allocated."""
    doc = _doc(pack["a"])
    doc["layers"][0][field] = value
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(PackFormatError, match=needle):
        Manifest.from_dict(reseal(doc), pack["a"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0 and peak < 32 << 20


@pytest.mark.parametrize("key", ["dense", "experts"])
@pytest.mark.parametrize("name", ["../a.gguf", "/etc/passwd", "sub/dense.bin", ".", ""])
def test_file_names_stay_inside_the_pack(pack: dict[str, Path], key: str, name: str) -> None:
    doc = _doc(pack["a"])
    doc[key]["file"] = name
    with pytest.raises(PackFormatError, match=rf"{key}\.file: .* not a plain file name"):
        Manifest.from_dict(reseal(doc), pack["a"])


def test_symlink_out_of_the_pack_is_refused(pack: dict[str, Path], tmp_path: Path) -> None:
    root = _copy(pack, tmp_path)
    (root / "dense.bin").rename(tmp_path / "elsewhere.bin")
    (root / "dense.bin").symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(PackFormatError, match="outside the pack directory"):
        Manifest.from_path(root)


def test_old_manifest_version_asks_for_a_repack(pack: dict[str, Path]) -> None:
    doc = _doc(pack["a"])
    for old in range(1, VERSION):  # every earlier format, e.g. packs without per-projection
        doc["version"] = old  # formats, are named and sent to re-pack, not to a missing field
        with pytest.raises(PackFormatError, match=rf"version: {old} is not supported.*re-pack"):
            Manifest.from_dict(doc, pack["a"])


# ------------------------------------------------------------------------------ the files
@pytest.mark.parametrize("name", ["model.gguf", "dense.bin", "experts.bin"])
@pytest.mark.parametrize("change", ["truncate", "extend", "delete"])
def test_file_sizes_checked_on_every_read(
    pack: dict[str, Path], tmp_path: Path, name: str, change: str
) -> None:
    root = _copy(pack, tmp_path)
    f = root / name
    if change == "truncate":
        os.truncate(f, f.stat().st_size - 1)
    elif change == "extend":
        with open(f, "ab") as fh:
            fh.write(b"\0")
    else:
        f.unlink()
    needle = "missing" if change == "delete" else "bytes, the manifest says"
    for check in (Manifest.from_path, verify_pack):
        with pytest.raises(PackFormatError, match=rf"{re.escape(name)}: .*{needle}"):
            check(root)
    assert not list(tmp_path.glob("**/*.tmp"))


@pytest.mark.parametrize("name", ["model.gguf", "dense.bin", "experts.bin"])
@pytest.mark.parametrize("change", ["flip", "swap"])
def test_verify_catches_flipped_bytes_and_files_of_another_model(
    pack: dict[str, Path], tmp_path: Path, name: str, change: str
) -> None:
    """A flipped byte or another model's file of the same size in dense.bin, model.gguf or
    experts.bin: validation passes (sizes match), --verify fails naming the file."""
    root = _copy(pack, tmp_path)
    f = root / name
    m = Manifest.from_path(root)
    if change == "swap":
        other = pack["b"] / name
        assert other.read_bytes() != f.read_bytes()
        shutil.copyfile(other, f)
        if other.stat().st_size != (pack["a"] / name).stat().st_size:
            # e.g. model.gguf: the other model's tokenizer is longer; the size check sees it
            with pytest.raises(PackFormatError, match=rf"{name}: \d+ bytes, the manifest says"):
                Manifest.from_path(root)
            return
    else:
        data = bytearray(f.read_bytes())
        if name == "dense.bin":  # inside a tensor (padding between tensors is never read)
            t = max(m.dense.values(), key=lambda t: t.bytes)
            at = t.offset + t.bytes // 2
        else:
            at = len(data) // 3 if name == "experts.bin" else len(data) - 5
        data[at] ^= 0x10
        f.write_bytes(bytes(data))
    Manifest.from_path(root)  # sizes still match: only the checksums can tell
    report = verify_pack(root)
    assert not report.ok
    assert any(p.startswith(name) for p in report.problems), report.problems


def test_verify_is_clean_on_a_good_pack_and_counts_everything(pack: dict[str, Path]) -> None:
    m = Manifest.from_path(pack["a"])
    report = verify_pack(pack["a"])
    assert report.ok, report.problems
    assert report.checked_records == sum(la.n_experts for la in m.layers)
    assert (
        report.checked_bytes
        == m.experts_bytes + sum(t.bytes for t in m.dense.values()) + m.model_gguf_bytes
    )


def test_checksum_error_type_is_a_pack_format_error() -> None:
    assert issubclass(ChecksumError, PackFormatError)


# ------------------------------------------------------------------------------ concurrency
def _bump_profile(root: str, n: int) -> None:
    for _ in range(n):

        def change(doc: dict) -> None:
            p = doc.get("profile") or {"count": 0}
            p["count"] = p["count"] + 1
            time.sleep(0.001)  # widen the read-modify-write window
            doc["profile"] = p

        update_manifest(root, change)


def test_concurrent_manifest_writers_lose_nothing_and_leave_no_temp(
    pack: dict[str, Path], tmp_path: Path
) -> None:
    """Concurrent manifest writers (four processes x 15 read-modify-writes) keep every update
    and leave the manifest valid: a lock and a unique temporary name per writer."""
    root = _copy(pack, tmp_path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_bump_profile, args=(str(root), 15)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    m = Manifest.from_path(root)
    assert m.profile == {"count": 60}
    assert sorted(p.name for p in root.iterdir()) == [
        ".manifest.lock",
        "dense.bin",
        "experts.bin",
        "manifest.json",
        "model.gguf",
    ]


def test_manifest_writer_cleans_its_temporary_on_failure(
    pack: dict[str, Path], tmp_path: Path
) -> None:
    root = _copy(pack, tmp_path)
    before = (root / "manifest.json").read_bytes()
    with pytest.raises(PackFormatError, match=r"config\.G"):
        update_manifest(root, lambda doc: doc.__setitem__("config", {"G": 0, "Q": 1, "B": 1}))
    with pytest.raises(ValueError, match="Out of range float"):
        update_manifest(root, lambda doc: doc.__setitem__("profile", {"x": float("nan")}))
    assert (root / "manifest.json").read_bytes() == before
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------ the packer
def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_force_never_deletes_a_users_directory(pack: dict[str, Path], tmp_path: Path) -> None:
    """--force refuses a directory at the target that is not an EStream pack, and leaves it
    as it was."""
    user = tmp_path / "photos"
    (user / "2024").mkdir(parents=True)
    (user / "2024" / "cat.jpg").write_bytes(b"meow")
    before = _tree(user)
    for force in (True, False):  # without --force: no advice to use it
        with pytest.raises(PackTargetError, match=r"not an EStream pack.*refusing"):
            pack_model(pack["src"], user, force=force, progress=False)
    assert _tree(user) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]


def test_force_never_replaces_the_source_or_a_file(pack: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    shutil.copyfile(pack["src"], src)
    before = src.read_bytes()
    with pytest.raises(PackTargetError, match="would replace the source"):
        pack_model(src, src, force=True, progress=False)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(PackTargetError, match="not a directory"):
        pack_model(src, notes, force=True, progress=False)
    link = tmp_path / "link.estream"
    link.symlink_to(pack["a"])
    with pytest.raises(PackTargetError, match="symbolic link"):
        pack_model(src, link, force=True, progress=False)
    assert src.read_bytes() == before and notes.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.estream", "m.gguf", "notes.txt"]


def test_force_refuses_a_pack_holding_user_files(pack: dict[str, Path], tmp_path: Path) -> None:
    root = _copy(pack, tmp_path)
    (root / "my-notes.md").write_text("results")
    with pytest.raises(PackTargetError, match=r"my-notes\.md.*refusing"):
        pack_model(pack["src"], root, force=True, progress=False)
    assert (root / "my-notes.md").read_text() == "results"


def test_force_replaces_an_estream_pack_including_an_older_version(
    pack: dict[str, Path], tmp_path: Path
) -> None:
    root = _copy(pack, tmp_path, "b")
    doc = _doc(root)
    doc["version"] = 1  # a pack written by an older estream-layout is still recognised
    (root / "manifest.json").write_text(json.dumps(doc))
    (root / ".manifest.lock").touch()
    m = pack_model(pack["src"], root, force=True, progress=False)
    assert m.version == VERSION and verify_pack(root).ok
    assert (root / "dense.bin").read_bytes() == (pack["a"] / "dense.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.estream"]


def _appear_during_pack(monkeypatch: pytest.MonkeyPatch, action) -> None:  # type: ignore[no-untyped-def]
    orig = pack_mod._write_layer
    done = []

    def hook(*a, **k):  # type: ignore[no-untyped-def]
        out = orig(*a, **k)
        if not done:
            done.append(1)
            action()
        return out

    monkeypatch.setattr(pack_mod, "_write_layer", hook)


@pytest.mark.parametrize("content", ["empty", "files"])
def test_a_target_that_appears_while_packing_is_left_alone(
    pack: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    """A directory created at the target while packing is not replaced (rename(2) would
    silently replace an empty one): the pack fails and the directory stays."""
    dst = tmp_path / "m.estream"

    def appear() -> None:
        dst.mkdir()
        if content == "files":
            (dst / "data.csv").write_text("1,2")

    _appear_during_pack(monkeypatch, appear)
    with pytest.raises(PackTargetError, match="appeared while packing"):
        pack_model(pack["src"], dst, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.estream"]
    assert [p.name for p in dst.iterdir()] == ([] if content == "empty" else ["data.csv"])


def test_a_pack_swapped_for_a_users_directory_while_packing_is_restored(
    pack: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = _copy(pack, tmp_path, "b")

    def swap() -> None:
        shutil.rmtree(dst)
        dst.mkdir()
        (dst / "thesis.tex").write_text("chapter 1")

    _appear_during_pack(monkeypatch, swap)
    with pytest.raises(PackTargetError, match="replaced while packing"):
        pack_model(pack["src"], dst, force=True, progress=False)
    assert [p.name for p in dst.iterdir()] == ["thesis.tex"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.estream"]


def _pack_quietly(src: str, dst: str, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        pack_model(src, dst, progress=False)
        q.put("ok")
    except PackTargetError as e:
        q.put(f"refused: {e}")
    except PackExistsError as e:
        q.put(f"exists: {e}")


def test_two_packs_to_one_new_path_one_fails_clearly(pack: dict[str, Path], tmp_path: Path) -> None:
    """Of two packs to the same new path, exactly one reports success."""
    dst = tmp_path / "m.estream"
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pack_quietly, args=(str(pack["src"]), str(dst), q)) for _ in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = sorted(q.get(timeout=5) for _ in procs)
    assert results[0] == "ok" or results[1] == "ok", results
    assert sum(r == "ok" for r in results) == 1, results  # exactly one wins, the other says why
    assert verify_pack(dst).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.estream"]


# ------------------------------------------------------------------------------ source checks
def _poison_scale(value: float, offset: int = 0):  # type: ignore[no-untyped-def]
    """Set the fp16 scale of one GGML block (bytes `offset..offset+2` of the raw tensor)."""

    def edit(a: np.ndarray) -> None:
        a.reshape(-1).view(np.uint8)[offset : offset + 2] = np.frombuffer(
            np.float16(value).tobytes(), np.uint8
        )

    return edit


@pytest.mark.parametrize(
    ("tensor", "edit", "needle"),
    [
        ("blk.1.attn_norm.weight", lambda a: a.reshape(-1).__setitem__(3, np.nan), "values"),
        ("output_norm.weight", lambda a: a.reshape(-1).__setitem__(0, np.inf), "values"),
        ("blk.0.ffn_up_exps.weight", _poison_scale(np.nan, 18 * 2 * 5), "expert 0"),
        ("blk.1.ffn_down_exps.weight", _poison_scale(-np.inf, 18 * 2 * 64 * 7), "expert 7"),
        ("blk.0.attn_q.weight", _poison_scale(np.nan), "block scales"),
        ("output.weight", _poison_scale(np.inf), "block scales"),  # Q8_0
    ],
)
def test_nan_and_inf_source_weights_are_refused(
    pack: dict[str, Path], tmp_path: Path, tensor: str, edit, needle: str
) -> None:  # type: ignore[no-untyped-def]
    bad = mutate_gguf(pack["src"], tmp_path / "bad.gguf", edit_tensor={tensor: edit})
    with pytest.raises(NonFiniteWeightsError, match=rf"{re.escape(tensor)}.*{needle}"):
        pack_model(bad, tmp_path / "bad.estream", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_mxfp4_exponents_that_overflow_are_refused(tmp_path: Path) -> None:
    """MXFP4 experts with an E8M0 exponent above 252 (from 253 values overflow float32, 255 is
    OCP's NaN) are refused by tensor and expert, whatever the codes; exponent 252 with the
    largest code (6 x 2^125, finite) packs and verifies."""
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type="MXFP4")

    def blocks(e: int, code: int, offset: int):  # type: ignore[no-untyped-def]
        def edit(a: np.ndarray) -> None:
            b = a.reshape(-1).view(np.uint8)
            b[offset] = e
            b[offset + 1 : offset + 17] = code

        return edit

    ok = mutate_gguf(src, tmp_path / "ok.gguf", edit_tensor={
        "blk.0.ffn_gate_exps.weight": blocks(252, 0x77, 0)})  # fmt: skip
    m = pack_model(ok, tmp_path / "ok.estream", progress=False)
    assert verify_pack(m.root).ok
    expert = 64 * (17 * 64 // 32)  # bytes of one tiny qwen3moe up expert (64 rows of d = 64)
    for e, code in ((253, 0x11), (255, 0x00)):
        bad = mutate_gguf(src, tmp_path / "bad.gguf", edit_tensor={
            "blk.1.ffn_up_exps.weight": blocks(e, code, expert * 3 + 34 * 5)})  # fmt: skip
        with pytest.raises(NonFiniteWeightsError, match=r"blk\.1\.ffn_up_exps.*expert 3"):
            pack_model(bad, tmp_path / "bad.estream", progress=False)
        assert not (tmp_path / "bad.estream").exists()


A = "olmoe."


@pytest.mark.parametrize(
    ("kv", "needle"),
    [
        ({A + "expert_used_count": 0}, "expert_used_count = 0 must be >= 1"),
        ({A + "expert_used_count": 9}, "expert_used_count = 9 exceeds expert_count = 8"),
        ({A + "expert_used_count": DROP}, "expert_used_count is missing"),
        ({A + "attention.head_count": 0}, "head_count = 0 must be >= 1"),
        ({A + "attention.head_count": 3}, "head_count_kv = 4 must divide head_count = 3"),
        (
            {A + "attention.head_count": 5, A + "attention.head_count_kv": 5},
            "head_count = 5 does not divide embedding_length = 64",
        ),
        (
            {A + "attention.layer_norm_rms_epsilon": -1e-5},
            "rms_epsilon = -1e-05 must be a finite number > 0",
        ),
        ({A + "attention.layer_norm_rms_epsilon": float("nan")}, "rms_epsilon = nan must be"),
        ({A + "rope.freq_base": 0.0}, "freq_base = 0 must be a finite number > 0"),
        ({A + "attention.key_length": 12}, "key_length = 12: head_count x key_length = 48"),
        ({A + "embedding_length": DROP}, "embedding_length is missing"),
        ({A + "embedding_length": 96}, "embedding_length = 96, but the expert tensors are 64"),
        ({A + "block_count": 1}, "block_count = 1, but the file has tensors of layer 1"),
        ({A + "block_count": 3}, "block_count = 3, but the file has no tensors for layer 2"),
        ({A + "block_count": "two"}, "block_count = 'two' is not an integer"),
        ({A + "context_length": 0}, "context_length = 0 must be >= 1"),
        ({A + "rope.dimension_count": 17}, "dimension_count = 17 must be even"),
        ({A + "expert_count": 0}, "has no experts"),
    ],
)
def test_nonsense_metadata_is_refused_at_pack_time_naming_the_key(
    pack: dict[str, Path], tmp_path: Path, kv: dict, needle: str
) -> None:
    """Metadata that would fail later with kernel errors (or, for block_count, silently run
    fewer layers) is refused when packing, naming the key."""
    bad = mutate_gguf(pack["src"], tmp_path / "bad.gguf", set_kv=kv)
    with pytest.raises(InvalidGGUFError if "experts" not in needle else Exception, match=needle):
        pack_model(bad, tmp_path / "bad.estream", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_metadata_errors_are_their_own_class(pack: dict[str, Path], tmp_path: Path) -> None:
    bad = mutate_gguf(pack["src"], tmp_path / "bad.gguf", set_kv={A + "rope.freq_base": -1.0})
    with pytest.raises(InvalidMetadataError, match=r"bad\.gguf: metadata olmoe\.rope\.freq_base"):
        pack_model(bad, tmp_path / "x.estream", progress=False)


def _tensor_offset_field(path: Path, name: str) -> int:
    """File position of a tensor's u64 data offset in the GGUF header."""
    data = path.read_bytes()
    h = read_header(path)
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    pos += 4 + 8 * n_dims + 4
    assert pos < h.data_offset
    return pos


def test_overlapping_tensor_data_is_a_clear_error(pack: dict[str, Path], tmp_path: Path) -> None:
    """Overlapping tensor data is a clear InvalidGGUFError, not an internal assertion."""
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(pack["src"], bad)
    first, second = sorted(read_header(bad).tensors, key=lambda t: t.offset)[:2]
    raw = bytearray(bad.read_bytes())
    at = _tensor_offset_field(bad, second.name)
    raw[at : at + 8] = struct.pack(
        "<Q", struct.unpack_from("<Q", raw, _tensor_offset_field(bad, first.name))[0]
    )
    bad.write_bytes(bytes(raw))
    with pytest.raises(InvalidGGUFError, match=rf"tensors {first.name} and {second.name} overlap"):
        pack_model(bad, tmp_path / "x.estream", progress=False)


def test_pack_threads_do_not_outlive_a_failed_pack(pack: dict[str, Path], tmp_path: Path) -> None:
    before = threading.active_count()
    bad = mutate_gguf(
        pack["src"],
        tmp_path / "bad.gguf",
        edit_tensor={"blk.1.ffn_up_exps.weight": _poison_scale(np.nan)},
    )
    with pytest.raises(NonFiniteWeightsError):
        pack_model(bad, tmp_path / "x.estream", progress=False)
    assert threading.active_count() == before


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "unreadable manifest"),
        (b"[]", "document: expected an object"),
        (b"null", "document: expected an object"),
        (b"\xff\xfe\x00garbage", "unreadable manifest"),
        (b"[" * 100000 + b"]" * 100000, "unreadable manifest"),
        (b'{"format": "estream-pack", "version": 3}', "arch: missing"),
        (b'{"format": "estream-pack", "version": 3.0}', "version: 3.0 is not supported"),
        (b'{"format": "estream-pack", "version": true}', "version: True is not supported"),
    ],
)
def test_garbage_manifests_are_one_clear_error(
    pack: dict[str, Path], tmp_path: Path, content: bytes, needle: str
) -> None:
    root = _copy(pack, tmp_path)
    (root / "manifest.json").write_bytes(content)
    for check in (Manifest.from_path, verify_pack):
        with pytest.raises(PackFormatError, match=re.escape(needle)):
            check(root)


def test_corrupted_source_gguf_bytes_give_one_clear_error_or_a_valid_pack(
    pack: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flip bytes all over the source's header (metadata, tensor index) and some in its data,
    and truncate it at many points: `estream-pack` either refuses with one line (exit 2) or
    writes a pack that verifies. Never a traceback, never a leftover temporary."""
    from estream_layout.cli import pack_main

    good = pack["src"].read_bytes()
    header_end = read_header(pack["src"]).data_offset
    rng = np.random.default_rng(5)
    positions = sorted({*rng.integers(0, header_end, 120).tolist(), *range(0, 64)})
    positions += rng.integers(header_end, len(good), 20).tolist()
    cases = [("flip", p) for p in positions]
    cases += [("truncate", int(n)) for n in rng.integers(0, len(good), 25)]
    outcomes = collections.Counter()
    for how, pos in cases:
        src = tmp_path / "src.gguf"
        data = bytearray(good)
        if how == "flip":
            data[pos] ^= 0xFF
        else:
            del data[pos:]
        src.write_bytes(bytes(data))
        dst = tmp_path / "out.estream"
        rc = pack_main([str(src), "-o", str(dst), "--no-progress"])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if rc == 0:
            assert verify_pack(dst).ok
            shutil.rmtree(dst)
            outcomes["packed"] += 1
        else:
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("estream-pack: error: "), (
                how,
                pos,
                err,
            )
            outcomes["refused"] += 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"], (how, pos)
    assert outcomes["refused"] > 50, outcomes


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_float16_dense_formats_are_validated_by_the_manifest(tmp_path: Path, dtype: str) -> None:
    """A pack with f16-t32r4 / bf16-t32r4 dense matrices loads; the same manifest (digest
    rewritten) with one of them given another size, a 1-D shape or an unknown format spelling
    is refused naming the field."""
    src = synth_model("olmoe", "tiny", tmp_path / "m.gguf", dense_type=dtype)
    root = pack_model(src, tmp_path / "m.estream", progress=False).root
    fmt = dtype.lower() + "-t32r4"
    doc = _doc(root)
    name = "blk.0.attn_k.weight"
    assert doc["dense"]["tensors"][name]["format"] == fmt
    assert Manifest.from_dict(doc, root).dense[name].format == fmt
    f = f"dense.tensors[{name!r}]"
    for key, value, field in (
        ("bytes", doc["dense"]["tensors"][name]["bytes"] + 4096, f + ".bytes"),
        ("shape", [4096], f + ".shape"),
        ("format", dtype.lower() + "-t32r8", f + ".format"),
    ):
        bad = json.loads(json.dumps(doc))
        bad["dense"]["tensors"][name][key] = value
        with pytest.raises(PackFormatError, match=re.escape(f"manifest.json: {field}: ")):
            Manifest.from_dict(reseal(bad), root)
