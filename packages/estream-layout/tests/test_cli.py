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


KQ_DIMS = ["--dim", "n_embd=256", "--dim", "n_ff_exp=256"]


@pytest.mark.parametrize(
    ("types", "want"),
    [
        (["--expert-type", "Q8_0"], ["q8_0-t32r4"] * 3),
        (["--expert-type", "Q6_K", *KQ_DIMS], ["q6_k-t32r4"] * 3),
        (["--expert-type", "MXFP4", "--dense-type", "MXFP4"], ["mxfp4-t32r4"] * 3),
        (["--expert-type", "IQ4_NL", "--dense-type", "IQ4_NL"], ["iq4_nl-t32r4"] * 3),
        (["--dense-type", "F16"], ["q4_0-t32r4"] * 3),
        (["--dense-type", "BF16"], ["q4_0-t32r4"] * 3),
        (
            ["--expert-type", "IQ4_XS", "--dense-type", "IQ4_XS", *KQ_DIMS, "--dim", "head_dim=64"],
            ["iq4_xs-t32r4"] * 3,
        ),
        (
            [
                "--expert-type",
                "Q4_K",
                "--expert-down-type",
                "Q6_K",
                "--dense-type",
                "Q8_0",
                *KQ_DIMS,
            ],
            ["q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4"],
        ),
    ],
)
def test_synth_types_pack_as_stored_and_inspect_shows_them(
    types: list[str], want: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream-synth --expert-type/--expert-down-type/--dense-type` writes those types; the
    pack keeps them (manifest formats, no re-quantization) and `--inspect` shows the mix."""
    src, dst = tmp_path / "m.gguf", tmp_path / "m.estream"
    argv = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress", *types, "-o", str(src)]
    assert synth_main(argv) == 0
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 0
    capsys.readouterr()
    m = Manifest.from_path(dst)
    assert m.source["requantized"] is False
    assert all(
        [la.projections[j].format for j in ("gate", "up", "down")] == want for la in m.layers
    )
    assert pack_main(["--inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"gate={want[0]} up={want[1]} down={want[2]} (layers [0, 1])" in out
    if "--dense-type" in types:  # the dense matrices (and Q8_0 output head) in that type
        dense = {
            "Q8_0": "q8_0-t32r4: 10 tensors",
            "MXFP4": "mxfp4-t32r4: 9 tensors",
            "IQ4_NL": "iq4_nl-t32r4: 9 tensors",
            "IQ4_XS": "iq4_xs-t32r4: 9 tensors",
            "F16": "f16-t32r4: 9 tensors",
            "BF16": "bf16-t32r4: 9 tensors",
        }
        line = next(x for x in out.splitlines() if "dense.bin:" in x)
        assert dense[types[types.index("--dense-type") + 1]] in line and "q4_0-t32r4" not in line


def test_unsupported_expert_type_is_one_line_and_requantize_opts_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """F16 experts: `estream-pack` refuses with one line naming the type, the supported types
    and --requantize, writing nothing; with `--requantize q4_0` it packs, marked re-quantized.
    A K-quant type on widths that are not whole super-blocks is one synth error line."""
    src, dst = tmp_path / "m.gguf", tmp_path / "m.estream"
    assert synth_main(["--arch", "qwen3moe", "--preset", "tiny", "--expert-type", "F16",
                       "--no-progress", "-o", str(src)]) == 0  # fmt: skip
    capsys.readouterr()
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err, "estream-pack")
    assert (
        "F16" in line
        and "Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4" in line
        and "--requantize q4_0" in line
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert pack_main([str(src), "-o", str(dst), "--no-progress", "--requantize", "q4_0"]) == 0
    assert Manifest.from_path(dst).source["requantized"] is True
    capsys.readouterr()
    bad = [
        "--arch",
        "qwen3moe",
        "--preset",
        "tiny",
        "--expert-type",
        "Q4_K",
        "-o",
        str(tmp_path / "k.gguf"),
    ]
    assert synth_main(bad) == 2
    assert "multiple of the Q4_K block size 256" in _one_error_line(
        capsys.readouterr().err, "estream-synth"
    )


def test_synth_never_replaces_a_file_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream-synth -o` onto an existing file (or a directory) is one error line and leaves
    it as it was; with --force the file is replaced by the new model."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"somebody's file")
    argv = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress", "-o", str(out)]
    assert synth_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists; add --force" in err
    assert out.read_bytes() == b"somebody's file"
    assert synth_main([*argv[:-2], "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert synth_main([*argv, "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
