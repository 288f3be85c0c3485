"""Fault injection across the packages: corrupted packs, models and arguments,
signals and concurrent writers, through the engine, the `estream` command and `estream-pack`.

For every fault the suite asserts what a user needs: a clear error naming the file or field,
a non-zero exit, no traceback, no leaked thread / fd / temporary file, nothing of the user's
deleted, and never an answer that differs silently from the good pack's. Tiny models, the
commands run in-process; subprocesses only where an exit status or a signal is the point.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import estream
import estream_arena
from estream import experts as experts_mod
from estream.packed import update_config
from estream_cli.main import main
from estream_layout import LayoutError, Manifest, PackFormatError, pack_model, synth_model
from estream_layout.cli import pack_main, synth_main
from estream_layout.testing import manifest_mutations, reseal

TOKENS = list(range(1, 25))
STREAM = {"G": 2, "Q": 2, "B": 2}
FILES = ("model.gguf", "dense.bin", "experts.bin")
# Errors a load or prefill may end with: the packages' own, each carrying a specific message.
CLEAR_ERRORS = (estream.EStreamError, LayoutError, estream_arena.ArenaError)
# Manifest fields whose *consistent* edit (digest rewritten too) is a forgery that only the
# digest, the data checksums or `--verify --against SRC` can expose (as is removing a dense
# tensor's entry); nothing else may pass unnoticed.
# Undetectable once the digest is rewritten: checksums, a permuted order, and the spec fields
# that model.gguf does not state (the engine cross-checks the ones it does, see packed.py).
FORGERY = ("checksums", "crc32", ".order", "source", "integrity")
SPEC_FROM_GGUF = (
    "n_layers",
    "n_embd",
    "n_head",
    "n_head_kv",
    "n_experts",
    "n_experts_used",
    "rms_eps",
    "rope_freq_base",
    "rope_dims",
    "n_ctx",
)


def _forged(field: str) -> bool:
    if any(f in field for f in FORGERY):
        return True
    return field.startswith("spec.") and field.split(".")[1].split("[")[0] not in SPEC_FROM_GGUF


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("faults")
    a = synth_model("olmoe", "tiny", d / "a.gguf", seed=11)
    b = synth_model("olmoe", "tiny", d / "b.gguf", seed=12)
    pack_model(a, d / "a.estream", progress=False)
    pack_model(b, d / "b.estream", progress=False)
    return {"src": a, "a": d / "a.estream", "b": d / "b.estream"}


@pytest.fixture(scope="module")
def baseline(packs: dict[str, Path]) -> dict[str, np.ndarray]:
    out = {}
    for mode, kw in (("stream", STREAM), ("resident", {})):
        with estream.load(packs["a"], mode=mode, **kw) as eng:
            out[mode] = eng.prefill(TOKENS).logits
    return out


def _copy(src: Path, tmp_path: Path, name: str = "m.estream") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _estream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("estream")]


@contextlib.contextmanager
def no_leaks(*dirs: Path) -> Iterator[None]:
    """Threads, file descriptors and files (in `dirs`) after == before."""
    threads, fds = _estream_threads(), _fds()
    files = {d: sorted(p.name for p in d.rglob("*")) for d in dirs}
    yield
    deadline = time.monotonic() + 2.0  # a daemon thread may take a moment to exit
    while _estream_threads() != threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _estream_threads() == threads
    assert _fds() <= fds, _fds() - fds
    for d, names in files.items():
        assert sorted(p.name for p in d.rglob("*")) == names, d


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(err: str, prog: str = "estream") -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------ manifests
def test_consistently_corrupted_manifests_never_answer_wrongly(
    packs: dict[str, Path], baseline: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """Every manifest field x {type, range, inconsistent, missing}, digest rewritten to match:
    refused by the validator, or by the engine's load with a clear error, or — for fields that
    do not change what is computed — the exact same logits. Never a crash, never garbage."""
    root = _copy(packs["a"], tmp_path)
    doc = json.loads((root / "manifest.json").read_text())
    tried = collections.Counter[str]()
    outcomes = collections.Counter[str]()
    for mut in manifest_mutations(doc):
        if _forged(mut.field):
            continue
        if mut.field.startswith("dense.tensors") and mut.field.endswith("]"):
            continue  # a tensor entry removed: e.g. output.weight gone reads as tied embeddings
        sealed = reseal(mut.doc)
        try:
            Manifest.from_dict(sealed, root)
        except PackFormatError:
            outcomes["validator"] += 1
            continue
        if tried[mut.field] >= 2:  # accepted fields are informational: two values each suffice
            continue
        tried[mut.field] += 1
        (root / "manifest.json").write_text(json.dumps(sealed))
        for mode, kw in (("stream", STREAM), ("resident", {})):
            try:
                with estream.load(root, mode=mode, **kw) as eng:
                    logits = eng.prefill(TOKENS).logits
            except CLEAR_ERRORS:
                outcomes["engine"] += 1
            else:
                outcomes["same"] += 1
                assert np.array_equal(logits, baseline[mode]), (mut.field, mut.kind, mut.value)
    assert outcomes["validator"] > 1000 and outcomes["same"] > 0, outcomes


@pytest.mark.parametrize("mode", ["stream", "resident"])
def test_the_engine_load_runs_the_layout_validator(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """A layer offset past experts.bin, a duplicated `order` entry or an absurd n_experts is
    one error line naming the field — never a segfault, wrong logits or an allocation without
    bound."""
    root = _copy(packs["a"], tmp_path)
    doc = json.loads((root / "manifest.json").read_text())
    cases = [
        (("layers", 0, "offset"), 1 << 40, r"layers\[0\]\.offset"),
        (("layers", 1, "order"), [0, 1, 2, 3, 4, 5, 6, 6], r"layers\[1\]\.order"),
        (("layers", 0, "n_experts"), 10**12, r"layers\[0\]\.n_experts"),
        (("layers", 0, "offset"), 4096 + 1, r"layers\[0\]\.offset"),
        (("dense", "file"), "../a.estream/dense.bin", r"dense\.file"),
        (("tile_format",), "q8_0-t32r4", r"tile_format"),
        (("layers", 1, "index"), 0, r"layers: indices \[0, 0\]"),
    ]
    for keys, value, needle in cases:
        bad = json.loads(json.dumps(doc))
        node = bad
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        for sealed in (False, True):
            (root / "manifest.json").write_text(json.dumps(reseal(bad) if sealed else bad))
            with no_leaks(tmp_path):
                rc, _, err = _run(capsys, "prefill", str(root), "--tokens", "1,2,3", "--mode", mode)
            line = _one_error(err)
            assert rc == 1
            assert re.search(needle, line), line  # field checks run before the digest
            # `estream-pack --verify` runs exactly the same validation
            assert pack_main(["--verify", str(root)]) == 2
            assert line.split(": error: ")[1] in capsys.readouterr().err


# ------------------------------------------------------------------------------ data files
def _corrupt(root: Path, other: Path, name: str, how: str) -> None:
    f = root / name
    m = Manifest.from_path(other)  # same layout as the good pack
    if how == "truncated":
        os.truncate(f, f.stat().st_size - 4096 if name != "model.gguf" else f.stat().st_size - 7)
    elif how == "swapped":
        shutil.copyfile(other / name, f)
    else:  # one flipped bit inside data that is read (not inter-tensor padding)
        data = bytearray(f.read_bytes())
        if name == "dense.bin":
            t = m.dense["blk.1.attn_output.weight"]
            at = t.offset + 100
        elif name == "experts.bin":
            at = m.layers[1].record_offset(3) + 77
        else:
            at = len(data) - 3
        data[at] ^= 0x04
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", ["truncated", "flipped", "swapped"])
def test_corrupted_files_through_every_reader(
    packs: dict[str, Path],
    baseline: dict[str, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    how: str,
) -> None:
    """Every file x {truncated, one flipped bit, swapped with another model's}: with --verify
    (streamed and resident alike) and with `estream-pack --verify` it is an error naming
    the file; without --verify a size change or any change of the small model.gguf is still an
    error, and nothing crashes."""
    root = _copy(packs["a"], tmp_path)
    _corrupt(root, packs["b"], name, how)
    size_changed = (root / name).stat().st_size != (packs["a"] / name).stat().st_size
    for argv in (("--verify",), ("--verify", "--mode", "resident"), (), ("--mode", "resident")):
        arena = () if "resident" in argv else ("-G", "2", "-B", "2")  # resident has no arena
        with no_leaks(tmp_path):
            rc, out, err = _run(capsys, "prefill", str(root), "--tokens", "1,2,3", *arena, *argv)
        if "--verify" in argv or size_changed or name == "model.gguf":  # its crc: every load
            line = _one_error(err)
            assert rc == 1 and name in line, (argv, line)
        else:
            assert "Traceback" not in err and rc in (0, 1), err
    rc = pack_main(["--verify", str(root)])
    out, err = capsys.readouterr()
    assert rc in (1, 2) and "Traceback" not in err
    assert name in (out + err)


def test_nan_in_an_expert_record_is_an_error_not_a_plausible_answer(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN weight never yields a plausible distribution with exit 0 (int8 activations must
    not turn NaN into finite numbers): with a record's Q4_0 scale NaN (checksum not updated,
    no --verify), both activation formats and both modes fail clearly."""
    root = _copy(packs["a"], tmp_path)
    m = Manifest.from_path(root)
    la = m.layers[0]
    data = bytearray((root / "experts.bin").read_bytes())
    for pos in range(la.n_experts):  # every expert: whichever is routed meets a NaN
        at = la.record_offset(pos) + la.projections["down"].offset_in_record
        data[at : at + 64] = np.full(32, np.nan, np.float16).tobytes()  # one tile's scales
    (root / "experts.bin").write_bytes(bytes(data))
    for act in ("q8", "f32"):
        for mode in ("stream", "resident"):
            with no_leaks(tmp_path):
                arena = ("-G", "2", "-B", "2") if mode == "stream" else ()  # resident: none
                rc, _, err = _run(
                    capsys, "prefill", str(root), "--tokens", "1,2,3,4", "--act", act,
                    "--mode", mode, *arena,
                )  # fmt: skip
            assert rc == 1 and "NaN or infinite activations" in _one_error(err), (act, mode)


def test_nan_in_dense_weights_is_refused_at_load(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(packs["a"], tmp_path)
    t = Manifest.from_path(root).dense["blk.0.attn_q.weight"]
    with open(root / "dense.bin", "r+b") as fh:
        fh.seek(t.offset + 2)  # the second row scale of the first tile
        fh.write(np.float16(np.inf).tobytes())
    rc, _, err = _run(capsys, "prefill", str(root), "--tokens", "1,2")
    assert rc == 1 and "blk.0.attn_q.weight holds NaN or infinite values" in _one_error(err)


def test_model_gguf_of_another_model_is_refused(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A foreign model.gguf is refused: another model's metadata of the same size passes the
    size check, but its hyper-parameters must match the manifest's."""
    other = tmp_path / "o.gguf"
    synth_model("olmoe", "tiny", other, seed=11, n_layers=3)
    o = _copy(packs["a"], tmp_path, "o.estream")
    pack_model(other, tmp_path / "x.estream", progress=False)
    shutil.copyfile(tmp_path / "x.estream" / "model.gguf", o / "model.gguf")
    doc = json.loads((o / "manifest.json").read_text())
    doc["model_gguf"]["bytes"] = (o / "model.gguf").stat().st_size
    (o / "manifest.json").write_text(json.dumps(reseal(doc)))
    rc, _, err = _run(capsys, "prefill", str(o), "--tokens", "1,2")
    assert rc == 1 and "model.gguf: checksum mismatch" in _one_error(err)
    # even with its checksum forged too, its hyper-parameters must match the manifest's
    doc["model_gguf"]["crc32"] = zlib.crc32((o / "model.gguf").read_bytes())
    (o / "manifest.json").write_text(json.dumps(reseal(doc)))
    rc, _, err = _run(capsys, "prefill", str(o), "--tokens", "1,2")
    assert rc == 1 and "spec.n_layers = 2, but model.gguf says 3" in _one_error(err)


# ------------------------------------------------------------------------------ recovery
class _FailOnce:
    """Make one call of `target.attr` raise `exc` (then behave normally)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: object, attr: str, exc):  # type: ignore[no-untyped-def]
        orig = getattr(target, attr)
        self.fired = False

        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            if not self.fired:
                self.fired = True
                raise exc
            return orig(*a, **k)

        monkeypatch.setattr(target, attr, wrapper)


@pytest.mark.parametrize("mode", ["stream", "resident"])
@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), OSError(5, "Input/output error"), MemoryError()]
)
def test_engine_recovers_after_an_error_mid_forward(
    packs: dict[str, Path],
    baseline: dict[str, np.ndarray],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    exc: BaseException,
) -> None:
    """After any error mid-forward the next prefill works (no `ProtocolError: layer N is still
    open`), and the layer's loader threads and fds are not leaked."""
    kw = STREAM if mode == "stream" else {}
    with no_leaks(tmp_path), estream.load(packs["a"], mode=mode, **kw) as eng:
        cls = experts_mod.StreamedExperts if mode == "stream" else experts_mod.ResidentExperts
        fail = _FailOnce(monkeypatch, cls, "run_layer", exc)
        threads = _estream_threads()
        with pytest.raises(type(exc)):
            eng.prefill(TOKENS)
        assert fail.fired and _estream_threads() == threads  # old loader joined, new one up
        assert np.array_equal(eng.prefill(TOKENS).logits, baseline[mode])
        assert np.array_equal(eng.prefill(TOKENS).logits, baseline[mode])


def test_engine_recovers_after_a_checksum_error(
    packs: dict[str, Path], baseline: dict[str, np.ndarray], tmp_path: Path
) -> None:
    root = _copy(packs["a"], tmp_path)
    good = (root / "experts.bin").read_bytes()
    _corrupt(root, packs["b"], "experts.bin", "flipped")
    with no_leaks(tmp_path), estream.load(root, verify=True, **STREAM) as eng:
        with pytest.raises(estream_arena.ChecksumError, match="layer 1"):
            eng.prefill(TOKENS)
        with pytest.raises(estream_arena.ChecksumError):
            eng.prefill(TOKENS)  # still corrupt: the same clear error, not "layer still open"
        (root / "experts.bin").write_bytes(good)  # repaired in place (same inode)
        with contextlib.suppress(estream_arena.FileChangedError):
            eng.prefill(TOKENS)  # the open loader reports the in-place change once
        assert np.array_equal(eng.prefill(TOKENS).logits, baseline["stream"])


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(5, "Input/output error")])
def test_error_while_loading_with_early_reads_in_flight_leaks_nothing(
    packs: dict[str, Path],
    baseline: dict[str, np.ndarray],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException,
) -> None:
    """Stream mode starts the first MoE layer's reads before the dense weights load: an error
    or Ctrl-C in the dense load, with such a read inside `preadv`, must stop and join the
    loader and close its fds (the engine does not exist yet, nobody else can)."""
    real = os.preadv
    entered = threading.Event()

    def slow_preadv(fd, bufs, offset):  # type: ignore[no-untyped-def]
        if len(bufs) >= 3:  # a group's read (the O_DIRECT probe reads one buffer)
            entered.set()
            time.sleep(0.2)
        return real(fd, bufs, offset)

    seen = []

    def failing_load_dense(self, **kw):  # type: ignore[no-untyped-def]
        seen.append((entered.wait(10), len(_estream_threads())))
        raise exc

    with no_leaks(tmp_path):
        monkeypatch.setattr(os, "preadv", slow_preadv)
        monkeypatch.setattr(experts_mod.PackedModel, "load_dense", failing_load_dense)
        with pytest.raises(type(exc)):
            estream.load(packs["a"], **STREAM)
        monkeypatch.undo()
    assert seen and seen[0][0] and seen[0][1] >= STREAM["Q"]  # a read was in flight, threads up
    with no_leaks(tmp_path), estream.load(packs["a"], **STREAM) as eng:
        assert np.array_equal(eng.prefill(TOKENS).logits, baseline["stream"])


def test_read_error_in_the_early_window_reaches_the_first_pass(
    packs: dict[str, Path],
    baseline: dict[str, np.ndarray],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extent of the first MoE layer's first group cannot be read (EIO) while the model
    loads: the load succeeds, the first pass raises that read's error naming the layer, group
    and offset, and the engine recovers: the next passes (the first layer read ahead again,
    now readable) give the good answer; nothing leaks."""
    real = os.preadv
    bad = Manifest.from_path(packs["a"]).layers[0].record_offset(0)
    window = threading.Event()
    failed = []

    def eio_in_window(fd, bufs, offset):  # type: ignore[no-untyped-def]
        nbytes = sum(len(memoryview(b)) for b in bufs)
        if len(bufs) >= 3 and window.is_set() and offset <= bad < offset + nbytes:
            failed.append(offset)
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    with no_leaks(tmp_path):
        monkeypatch.setattr(os, "preadv", eio_in_window)
        window.set()
        with estream.load(packs["a"], **STREAM) as eng:
            first = min(eng.model.layers)
            deadline = time.monotonic() + 10
            while not eng.experts.loader.stats.n_failed and time.monotonic() < deadline:
                time.sleep(0.005)
            window.clear()
            assert failed, "no read started while the model loaded"
            with pytest.raises(estream_arena.ReadError, match=f"layer {first}, group 0, ") as ei:
                eng.prefill(TOKENS)
            assert ei.value.errno == 5 and ei.value.offset == bad
            assert np.array_equal(eng.prefill(TOKENS).logits, baseline["stream"])
            assert np.array_equal(eng.prefill(TOKENS).logits, baseline["stream"])
        monkeypatch.undo()


def test_batch_reports_each_failure_and_goes_on(
    packs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """In batch mode an engine error fails only its own request; the batch goes on."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps({"id": i, "prompt": f"hello {i}"}) + "\n" for i in range(4)))
    # one request per pass: the request whose pass failed reports it, the others go on
    _FailOnce(monkeypatch, experts_mod.StreamedExperts, "run_layer", OSError(5, "I/O error"))
    rc, out, err = _run(
        capsys, "embed", str(packs["a"]), "--input", str(reqs), "-G", "2", "-B", "2",
        "--batch-tokens", "1",
    )  # fmt: skip
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert [ln["id"] for ln in lines] == [0, 1, 2, 3]
    assert "error" in lines[0] and "I/O error" in lines[0]["error"]
    assert all("error" not in ln for ln in lines[1:])
    assert rc == 1 and "Traceback" not in err and "1 failed" in err
    want = [ln["embedding"] for ln in lines[1:]]
    # all four in one pass: the failed pass is re-run request by request and every request
    # is answered, as alone
    monkeypatch.undo()
    _FailOnce(monkeypatch, experts_mod.StreamedExperts, "run_layer", OSError(5, "I/O error"))
    rc, out, err = _run(
        capsys, "embed", str(packs["a"]), "--input", str(reqs), "-G", "2", "-B", "2"
    )
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert [ln["id"] for ln in lines] == [0, 1, 2, 3]
    assert all("error" not in ln for ln in lines), lines
    assert rc == 0 and "in 4 passes" in err and "failed" not in err
    np.testing.assert_allclose([ln["embedding"] for ln in lines[1:]], want, rtol=1e-6)


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("-G", "0"), "-G: must be >= 1, got 0"),
        (("-Q", "0"), "-Q: must be >= 1, got 0"),
        (("-B", "0"), "-B: must be >= 1, got 0"),
        (("--threads", "0"), "--threads: must be >= 1, got 0"),
        (("-G", "-2"), "-G: must be >= 1, got -2"),
        (("-G", "2.5"), "-G: expected a positive integer, got '2.5'"),
        (("--top-k", "-3"), "--top-k: must be >= 1, got -3"),
    ],
)
def test_bad_numbers_are_rejected_not_defaulted(
    packs: dict[str, Path], capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], needle: str
) -> None:
    """A zero or negative count (e.g. --top-k 0 or -3) is refused with one error line, never
    taken silently as "the default" or "everything"."""
    rc, out, err = _run(capsys, "prefill", str(packs["a"]), "--tokens", "1,2", *argv)
    assert rc == 2 and needle in err and out == "" and "Traceback" not in err


