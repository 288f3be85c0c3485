"""A stored profile records what it was measured with; a run on other kernels, another CPU,
another thread count or other expert formats (or with a profile that records nothing) does not
take the profile's configuration: it warns and runs the default, and `estream config` refuses."""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

import estream_sched as es
from estream import config, load
from estream.config import (
    IDENTITY_KEYS,
    StaleProfileWarning,
    profile_mismatch,
    resolve_config,
    running_identity,
)
from estream.errors import BudgetTooSmallError, StaleProfileError
from estream.packed import PackedModel, update_config
from estream.profiling import profile_model
from estream_cli.main import main

THREADS = 1  # the `profiled` pack's calibration threads (conftest); runs say theirs
BUDGET = 4 << 30


@pytest.fixture
def pack(profiled: Path, tmp_path: Path) -> Path:
    """A copy of the profiled pack that a test may change."""
    dst = tmp_path / "p.estream"
    shutil.copytree(profiled, dst)
    return dst


def _set_measured_with(path: Path, value: dict[str, Any] | None) -> None:
    doc = copy.deepcopy(PackedModel(path).manifest["profile"])
    if value is None:
        doc.pop("measured_with", None)
    else:
        doc["measured_with"] = value
    update_config(path, "profile", doc)


def _budget_config(path: Path, n_threads: int = THREADS) -> config.StreamConfig:
    cfg = resolve_config(PackedModel(path), "stream", BUDGET, None, None, None, n_threads=n_threads)
    assert cfg is not None
    return cfg


def test_the_profile_records_what_it_ran_with_and_reads_it_back(profiled: Path) -> None:
    """The stored profile's ``measured_with`` is the calibration's identity (CPU, SIMD set,
    kernel build, its thread count, q8, host, the pack's expert formats), and it survives the
    manifest round trip into `estream_sched.Profile`."""
    model = PackedModel(profiled)
    stored = model.manifest["profile"]["measured_with"]
    assert stored == running_identity(model, n_threads=THREADS)
    assert set(stored) == set(IDENTITY_KEYS)
    assert stored["threads"] == THREADS and stored["act"] == "q8" and stored["backend"] == "host"
    fmts = {f for lay in model.layers.values() for f in lay.formats}
    assert stored["expert_formats"] == sorted(fmts)
    assert stored["kernels"] == config.kernel_build() and stored["kernels"].startswith(
        "estream-htp "
    )
    assert es.Profile.from_dict(model.manifest["profile"]).measured_with == stored
    # how busy the machine was: the 1-min load before and after, and the CPU count
    meta = model.manifest["profile"]["meta"]
    assert len(meta["load_average"]) == 2 and all(x >= 0 for x in meta["load_average"])
    assert meta["cpus"] >= 1


