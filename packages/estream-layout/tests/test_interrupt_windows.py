"""An interrupt (KeyboardInterrupt) at the moment a temporary is created, before any code of
the writer's could note it, leaves nothing behind: the temporary pack directory of
`pack_model`, the temporary GGUF of `synth_model` and the temporary JSON of
`write_json_atomic` are named first and made inside the `try` that removes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from estream_layout import pack_model, synth_model
from estream_layout.manifest import write_json_atomic


def _interrupt_on_creating(monkeypatch: pytest.MonkeyPatch, call: str, part: str) -> list[str]:
    """`os.<call>` (mkdir or open) raises KeyboardInterrupt right after it made a path whose
    name holds `part`, as a Ctrl-C that lands just as the call returns would; the paths made."""
    real = getattr(os, call)
    made: list[str] = []

    def interrupted(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        if part in os.path.basename(os.fspath(path)):
            made.append(os.fspath(path))
            if call == "open":
                os.close(result)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(os, call, interrupted)
    return made


def test_pack_interrupted_as_its_temporary_directory_is_made(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _interrupt_on_creating(monkeypatch, "mkdir", ".tmp-")
    with pytest.raises(KeyboardInterrupt):
        pack_model(tiny_models["olmoe"], tmp_path / "m.estream", progress=False)
    assert len(made) == 1
    assert os.listdir(tmp_path) == []


def test_synth_interrupted_as_its_temporary_file_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _interrupt_on_creating(monkeypatch, "open", ".tmp-")
    with pytest.raises(KeyboardInterrupt):
        synth_model("olmoe", "tiny", tmp_path / "m.gguf", seed=1, progress=False)
    assert len(made) == 1
    assert os.listdir(tmp_path) == []


def test_json_write_interrupted_as_its_temporary_file_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _interrupt_on_creating(monkeypatch, "open", ".tmp")
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(tmp_path / "doc.json", {"a": 1})
    assert len(made) == 1
    assert os.listdir(tmp_path) == []
