from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from estream_layout import Manifest
from estream_layout.cli import pack_main, synth_main

BIN = Path(sys.executable).parent


def _one_error_line(err: str, prog: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err
    return lines[0]


def test_synth_pack_verify_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.gguf"
    assert synth_main(["--arch", "lfm2moe", "--preset", "tiny", "--seed", "2", "-o", str(src)]) == 0
    dst = tmp_path / "m.estream"
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 0
    assert "packed" in capsys.readouterr().out
    assert pack_main(["--verify", str(dst), "--against", str(src)]) == 0
    assert "OK" in capsys.readouterr().out
    assert pack_main(["--verify", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert pack_main(["--inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "lfm2moe" in out and "MoE: [1, 2, 3]" in out
    assert pack_main(["--inspect", str(dst), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["moe_layers"] == [1, 2, 3]
        and info["experts_bytes"] == Manifest.from_path(dst).experts_bytes
    )


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    assert pack_main([str(bad), "-o", str(tmp_path / "x.estream")]) == 2
    assert "not a GGUF file" in _one_error_line(capsys.readouterr().err, "estream-pack")
    assert pack_main([str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "x.estream")]) == 2
    assert "no such file" in _one_error_line(capsys.readouterr().err, "estream-pack")
    assert pack_main(["--inspect", str(tmp_path)]) == 2
    assert "no manifest.json" in _one_error_line(capsys.readouterr().err, "estream-pack")
    assert pack_main([str(bad)]) == 2
    _one_error_line(capsys.readouterr().err, "estream-pack")
    assert not (tmp_path / "x.estream").exists()


def test_force_and_corruption_exit_codes(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = tiny_models["olmoe"], tmp_path / "o.estream"
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 0
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 2
    assert "--force" in _one_error_line(capsys.readouterr().err, "estream-pack")
    assert pack_main([str(src), "-o", str(dst), "--force", "--no-progress"]) == 0
    m = Manifest.from_path(dst)
    with open(m.experts_path, "r+b") as fh:
        fh.seek(m.layers[0].offset)
        fh.write(b"\xff\xff")
    capsys.readouterr()
    assert pack_main(["--verify", str(dst)]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


def test_console_scripts(tmp_path: Path) -> None:
    src, dst = tmp_path / "q.gguf", tmp_path / "q.estream"
    r = subprocess.run(
        [BIN / "estream-synth", "--arch", "qwen3moe", "--preset", "tiny", "-o", src],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [BIN / "estream-pack", src, "-o", dst], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    assert "packing q.gguf" in r.stderr  # progress goes to stderr
    r = subprocess.run(
        [BIN / "estream-pack", src, "-o", dst], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run(
        [BIN / "estream-synth", "--arch", "gpt2", "--preset", "tiny", "-o", src],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_order_profile_option(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"layers": [{"index": 1, "counts": [0, 0, 0, 0, 0, 0, 0, 9]}]}))
    dst = tmp_path / "o.estream"
    assert (
        pack_main(
            [
                str(tiny_models["olmoe"]),
                "-o",
                str(dst),
                "--order-profile",
                str(prof),
                "--no-progress",
            ]
        )
        == 0
    )
    m = Manifest.from_path(dst)
    assert m.layer(1).order[0] == 7 and m.layer(0).order == tuple(range(8))
    assert pack_main(["--inspect", str(dst)]) == 0
    assert "profiled in layers [1]" in capsys.readouterr().out
    prof.write_text("{not json")
    assert (
        pack_main(
            [
                str(tiny_models["olmoe"]),
                "-o",
                str(tmp_path / "x.estream"),
                "--order-profile",
                str(prof),
            ]
        )
        == 2
    )
    assert "routing profile" in _one_error_line(capsys.readouterr().err, "estream-pack")
