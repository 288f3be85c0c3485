"""The configurator's margin for slower reads, through the library and the commands: a budget's
`G, Q, B` are chosen for reads 1.5 times as long as profiled unless ``read_margin`` (or
``--read-margin``) says otherwise."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

import estream_sched as es
from estream import EngineOptions, load
from estream.config import configure_for_budget
from estream.errors import BadRequestError
from estream.packed import PackedModel, update_config
from estream_cli.main import main

BUDGET = 4 << 30  # every configuration fits: only the ranking decides


@pytest.fixture
def fragile(profiled: Path, tmp_path: Path) -> Path:
    """A copy of the profiled pack (8 experts, g = 1 and 2) whose profile has, per layer, 2 s
    of attention and, for g=2, four 2 s reads behind 2.2 s of compute each (hidden with 0.2 s
    to spare: 2 + 4 · 2.2 = 10.8 s) and, for g=1, eight 1 s reads behind 1.15 s each
    (2 + 8 · 1.15 = 11.2 s). With reads 1.5 times as long both are read-bound and g=2's
    larger reads cost more: g=1 finishes at 8 · 1.5 + 1.15 = 13.15 s, g=2 at 4 · 3 + 2.2."""
    dst = tmp_path / "fragile.estream"
    shutil.copytree(profiled, dst)
    doc = copy.deepcopy(PackedModel(dst).manifest["profile"])
    assert doc["n_experts"] == 8 and sorted(doc["candidates"]) == ["1", "2"]
    per_group = {"1": (1.0, 1.15), "2": (2.0, 2.2)}
    for g, layers in doc["candidates"].items():
        read_s, exec_s = per_group[g]
        for lp in layers:
            n = len(lp["group_bytes"])
            lp.update(t_ne=2.0, routes=[3] * n, read_times=[read_s] * n, exec_times=[exec_s] * n)
    doc["q_measured"] = 1
    doc["bandwidth"] = {g: {q: 1e9 for q in d} for g, d in doc["bandwidth"].items()}
    update_config(dst, "profile", doc)
    return dst


def test_a_budget_is_chosen_for_slower_reads_unless_told_otherwise(fragile: Path) -> None:
    model = PackedModel(fragile)
    exact = configure_for_budget(model, BUDGET, read_margin=0.0)
    robust = configure_for_budget(model, BUDGET)
    assert exact.G == 2 and exact.read_margin == 0.0
    assert exact.predicted_s == pytest.approx(2 * 10.8)  # two MoE layers
    assert robust.G == 1 and robust.read_margin == es.DEFAULT_READ_MARGIN == 0.5
    assert robust.predicted_s == pytest.approx(2 * 11.2)
    assert robust.slow_reads_s == pytest.approx(2 * 13.15)
    # the engine takes the same choice, and its option reaches the configurator
    with load(fragile, budget=BUDGET, n_threads=1) as e:
        assert (e.config.G, e.config.Q, e.config.B) == (robust.G, robust.Q, robust.B)
    with load(fragile, budget=BUDGET, n_threads=1, read_margin=0) as e:
        assert (e.config.G, e.config.Q, e.config.B) == (exact.G, exact.Q, exact.B)


def test_estream_config_reports_and_takes_the_margin(
    fragile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["config", str(fragile), "--budget", "4GiB", "--threads", "1"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["G"] == 1 and doc["read_margin"] == 0.5
    assert doc["slow_reads_s"] == pytest.approx(2 * 13.15)
    assert all(r["slow_reads_s"] >= r["predicted_s"] for r in doc["table"])
    assert main([*args, "--json", "--read-margin", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["G"] == 2 and doc["read_margin"] == 0.0
    assert all(r["slow_reads_s"] == r["predicted_s"] for r in doc["table"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "G=1 " in out and "(26300.0 ms with reads 1.5 times as long)" in out
    assert "slow reads" in out


@pytest.mark.parametrize("bad", ["-1", "abc", "11", "nan", "0x1"])
def test_a_bad_margin_is_refused_by_the_parser(
    profiled: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["config", str(profiled), "--budget", "4GiB", f"--read-margin={bad}"])
    assert exc.value.code == 2
    assert "--read-margin" in capsys.readouterr().err


def test_a_margin_without_a_budget_is_refused(
    profiled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["prefill", str(profiled), "--tokens", "1,2,3", "--read-margin", "0.5"])
    assert code == 2  # a usage error, as --budget with -G is
    err = capsys.readouterr().err
    assert "--read-margin" in err and "give --budget" in err


@pytest.mark.parametrize("bad", [-0.5, 12.0, float("nan"), "0.5", True])
def test_engine_options_refuse_a_bad_margin(bad: object) -> None:
    with pytest.raises(BadRequestError, match="read_margin must be between 0 and 10"):
        EngineOptions(read_margin=bad)  # type: ignore[arg-type]
