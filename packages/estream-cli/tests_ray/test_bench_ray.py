"""integration/bench/bench_ray.py in a tiny mode (the full run is `nox -s bench_ray`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_ray_measures_both_sides_and_compares_the_answers(tmp_path: Path) -> None:
    """On a tiny preset the bench runs the plain command and one Ray actor, writes rows/s for
    both, the overhead at one actor and the Ray run's phases, and finds the same answers on
    both sides."""
    out = tmp_path / "bench_ray.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "integration" / "bench" / "bench_ray.py"),
         "--preset", "tiny", "--arch", "qwen3moe", "--rows", "12", "--labels", "4",
         "--budget", "64MiB", "--block-rows", "4", "--systems", "plain,ray-1",
         "--cache", str(tmp_path / "cache"), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["runs"]] == ["plain", "ray-1"]
    assert all(r["run_s"] > 0 and r["wall_s"] >= r["run_s"] for r in doc["runs"])
    assert doc["runs"][1]["same_answers"] is True
    assert "phases" not in doc["runs"][0] and "pack check" in doc["runs"][1]["phases"]
    plain, ray1 = doc["runs"]
    assert doc["overhead_one_actor_run"] == ray1["run_s"] / plain["run_s"] - 1
    assert doc["rows"] == 12 and doc["labels"] == 4
