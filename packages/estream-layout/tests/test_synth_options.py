"""`estream-synth` refuses seeds and `--dim` values that are not plain integers in range with
one error line and exit status 2, before writing anything: full-width or Arabic-Indic digits,
underscores, zero or negative widths and counts, sizes that would never finish."""

from __future__ import annotations

from pathlib import Path

import pytest

from estream_layout import synth_model
from estream_layout.cli import synth_main
from estream_layout.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--seed", "１"], "expected an integer (ASCII digits), got '１'"),
        (["--seed", "٣"], "expected an integer (ASCII digits)"),
        (["--seed", "1_000"], "expected an integer (ASCII digits)"),
        (["--seed", "1e3"], "expected an integer (ASCII digits)"),
        (["--seed", "-5"], "seed -5 must be an integer from 0 to 2**63 - 1"),
        (["--dim", "n_embd=３２"], "--dim 'n_embd=３２': expected NAME=N"),
        (["--dim", "n_embd=-32"], "--dim 'n_embd=-32': expected NAME=N"),
        (["--dim", "n_embd=0"], "n_embd = 0: must be an integer from 1 to 65536"),
        (["--dim", "n_ff_exp=0"], "n_ff_exp = 0: must be an integer from 1"),
        (["--dim", "n_experts=0"], "n_experts = 0: must be an integer from 1"),
        (["--dim", "n_layers=99999999"], "n_layers = 99999999: must be an integer from 1 to 4096"),
        (["--dim", "n_vocab=0"], "n_vocab = 0: must be an integer from 1"),
    ],
)
def test_bad_seed_or_dim_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    """Each bad value: exit status 2, exactly one stderr line naming it (argparse's usage block
    aside), no traceback, no output file."""
    out = tmp_path / "m.gguf"
    argv = ["--arch", "olmoe", "--preset", "tiny", "-o", str(out), "--no-progress", *extra]
    try:
        rc = synth_main(argv)
    except SystemExit as e:  # argparse's own refusal of an option value
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("estream-synth")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err
    assert not out.exists()


def test_synth_model_checks_changed_counts(tmp_path: Path) -> None:
    """The library refuses the same counts (the command is not the only caller)."""
    with pytest.raises(InvalidArgumentError, match="head_dim = 0"):
        synth_model("olmoe", "tiny", tmp_path / "m.gguf", head_dim=0)
    with pytest.raises(InvalidArgumentError, match="n_head = True"):
        synth_model("olmoe", "tiny", tmp_path / "m.gguf", n_head=True)
    assert not (tmp_path / "m.gguf").exists()
