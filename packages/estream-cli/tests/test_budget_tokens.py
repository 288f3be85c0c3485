"""A memory budget holds for the prompt it is given for: the profile measured the memory of its
own (short) pass, and a longer prompt's extra activations count in every configuration's memory,
so the configurator, the engine and `estream prefill --budget` choose or refuse for that
prompt's length."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest

from estream import load, memory
from estream.config import (
    configure_for_budget,
    pass_bytes_per_token,
    profile_tokens,
)
from estream.errors import BudgetTooSmallError
from estream.packed import PackedModel, update_config
from estream.profiling import profile_model
from estream_cli.main import main
from estream_layout import pack_model, synth_model

THREADS = 1  # the `profiled` pack's calibration threads (conftest)
LONGER = 500  # tokens beyond the profile's pass
#: the profile's memory per token in the tests below (None: not recorded, the bound)
PER_TOKEN = 5000


@pytest.fixture(params=["recorded", "unrecorded"])
def pack(request: pytest.FixtureRequest, profiled: Path, tmp_path: Path) -> tuple[Path, int]:
    """A copy of the profiled pack whose profile records `PER_TOKEN` bytes per token, or
    nothing (a profile from before it was measured); and the bytes per token a budget counts."""
    dst = tmp_path / "p.estream"
    shutil.copytree(profiled, dst)
    doc = copy.deepcopy(PackedModel(dst).manifest["profile"])
    if request.param == "recorded":
        doc["m_per_token"] = PER_TOKEN
    else:
        doc.pop("m_per_token", None)
    update_config(dst, "profile", doc)
    model = PackedModel(dst)
    per = PER_TOKEN if request.param == "recorded" else pass_bytes_per_token(model.hparams)
    return dst, per


def _minimum(model: PackedModel, tokens: int) -> int:
    with pytest.raises(BudgetTooSmallError) as exc:
        configure_for_budget(model, 1, tokens)
    return exc.value.minimum_bytes


def test_a_longer_prompt_counts_its_activations_in_every_configuration(
    pack: tuple[Path, int],
) -> None:
    """For ``t0 + n`` tokens (``t0`` the profile's pass) every configuration's memory is the
    profile's plus ``n`` times its measured memory per token (`pass_bytes_per_token`, the
    bound, where it records none); a prompt no longer than the profile's adds nothing; the
    minimum budget grows by as much, and the error below it names the prompt."""
    path, per = pack
    model = PackedModel(path)
    t0 = profile_tokens(model)
    assert t0 == 8
    extra = LONGER * per
    base = configure_for_budget(model, 4 << 30, t0)
    long = configure_for_budget(model, 4 << 30, t0 + LONGER)
    assert base.extra_bytes == 0 and long.extra_bytes == extra
    assert configure_for_budget(model, 4 << 30, t0 // 2).extra_bytes == 0
    assert configure_for_budget(model, 4 << 30).extra_bytes == 0
    rows = {(r.g, r.q, r.b): r.memory_bytes for r in base.table}
    assert {(r.g, r.q, r.b): r.memory_bytes - extra for r in long.table} == rows
    m0 = _minimum(model, t0)
    assert _minimum(model, t0 + LONGER) == m0 + extra
    assert configure_for_budget(model, m0, t0).memory_bytes <= m0
    with pytest.raises(BudgetTooSmallError) as exc:
        configure_for_budget(model, m0, t0 + LONGER)
    assert exc.value.minimum_bytes == m0 + extra
    assert f"for a {t0 + LONGER}-token prompt" in str(exc.value)
    fits = configure_for_budget(model, m0 + extra, t0 + LONGER)
    assert fits.memory_bytes <= m0 + extra


def test_the_engine_and_prefill_refuse_a_budget_the_prompt_does_not_fit(
    pack: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`load(budget=, budget_tokens=)` and `estream prefill --budget` configure for the prompt
    they run: the profile-length minimum is refused for a longer prompt (one error line, exit
    1, the pack untouched), and the budget that holds its activations runs it within the
    prediction."""
    pack, per = pack
    model = PackedModel(pack)
    t0 = profile_tokens(model)
    n = t0 + LONGER
    extra = LONGER * per
    m0 = _minimum(model, t0)
    with pytest.raises(BudgetTooSmallError, match=re.escape(f"for a {n}-token prompt")):
        load(pack, budget=m0, budget_tokens=n, n_threads=THREADS)
    with load(pack, budget=m0 + extra, budget_tokens=n, n_threads=THREADS) as eng:
        assert eng.config is not None and eng.config.source == "budget"
        assert eng.config.extra_bytes == extra
        assert eng.config.memory_bytes is not None and eng.config.memory_bytes <= m0 + extra
    before = (pack / "manifest.json").read_bytes()
    ids = ",".join(str(1 + i % 50) for i in range(n))
    argv = ["prefill", str(pack), "--tokens", ids, "--threads", str(THREADS), "--budget"]
    rc = main([*argv, str(m0)])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("estream: error: budget ")
    assert f"for a {n}-token prompt" in lines[0]
    assert (pack / "manifest.json").read_bytes() == before
    rc = main([*argv, str(m0 + extra), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err


def test_the_profile_measures_memory_per_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`estream profile` runs its first candidate's engine once more at twice the calibration
    length: ``m_per_token`` is what that pass's peak grew by, per token (here a peak of
    ``1 GiB + 3000 B`` per token, as the passes report it), and never negative."""
    from estream.engine import Engine

    synth_model("olmoe", "tiny", tmp_path / "m.gguf", seed=3)
    pack_model(tmp_path / "m.gguf", tmp_path / "m.estream", progress=False)
    real = Engine.prefill
    lengths: list[int] = []

    def prefill(self: Engine, tokens: object, **kw: object) -> object:
        res = real(self, tokens, **kw)  # type: ignore[arg-type]
        n = len(tokens)  # type: ignore[arg-type]
        lengths.append(n)
        res.metrics["peak_rss_bytes"] = (1 << 30) + slope * n
        return res

    monkeypatch.setattr(Engine, "prefill", prefill)
    args = {"candidates": (1, 2), "queue_depths": (1,), "n_tokens": 16, "bw_rounds": 1}
    slope = 3000
    prof = profile_model(tmp_path / "m.estream", n_threads=THREADS, **args)  # type: ignore[arg-type]
    assert prof.m_per_token == 3000
    assert lengths == [8, 16, 32, 8, 16]  # warm-up, calibration, the longer pass; next g
    assert prof.to_dict()["m_per_token"] == 3000
    slope = -50  # a peak that does not grow: 0, not a negative size
    assert profile_model(tmp_path / "m.estream", n_threads=THREADS, **args).m_per_token == 0  # type: ignore[arg-type]


def test_config_prints_the_prompt_s_share_of_the_memory(
    pack: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream config --tokens` chooses for that prompt and says how much of the memory is its
    activations beyond the profile's pass; at the profile's length it says nothing of it."""
    path, per = pack
    t0 = profile_tokens(PackedModel(path))
    argv = ["config", str(path), "--budget", "4GiB", "--threads", str(THREADS), "--tokens"]
    assert main([*argv, str(t0 + LONGER)]) == 0
    out = capsys.readouterr().out.splitlines()[0]
    assert f"of {t0 + LONGER} tokens" in out
    assert f", {memory.format_bytes(LONGER * per)} of it the longer prompt's" in out
    assert main([*argv, str(t0)]) == 0
    assert "longer prompt" not in capsys.readouterr().out


def test_profile_tokens_falls_back_where_the_profile_records_none(
    profiled: Path, tmp_path: Path
) -> None:
    """The profile's pass length is its ``meta.tokens`` as estream-sched checks it; without a
    profile, or with one that records none (or an invalid one), the default 256."""
    from estream.config import PROFILE_TOKENS

    dst = tmp_path / "p.estream"
    shutil.copytree(profiled, dst)
    assert profile_tokens(PackedModel(dst)) == 8
    doc = copy.deepcopy(PackedModel(dst).manifest["profile"])
    for bad in (None, 0, True, "8"):
        doc["meta"] = {**doc["meta"], "tokens": bad}
        update_config(dst, "profile", doc)
        assert profile_tokens(PackedModel(dst)) == PROFILE_TOKENS
    update_config(dst, "profile", None)
    assert profile_tokens(PackedModel(dst)) == PROFILE_TOKENS


def test_a_pass_longer_than_the_budget_was_chosen_for_warns(
    pack: tuple[Path, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine whose budget configuration was chosen for the profile's pass says so when a
    longer pass's predicted memory (`Engine.predicted_bytes`: the prediction plus the extra
    rows' activations) is above the budget, and runs it; a pass it was chosen for, an engine
    chosen for the longer pass, and an engine without a budget say nothing. `estream eval
    perplexity --budget` (passes of --ctx tokens) shows the warning as one line and exits 0."""
    import warnings

    from estream.config import OverBudgetWarning

    path, per = pack
    model = PackedModel(path)
    t0 = profile_tokens(model)
    n = t0 + LONGER
    m0 = _minimum(model, t0)
    ids = [1 + i % 50 for i in range(n)]
    with load(path, budget=m0, n_threads=THREADS) as eng:
        assert eng.config is not None and eng.config.memory_bytes is not None
        assert eng.predicted_bytes(t0) == eng.config.memory_bytes
        assert eng.predicted_bytes(n) == eng.config.memory_bytes + LONGER * per
        with warnings.catch_warnings():
            warnings.simplefilter("error", OverBudgetWarning)
            eng.prefill(ids[:t0])
        with pytest.warns(OverBudgetWarning) as rec:
            res = eng.prefill(ids)
        assert res.logits.shape == (model.hparams.n_vocab,)
        (w,) = rec.list
        msg = str(w.message)
        assert f"a pass of {n} tokens" in msg and f"up to {t0} tokens" in msg
        assert memory.format_bytes(m0) in msg and f"budget_tokens={n}" in msg
        assert memory.format_bytes(eng.predicted_bytes(n)) in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverBudgetWarning)
        with load(path, budget=m0 + LONGER * per, budget_tokens=n, n_threads=THREADS) as eng:
            eng.prefill(ids)
        with load(path, n_threads=THREADS) as eng:
            assert eng.predicted_bytes(n) is None
            eng.prefill(ids)
    (tmp_path / "t.txt").write_text(" ".join(["word"] * n))
    argv = ["eval", "perplexity", str(path), "--text-file", str(tmp_path / "t.txt")]
    argv += ["--ctx", str(n), "--threads", str(THREADS), "--budget", str(m0)]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = [x for x in err.splitlines() if "warning" in x]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"estream: warning: a pass of {n} tokens is predicted"), err
    assert "budget_tokens" not in err and "OverBudgetWarning" not in err
    assert "Traceback" not in err


def test_a_task_command_chooses_its_budget_for_its_longest_request(
    pack: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream classify --budget` chooses the configuration for its prompt's pass, as
    `estream prefill --budget` does: the profile-length minimum is refused for a long prompt
    (one error line naming its length, exit 1) and the minimum for its length runs without a
    warning."""
    path, _ = pack
    model = PackedModel(path)
    t0 = profile_tokens(model)
    prompt = " ".join(["word"] * LONGER)
    argv = ["classify", str(path), "--prompt", prompt, "--labels", "a,b", "--threads", "1"]
    rc = main([*argv, "--budget", str(_minimum(model, t0))])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "", err
    (line,) = err.strip().splitlines()
    n = int(re.search(r"for a (\d+)-token prompt", line).group(1))  # type: ignore[union-attr]
    assert n > LONGER
    rc = main([*argv, "--budget", str(_minimum(model, n)), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "warning" not in err, err