def test_bench_and_profile_counts(
    packs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(capsys, "bench", str(packs["a"]), "--repeat", "0")
    assert rc == 2 and "--repeat: must be >= 1" in err and out == ""
    rc, _, err = _run(capsys, "profile", str(packs["a"]), "--tokens", "0")
    assert rc == 2 and "--tokens: must be >= 1" in err


@pytest.mark.parametrize("value", [2.5, 0, -1, True, "4"])
def test_api_rejects_non_integer_counts(packs: dict[str, Path], value: object) -> None:
    for key in ("G", "Q", "B", "n_threads"):
        with pytest.raises(estream.BadRequestError, match=f"{key} must be a positive integer"):
            estream.load(packs["a"], **{key: value})


def test_text_input_errors(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin1 = tmp_path / "p.txt"
    latin1.write_bytes("café".encode("latin-1"))
    rc, _, err = _run(capsys, "prefill", str(packs["a"]), "--prompt-file", str(latin1))
    assert rc == 2 and "is not UTF-8 text" in _one_error(err)
    bad = os.fsdecode(b"caf\xe9")  # how an undecodable argv byte reaches Python
    rc, _, err = _run(capsys, "prefill", str(packs["a"]), "--prompt", bad)
    assert rc == 2 and "--prompt is not valid UTF-8 text" in _one_error(err)
    rc, _, err = _run(capsys, "tokenize", str(packs["a"]), bad)
    assert rc == 2 and "text is not valid UTF-8" in _one_error(err)
    rc, _, err = _run(capsys, "detokenize", str(packs["a"]), "1,x")
    line = _one_error(err)
    assert rc == 2 and "the ids argument takes" in line and "--tokens" not in line


def test_synth_with_a_missing_vocabulary_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = synth_main(
        ["--arch", "olmoe", "--preset", "tiny", "--vocab", str(tmp_path / "no.gguf"), "-o",
         str(tmp_path / "m.gguf")]
    )  # fmt: skip
    assert rc == 2 and "no.gguf: no such file" in _one_error(
        capsys.readouterr().err, "estream-synth"
    )
    assert list(tmp_path.iterdir()) == []


def test_cannot_start_a_thread_is_reported_and_leaks_nothing(
    packs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a loader thread cannot start, the error says so ("can't start new thread", not
    `RuntimeError: cannot join thread before it is started`), and the loader's fd is closed."""
    started = []
    orig = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("estream-arena-loader") and started:
            raise RuntimeError("can't start new thread")
        started.append(self.name)
        orig(self)

    with no_leaks(tmp_path):
        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(estream_arena.ArenaError, match="cannot start loader thread 2 of 2"):
            estream.load(packs["a"], **STREAM)
        monkeypatch.undo()


# ------------------------------------------------------------------------------ processes
# The command, announcing on stderr when it is imported and about to run: an interrupt during
# the interpreter's own start-up (importing numpy) is Python's business, not the command's.
_ENTRY = (
    "import sys; from estream_cli.main import main; "
    "sys.stderr.write('ready\\n'); sys.stderr.flush(); sys.exit(main())"
)


def _sigint_dfl() -> None:
    """In a child before it runs: SIGINT's default action, so that Python installs its handler
    (a test run started in the background inherits an ignored SIGINT, which a program rightly
    keeps ignoring)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*argv: str) -> subprocess.Popen:  # type: ignore[type-arg]
    p = subprocess.Popen(
        [sys.executable, "-c", _ENTRY, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_dfl,
    )
    assert p.stderr is not None and p.stderr.readline() == b"ready\n"
    return p


def test_broken_pipe_is_quiet(packs: dict[str, Path]) -> None:
    """`estream tokenize ... | head` ends quietly, without a BrokenPipeError traceback."""
    p = _cli("tokenize", str(packs["a"]), "hello world " * 8000)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and err == ""


def test_interrupts_at_random_points_are_one_line(packs: dict[str, Path], tmp_path: Path) -> None:
    """SIGINT into `estream prefill` at random moments (load, forward): exit 130 with one line,
    or a normal finish; never a traceback (incl. ExpertGraph.__del__ at exit)."""
    rng = random.Random(12)
    for _ in range(3):
        p = _cli("prefill", str(packs["a"]), "--tokens", ",".join(["5"] * 200), "-G", "1",
                 "-B", "2", "--json")  # fmt: skip
        time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        text = err.decode()
        assert "Traceback" not in text and "Exception ignored" not in text, text
        assert (p.returncode == 130 and text.strip() == "estream: error: interrupted") or (
            p.returncode == 0 and json.loads(out)["top_k"]
        ), (p.returncode, text)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_during_a_pack_leave_nothing(
    packs: dict[str, Path], tmp_path: Path, sig: signal.Signals
) -> None:
    src = tmp_path / "big.gguf"
    synth_model("olmoe", "small", src, seed=1, n_layers=6)
    code = (
        "import sys, time\n"
        "from estream_layout import pack as p\n"
        "orig = p._write_layer\n"
        "def slow(*a, **k):\n"
        "    print('layer', flush=True); time.sleep(0.3); return orig(*a, **k)\n"
        "p._write_layer = slow\n"
        "from estream_layout.cli import pack_main\n"
        "sys.exit(pack_main(sys.argv[1:]))\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(src), "-o", str(tmp_path / "m.estream"), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_dfl,
    )  # fmt: skip
    assert p.stdout is not None
    p.stdout.readline()  # inside the first layer
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted; nothing was written" in err.decode()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.gguf"]


def test_concurrent_config_writers_keep_the_manifest_valid(
    packs: dict[str, Path], tmp_path: Path
) -> None:
    """Concurrent `estream config` writers leave manifest.json valid."""
    root = _copy(packs["a"], tmp_path)
    errors: list[BaseException] = []

    def writer(g: int) -> None:
        try:
            for _ in range(20):
                update_config(root, "config", {"G": g, "Q": 1, "B": 2})
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(g,)) for g in (1, 2, 4, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    m = Manifest.from_path(root)
    assert m.config is not None and m.config["G"] in (1, 2, 4, 8)
    assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_estream_config_commands(packs: dict[str, Path], tmp_path: Path) -> None:
    """`estream profile` and several `estream config` commands at once leave manifest.json
    valid."""
    root = _copy(packs["a"], tmp_path)
    prof = (
        "profile",
        str(root),
        "--tokens",
        "32",
        "--candidates",
        "1,2,4",
        "--queue-depths",
        "1,2",
    )
    assert main(list(prof)) == 0
    procs = [_cli("config", str(root), "--budget", b, "--json") for b in ("512MiB", "1GiB", "2GiB")]
    procs.append(_cli(*prof))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and b"Traceback" not in err, err
    m = Manifest.from_path(root)
    assert m.profile is not None and m.config is not None
    assert m.config["budget_bytes"] in (512 << 20, 1 << 30, 2 << 30)
    assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]


def test_synth_and_pack_through_estream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`estream synth --arch ...` lost its options to argparse's REMAINDER."""
    g = tmp_path / "t.gguf"
    assert (
        main(["synth", "--arch", "olmoe", "--preset", "tiny", "--no-progress", "-o", str(g)]) == 0
    )
    assert main(["pack", str(g), "-o", str(tmp_path / "t.estream"), "--no-progress"]) == 0
    assert main(["pack", "--verify", str(tmp_path / "t.estream")]) == 0
    assert main(["pack", str(g), "-o", str(g), "--force"]) == 2
    assert "would replace the source" in _one_error(capsys.readouterr().err, "estream-pack")


# ------------------------------------------------------------------------------ verify = load
def _forge(root: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Edit the manifest and rewrite its digest (a deliberate edit, or a buggy writer)."""
    doc = json.loads((root / "manifest.json").read_text())
    change(doc)
    (root / "manifest.json").write_text(json.dumps(reseal(doc)))


def _nan_dense(root: Path) -> str:
    m = Manifest.from_path(root)
    t = m.dense["blk.1.attn_q.weight"]
    blob = bytearray((root / "dense.bin").read_bytes())
    blob[t.offset : t.offset + 2] = np.float16(np.nan).tobytes()  # the first tile's first scale
    (root / "dense.bin").write_bytes(bytes(blob))
    crc = zlib.crc32(blob[t.offset : t.offset + t.bytes])
    _forge(root, lambda d: d["dense"]["tensors"][t.name].__setitem__("crc32", crc))
    return "dense tensor blk.1.attn_q.weight holds NaN or infinite values"


def _nan_expert_scales(root: Path) -> str:
    m = Manifest.from_path(root)
    la = m.layers[0]
    data = bytearray((root / "experts.bin").read_bytes())
    sums = []
    for pos in range(la.n_experts):  # every expert: whichever is routed meets a NaN
        at = la.record_offset(pos) + la.projections["down"].offset_in_record
        data[at : at + 64] = np.full(32, np.nan, np.float16).tobytes()  # one tile's scales
        sums.append(zlib.crc32(data[la.record_offset(pos) : la.record_offset(pos + 1)]))
    (root / "experts.bin").write_bytes(bytes(data))
    _forge(root, lambda d: d["layers"][0].__setitem__("checksums", sums))
    return "NaN or infinite"


def _dense_entry_removed(root: Path) -> str:
    _forge(root, lambda d: d["dense"]["tensors"].pop("blk.1.attn_v.weight"))
    return "blk.1.attn_v.weight"


@pytest.mark.parametrize("corrupt", [_nan_dense, _nan_expert_scales, _dense_entry_removed])
def test_what_prefill_refuses_verify_refuses(
    packs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], corrupt
) -> None:  # type: ignore[no-untyped-def]
    """Packs whose checksums and digest were rewritten to match a corruption (NaN in dense.bin,
    NaN expert block scales, a dense tensor's entry removed): `prefill` refuses them with one
    line, and `estream-pack --verify` (which runs the load's checks) fails on them too, naming
    the same thing, instead of reporting OK."""
    root = _copy(packs["a"], tmp_path)
    needle = corrupt(root)
    rc, _, err = _run(capsys, "prefill", str(root), "--tokens", "1,2,3,4")
    assert rc == 1 and needle in _one_error(err)
    rc = pack_main(["--verify", str(root)])
    out, err = capsys.readouterr()
    assert rc in (1, 2) and "Traceback" not in err and "OK" not in out
    assert needle in out + err
