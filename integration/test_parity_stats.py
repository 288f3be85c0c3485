"""The parity benchmark (integration/bench/parity.py): its figures over several prompts
(geometric-mean errors, the engine-minus-llama.cpp bootstrap interval over prompts) and its
work directory, removed when a run ends however it ends."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

import parity
from parity import aggregate, compare, paired


def _logits(rng: np.random.Generator, t: int = 64, v: int = 50) -> np.ndarray:
    """Random logits with a clear top-1 on every row (a margin that small noise cannot flip)."""
    out = rng.normal(size=(t, v))
    out[np.arange(t), rng.integers(0, v, size=t)] += 8.0
    return out


def _flip(ref: np.ndarray, n: int, scale: float) -> np.ndarray:
    """`ref` plus noise of relative size `scale`, with the top-1 moved on the first `n` rows."""
    rng = np.random.default_rng(n)
    out = ref + scale * np.linalg.norm(ref) / np.sqrt(ref.size) * rng.normal(size=ref.shape)
    for i in range(n):
        j = int(np.argsort(ref[i])[-2])
        out[i, j] = out[i].max() + 1.0
    return out


def test_one_prompt_aggregates_to_its_own_comparison() -> None:
    """With one prompt the aggregated figures are that prompt's `compare` figures."""
    ref = _logits(np.random.default_rng(0))
    c = compare(_flip(ref, 3, 0.01), ref)
    a = aggregate([c])
    assert a["n_prompts"] == 1
    for key in ("rel_l2", "top1", "max_abs", "n_decisive", "top1_decisive"):
        assert a[key] == c[key]


def test_error_is_the_geometric_mean_over_prompts_and_top1_is_over_all_positions() -> None:
    """Two prompts with errors about 1e-2 and 4e-2 aggregate to the geometric mean of the two
    (not their arithmetic mean); top-1 agreement is the share of all positions of both prompts."""
    rng = np.random.default_rng(1)
    refs = [_logits(rng), _logits(rng)]
    cmps = [compare(_flip(refs[0], 2, 0.01), refs[0]), compare(_flip(refs[1], 6, 0.04), refs[1])]
    a = aggregate(cmps)
    expect = float(np.sqrt(cmps[0]["rel_l2"] * cmps[1]["rel_l2"]))
    assert np.isclose(a["rel_l2"], expect, rtol=1e-12)
    assert not np.isclose(a["rel_l2"], (cmps[0]["rel_l2"] + cmps[1]["rel_l2"]) / 2, rtol=1e-3)
    assert a["top1"] == 1.0 - 8 / 128
    assert a["rel_l2_prompts"] == [cmps[0]["rel_l2"], cmps[1]["rel_l2"]]
    assert a["top1_prompts"] == [1.0 - 2 / 64, 1.0 - 6 / 64]


def test_paired_difference_and_interval_over_prompts() -> None:
    """The engine one flip behind llama.cpp on every prompt: the difference is exactly -1/64
    with a collapsed interval; with differences that vary over prompts the 95% interval holds
    the mean, lies within the per-prompt extremes and is not a single point."""
    rng = np.random.default_rng(2)
    refs = [_logits(rng) for _ in range(6)]
    llama = [compare(_flip(r, 2, 0.01), r) for r in refs]
    behind = paired([compare(_flip(r, 3, 0.02), r) for r in refs], llama)
    assert behind["n_prompts"] == 6
    assert np.isclose(behind["top1_diff"], -1 / 64) and np.allclose(
        behind["top1_diff_ci95"], -1 / 64
    )
    assert behind["rel_l2_ratio"] > 1.0
    lo, hi = behind["rel_l2_ratio_ci95"]
    assert lo <= behind["rel_l2_ratio"] <= hi

    flips = [0, 4, 1, 3, 2, 2]
    mixed = paired([compare(_flip(r, n, 0.01), r) for r, n in zip(refs, flips)], llama)
    diffs = [(2 - n) / 64 for n in flips]
    assert np.isclose(mixed["top1_diff"], np.mean(diffs))
    lo, hi = mixed["top1_diff_ci95"]
    assert min(diffs) <= lo < mixed["top1_diff"] < hi <= max(diffs)


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_the_work_directory_is_removed_unless_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool, keep: bool
) -> None:
    """The run's GGUFs, packs and references (GBs on the large presets) live in a temporary
    directory that is gone after the run, also when the run raises; --keep-work keeps it."""
    import tempfile

    seen: list[Path] = []

    def fake_run(args, version, archs, variants, work: Path) -> int:
        (work / "model.gguf").write_bytes(b"x" * 64)
        seen.append(work)
        if fails:
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(parity, "ensure_llama_cpp", lambda: None)
    monkeypatch.setattr(parity, "llama_cpp_version", lambda: "test")
    monkeypatch.setattr(parity, "_run", fake_run)
    argv = ["--archs", "olmoe", "--out", str(tmp_path / "out.json")] + (["--keep-work"] * keep)
    if fails:
        with pytest.raises(KeyboardInterrupt):
            parity.main(argv)
    else:
        assert parity.main(argv) == 0
    assert len(seen) == 1 and seen[0].parent == tmp_path
    assert seen[0].exists() == keep


def test_engine_runs_pair_q8_with_each_attention_and_f32_with_f32_attention() -> None:
    """--engine-attention f32,bf16: q8 runs once per precision, f32 activations only with
    fp32 attention (that path is held to the float64 reference); a bad precision is an error."""
    both = [("q8", "f32"), ("q8", "bf16"), ("f32", "f32")]
    assert parity.engine_runs("q8,f32", "f32,bf16") == both
    assert parity.engine_runs("q8,f32", "f32") == [("q8", "f32"), ("f32", "f32")]
    assert parity.engine_runs("f32", "bf16") == [("f32", "f32")]
    assert parity.engine_runs("q8", "bf16") == [("q8", "bf16")]
    assert parity.engine_runs("q8,f32", "bf16-pv,f32") == [
        ("q8", "bf16-pv"),
        ("q8", "f32"),
        ("f32", "f32"),
    ]
    with pytest.raises(ValueError, match="choose from f32, bf16, bf16-pv"):
        parity.engine_runs("q8", "f32,fp16")
    with pytest.raises(ValueError, match="empty"):
        parity.engine_runs("q8", " , ")
    assert parity.run_label("q8", "bf16") == "q8+bf16a"
    assert parity.run_label("q8", "bf16-pv") == "q8+bf16pva"
    assert parity.run_label("q8", "f32") == "q8"
