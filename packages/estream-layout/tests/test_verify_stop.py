"""`verify_pack`'s ``stop``: the caller ends a check early; a stopped check concludes nothing."""

from __future__ import annotations

import pytest

from estream_layout import Manifest, VerifyStoppedError, pack_model, synth_model, verify_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stop")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=3)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def test_stop_never_set_checks_everything(pack) -> None:
    """A ``stop`` that never says True changes nothing: every record is checked, no problem."""
    asked = []

    def stop() -> bool:
        asked.append(1)
        return False

    report = verify_pack(pack, stop=stop)
    m = Manifest.from_path(pack)
    assert report.ok and report.checked_records == sum(la.n_experts for la in m.layers)
    assert len(asked) >= report.checked_records  # asked before every record at least


@pytest.mark.parametrize("after", [0, 1, 5])
def test_stop_ends_the_check_at_the_next_chunk(pack, after) -> None:
    """Once ``stop`` says True the check raises VerifyStoppedError and asks no more: it reads
    no further chunk or record."""
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > after

    with pytest.raises(VerifyStoppedError, match="stopped before it read every byte"):
        verify_pack(pack, stop=stop)
    assert len(asked) == after + 1
