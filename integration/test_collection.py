"""`pytest` run from the repository root collects every test file of every package and of
integration/, although test module names repeat across packages (the root pyproject's
importlib import mode)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_root_collection_has_no_errors_and_every_test_file() -> None:
    """`python -m pytest --co -q` at the root exits 0, reports no collection error, and lists
    a test from every ``test_*.py`` under packages/*/tests and integration/, including the
    files whose names repeat across packages."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "error" not in out.stdout.splitlines()[-1].lower(), out.stdout[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    files = sorted(
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("packages/*/tests/test_*.py"), *ROOT.glob("integration/test_*.py")]
    )
    assert [f for f in files if f not in collected] == []
    repeated = [name for name, n in Counter(Path(f).name for f in files).items() if n > 1]
    assert repeated, "no repeated test module name left: this check would prove nothing"