def test_a_busy_machine_is_said_and_recorded(pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiling while the machine is busy (a 1-min load above half its CPUs) says that the
    times are inflated, and the profile records the load it was measured under."""
    import os

    from estream import profiling

    monkeypatch.setattr(profiling.os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    lines: list[str] = []
    prof = profile_model(
        pack, candidates=(1,), queue_depths=(1,), n_tokens=4, bw_rounds=1, log=lines.append
    )
    assert any("the machine is busy (1-min load 64.0" in ln for ln in lines)
    assert prof.meta["load_average"] == [64.0, 64.0] and prof.meta["cpus"] == os.cpu_count()
    monkeypatch.setattr(profiling.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    lines.clear()
    profile_model(
        pack, candidates=(1,), queue_depths=(1,), n_tokens=4, bw_rounds=1, log=lines.append
    )
    assert not any("busy" in ln for ln in lines)


def test_a_fresh_profile_configures_the_budget(profiled: Path) -> None:
    """With the calibration's identity the budget is configured from the profile, as
    `estream_sched.configure` chooses, and no warning is given."""
    model = PackedModel(profiled)
    want = es.configure(es.Profile.from_dict(model.manifest["profile"]), BUDGET)
    cfg = _budget_config(profiled)
    assert (cfg.source, cfg.warning) == ("budget", None)
    assert (cfg.G, cfg.Q, cfg.B) == (want.G, want.Q, want.B)


@pytest.mark.parametrize("key", IDENTITY_KEYS)
def test_each_changed_identity_makes_the_profile_stale(profiled: Path, key: str) -> None:
    """Changing any one recorded value makes `profile_mismatch` name that key (and only it),
    with the recorded and the running value."""
    running = running_identity(PackedModel(profiled), n_threads=THREADS)
    recorded = dict(running)
    recorded[key] = (
        ["other-format"] if key == "expert_formats" else (99 if key == "threads" else "other")
    )
    diffs = profile_mismatch(recorded, running)
    assert len(diffs) == 1 and diffs[0].startswith(f"{key} ")
    assert "(profiled)" in diffs[0] and "(now)" in diffs[0]
    assert profile_mismatch(running, running) == []


def test_another_thread_count_takes_the_default_with_a_warning(profiled: Path) -> None:
    """A run at another thread count than the calibration's does not use the profile: the
    default G=min(4, N_e) Q=2 B=4 (it fits the budget), source ``stale-profile``, and a
    warning naming the thread counts and the command that re-profiles."""
    cfg = _budget_config(profiled, n_threads=THREADS + 1)
    n_e = PackedModel(profiled).hparams.n_experts
    assert (cfg.G, cfg.Q, cfg.B, cfg.source) == (min(4, n_e), 2, 4, "stale-profile")
    assert cfg.warning is not None
    assert f"threads {THREADS} (profiled) != {THREADS + 1} (now)" in cfg.warning
    assert "estream profile --if-stale" in cfg.warning


def test_a_changed_kernel_build_is_stale_and_the_engine_warns(
    profiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other kernels (another estream-htp build) than the profile's: loading with a budget
    issues one `StaleProfileWarning` and the pass reports ``config_source`` ``stale-profile``
    with the default configuration."""
    monkeypatch.setattr(config, "kernel_build", lambda: "estream-htp 9.9.9 0123456789abcdef")
    with pytest.warns(StaleProfileWarning, match=r"kernels estream-htp .* != estream-htp 9\.9\.9"):
        eng = load(profiled, budget=BUDGET, n_threads=THREADS)
    with eng:
        m = eng.prefill([1, 2, 3]).metrics
    assert m["config_source"] == "stale-profile"
    assert (m["G"], m["Q"], m["B"]) == (eng.config.G, 2, 4)


def test_a_profile_without_the_record_is_stale(pack: Path) -> None:
    """A profile from before ``measured_with`` existed (no such key) is treated as stale, and
    the message says that it records nothing."""
    _set_measured_with(pack, None)
    assert "measured_with" not in PackedModel(pack).manifest["profile"]
    cfg = _budget_config(pack)
    assert cfg.source == "stale-profile"
    assert cfg.warning is not None and "does not record what it was measured with" in cfg.warning


def test_a_stored_configuration_from_a_stale_profile_is_not_used(pack: Path) -> None:
    """The manifest's configuration was chosen from its profile: with the profile stale the run
    takes the default (fitting the configuration's budget) instead of it; fresh, it is used."""
    update_config(pack, "config", {"G": 1, "Q": 1, "B": 1, "budget_bytes": BUDGET})
    fresh = resolve_config(PackedModel(pack), "stream", None, None, None, None, n_threads=THREADS)
    assert fresh is not None and (fresh.G, fresh.Q, fresh.B, fresh.source) == (1, 1, 1, "manifest")
    _set_measured_with(pack, None)
    stale = resolve_config(PackedModel(pack), "stream", None, None, None, None, n_threads=THREADS)
    assert stale is not None and stale.source == "stale-profile" and (stale.Q, stale.B) == (2, 4)
    assert "stored configuration" in (stale.warning or "")


def test_the_default_shrinks_to_the_budget_and_refuses_below_it(pack: Path) -> None:
    """In place of a stale profile the default is shrunk to the first of (G,2,2), (1,2,2),
    (1,1,1) that fits the budget (the profile's largest non-arena memory plus the arena);
    below the smallest, `BudgetTooSmallError` with its minimum."""
    _set_measured_with(pack, None)
    model = PackedModel(pack)
    other = max(model.manifest["profile"]["m_other"].values())
    rec = sum(size for _, size in model.plane_extents)
    g0 = min(4, model.hparams.n_experts)

    def at(budget: int) -> tuple[int, int, int]:
        c = resolve_config(model, "stream", budget, None, None, None, n_threads=THREADS)
        assert c is not None and c.source == "stale-profile"
        assert c.memory_bytes is not None and c.memory_bytes <= budget
        return (c.G, c.Q, c.B)

    assert at(other + 4 * g0 * rec) == (g0, 2, 4)
    assert at(other + 4 * g0 * rec - 1) == (g0, 2, 2)
    assert at(other + 2 * g0 * rec - 1) == (1, 2, 2)
    assert at(other + 2 * rec - 1) == (1, 1, 1)
    with pytest.raises(BudgetTooSmallError) as exc:
        resolve_config(model, "stream", other + rec - 1, None, None, None, n_threads=THREADS)
    assert exc.value.minimum_bytes == other + rec and "stale profile" in str(exc.value)
    # for a longer prompt than the profile's pass, its extra activations count too (the
    # profile's measured memory per token)
    doc = copy.deepcopy(model.manifest["profile"])
    doc["m_per_token"] = 4096
    update_config(pack, "profile", doc)
    model = PackedModel(pack)
    tokens = config.profile_tokens(model) + 300
    extra = 300 * 4096
    c = resolve_config(model, "stream", other + extra + 4 * g0 * rec - 1, None, None, None, tokens)
    assert c is not None and c.extra_bytes == extra
    got = (c.G, c.Q, c.B)
    assert got == (g0, 2, 2)
    assert c.memory_bytes == other + extra + 2 * g0 * rec


def test_explicit_groups_ignore_the_profile(pack: Path) -> None:
    """Explicit -G/-Q/-B do not read the profile: no warning even when it is stale."""
    _set_measured_with(pack, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleProfileWarning)
        cfg = resolve_config(PackedModel(pack), "stream", None, 2, 2, 3, n_threads=THREADS)
    assert cfg is not None and (cfg.G, cfg.Q, cfg.B, cfg.source, cfg.warning) == (
        2,
        2,
        3,
        "explicit",
        None,
    )


def test_an_invalid_record_is_one_error_line(
    pack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``measured_with`` that is not what estream-sched accepts (a thread count given as
    true) stops `prefill --budget` with one error line naming the pack and the field."""
    doc = copy.deepcopy(PackedModel(pack).manifest["profile"])
    doc["measured_with"]["threads"] = True
    update_config(pack, "profile", doc)
    rc, _, err = run(capsys, "prefill", str(pack), "--tokens", "1,2", "--budget", "4GiB")
    assert rc == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("estream: error:")
    assert "stored profile is invalid" in lines[0] and "measured_with.threads" in lines[0]
    # --if-stale takes an invalid profile for a stale one and measures it again
    args = ["--candidates", "1,2", "--queue-depths", "1,2", "--tokens", "8", "--bw-rounds", "1"]
    rc, _, err = run(capsys, "profile", str(pack), "--if-stale", *args)
    assert rc == 0 and "stored profile is invalid" in err and "profile stored in" in err
    assert config.profile_staleness(PackedModel(pack)) == []


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prefill_warns_and_config_refuses_a_stale_profile(
    pack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream prefill --budget` with a stale profile runs (exit 0) with one
    ``estream: warning:`` line on stderr and the default configuration; `estream config`
    refuses it with one error line (exit 1) and stores nothing."""
    _set_measured_with(pack, None)
    rc, out, err = run(
        capsys, "prefill", str(pack), "--tokens", "1,2,3", "--budget", "4GiB", "--json"
    )
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.startswith("estream: warning:")]
    assert len(lines) == 1 and "stored profile is stale" in lines[0]
    assert json.loads(out)["metrics"]["config_source"] == "stale-profile"
    rc, _, err = run(capsys, "config", str(pack), "--budget", "4GiB")
    assert rc == 1 and "stored profile is stale" in err and "Traceback" not in err
    assert "estream profile --if-stale" in err
    assert PackedModel(pack).manifest.get("config") is None
    with pytest.raises(StaleProfileError, match="does not record"):
        config.require_fresh_profile(PackedModel(pack), n_threads=THREADS)


def test_cli_profile_if_stale(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`estream profile --if-stale` leaves a current profile alone (manifest unchanged) and
    re-measures a stale one, after which the profile matches this machine and configures
    again."""
    from estream.engine import DEFAULT_THREADS

    args = ["--candidates", "1,2", "--queue-depths", "1,2", "--tokens", "8", "--bw-rounds", "1"]
    _set_measured_with(pack, None)
    rc, _, err = run(capsys, "profile", str(pack), "--if-stale", *args)
    assert rc == 0 and "is stale: it does not record" in err and "profile stored in" in err
    before = (pack / "manifest.json").read_bytes()
    rc, _, err = run(capsys, "profile", str(pack), "--if-stale", *args)
    assert rc == 0 and "current; nothing to do" in err
    assert (pack / "manifest.json").read_bytes() == before
    model = PackedModel(pack)
    running = running_identity(model, n_threads=DEFAULT_THREADS)
    assert model.manifest["profile"]["measured_with"] == running
    assert config.profile_staleness(model) == [] and config.profile_staleness(
        model, DEFAULT_THREADS + 1
    ) == [f"threads {DEFAULT_THREADS} (profiled) != {DEFAULT_THREADS + 1} (now)"]
    # --threads: calibrated for runs at that count, and --if-stale compares with it
    other = DEFAULT_THREADS + 1
    rc, _, err = run(capsys, "profile", str(pack), "--if-stale", "--threads", str(other), *args)
    assert rc == 0 and f"threads {DEFAULT_THREADS} (profiled) != {other} (now)" in err
    assert PackedModel(pack).manifest["profile"]["measured_with"]["threads"] == other
    rc, _, err = run(capsys, "profile", str(pack), "--if-stale", "--threads", str(other), *args)
    assert rc == 0 and "current; nothing to do" in err
    rc, _, err = run(capsys, "config", str(pack), "--budget", "4GiB")  # the default threads
    assert rc == 1 and f"threads {other} (profiled) != {DEFAULT_THREADS} (now)" in err
    rc, _, err = run(capsys, "config", str(pack), "--budget", "4GiB", "--threads", str(other))
    assert rc == 0, err
