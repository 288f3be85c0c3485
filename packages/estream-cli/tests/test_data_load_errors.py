"""`TaskRunner` when its load fails while the whole-pack check is still running: an error of
the options comes out at once with the check stopped (no thread left), a damaged pack's load
failure still reports the check's checksum error. The check is slowed down (a pause per expert
record) so that "at once" is measurable against its full duration."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

import estream
import estream_layout.verify as layout_verify
from estream import data
from estream.errors import BadRequestError
from estream_layout import Manifest, pack_model, synth_model

ENGINE_KW = {"G": 2, "Q": 2, "B": 2, "act": "f32"}
PAUSE_S = 0.2  # per expert record of the check


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("loaderr")
    synth_model("qwen3moe", "tiny", d / "m.gguf", seed=4)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


@pytest.fixture
def slow_check(monkeypatch, pack) -> float:
    """Each expert record's check pauses `PAUSE_S`; returns the check's least duration."""
    real = layout_verify.nonfinite_record

    def slow(*args, **kw):
        time.sleep(PAUSE_S)
        return real(*args, **kw)

    monkeypatch.setattr(layout_verify, "nonfinite_record", slow)
    return PAUSE_S * sum(la.n_experts for la in Manifest.from_path(pack).layers)


def _check_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "estream-pack-check"]


@pytest.mark.parametrize(
    "engine",
    [{**ENGINE_KW, "G": 0}, {**ENGINE_KW, "n_threads": -1}, {**ENGINE_KW, "no_such_option": 1}],
)
def test_an_options_error_comes_out_without_the_check(pack, slow_check, engine) -> None:
    """A load refused for its options raises its own error well before the check could have
    read the pack, and the check's thread is gone when it does."""
    assert slow_check >= 2.0  # the check alone takes this long
    t0 = time.perf_counter()
    with pytest.raises((BadRequestError, TypeError)):
        data.TaskRunner(pack, "classify", engine=engine)
    assert time.perf_counter() - t0 < slow_check / 2
    assert not _check_threads()


def test_a_damaged_pack_still_reports_the_check(pack, slow_check, tmp_path) -> None:
    """A load that fails on the damaged pack (model.gguf flipped) waits for the slowed check
    and reports its checksum error, every damaged file counted."""
    bad = tmp_path / "bad.estream"
    shutil.copytree(pack, bad)
    for name in ("model.gguf", "experts.bin"):
        blob = bytearray((bad / name).read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (bad / name).write_bytes(bytes(blob))
    with pytest.raises(estream.PackError, match=r"model\.gguf: checksum .*\(and 1 more\)"):
        data.TaskRunner(bad, "classify", engine=ENGINE_KW)
    assert not _check_threads()
