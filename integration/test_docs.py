"""The repository reads as reference documentation, and its Python examples run as written.

Two properties:

* no file in the repository cites a tracker nobody can see (an issue, defect or bug number) or
  is a dated work log (dated entries, "(machine clock)", an ordinal work period such as "the fifth"
  day's sitting, in the sense of a working day). Benchmark results are the exception: their JSON files and the page generated
  from them (``docs/benchmarks.md``) carry the date and machine of each measurement by design.
* every fenced ``python`` block of every README (top level and under ``packages/``) and of
  ``docs/*.md`` runs, unchanged, in a fresh scratch directory with this environment's Python.
  A block that needs files (a packed model, a profile) declares how to make them in HTML
  comments right above its fence, ``<!-- setup: SHELL COMMAND -->``, one or more; those
  commands run first in the same directory, with this environment's ``bin/`` on ``PATH``
  (``estream``, ``estream-synth``, ``estream-pack``). Setup commands use the ``tiny`` preset,
  or ``small`` where a block shows a real vocabulary's token ids (``small`` copies llama.cpp's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 600

# -- no tracker references, no work logs ------------------------------------------------------
# Folders that are never part of the repository's content (virtualenvs, build output, caches).
_NOT_SOURCE = {
    ".git",
    ".venv",
    ".nox",
    "build",
    "dist",
    "__pycache__",
    ".cache",
    ".eggs",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
}
# Generated benchmark results: dated by design. The README's headline table is generated from them
# between these markers.
_RESULTS_DIRS = {"results", "bench-results"}
_GENERATED = {"docs/benchmarks.md"}
_GENERATED_REGION = re.compile(
    r"<!-- bench:headline:start -->.*?<!-- bench:headline:end -->", re.DOTALL
)
# This file: its pattern test holds examples of the phrasing the patterns exist to catch.
_SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth"
)
WORKLOG_PATTERNS: dict[str, re.Pattern[str]] = {
    "tracker reference": re.compile(r"\b(?:issue|defect|bug)s?\s*(?:#\s*)?\d+", re.IGNORECASE),
    "dated entry": re.compile(
        r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?:January|February|March|April|May|June|July|August|"
        r"September|October|November|December)\s+(?:[0-3]?\d,?\s+)?20\d\d\b"
    ),
    "machine clock": re.compile(r"\(machine clock\)", re.IGNORECASE),
    # "session" as a working day; nox sessions and pytest's scope="session" are not matched.
    "work-log day": re.compile(
        rf"\b(?:(?:{_ORDINALS}|this|that|same|earlier|previous|next|last|other|today's|"
        rf"yesterday's|morning's)\s+sessions?(?:'s)?\b(?!\s*(?:run|install|build|of nox)))",
        re.IGNORECASE,
    ),
    "day log": re.compile(r"\b(?:yesterday|this morning|earlier (?:today|the same day))\b", re.I),
}


def repository_files() -> list[Path]:
    """The repository's tracked files (``git ls-files``) in a checkout, else every file under
    the root outside virtualenvs, build output and caches."""
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached"],
        capture_output=True,
    )
    if proc.returncode == 0 and proc.stdout:
        rels = [r for r in proc.stdout.decode().split("\0") if r]
        return [ROOT / r for r in rels if (ROOT / r).is_file()]
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and not (_NOT_SOURCE & set(p.relative_to(ROOT).parts))
        and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    ]


def dated_by_design(rel: Path) -> bool:
    """Benchmark results and the page generated from them."""
    return rel.as_posix() in _GENERATED or bool(_RESULTS_DIRS & set(rel.parts[:-1]))


def worklog_findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) of every tracker reference or work-log phrase in a text."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for kind, pat in WORKLOG_PATTERNS.items():
            if pat.search(line):
                found.append((n, kind, line.strip()))
    return found


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (vocabulary GGUFs, images)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_worklog_patterns_catch_what_they_are_for() -> None:
    """Each pattern finds the phrasing it exists for, and leaves the legitimate uses of the same
    words alone (a nox session, pytest's session scope, the word "issue" without a number)."""
    n = 17
    sitting = "sess" + "ion"  # spelled apart: the fixtures must not themselves be work-log lines
    bad = [
        f"Fault injection across the packages (issue {n}): corrupted packs",
        f'"""Defect {n - 12}: int8 activations turned NaN into finite numbers."""',
        f"Defects {n - 16} and {n - 13}: a layer offset past experts.bin",
        f"see bug #{n}",
        f"## Measured on the same VM, fifth {sitting} (2026-12-0{n % 9}; one run)",
        f"2026-12-0{n % 9} (machine clock), load average 3.7",
        f"The same shapes, before this {sitting}'s kernel changes",
        f"load average 3.7–4.0 from other {sitting}s.",
        f"the seventh {sitting}'s code, alternating pairs",
        "Earlier the same day, yesterday's run was slower",
        "in all five sweeps of December 2026",
    ]
    good = [
        "Every `nox -s bench_*` session writes its result as a JSON file",
        '@pytest.fixture(scope="session")',
        "the console scripts the nox session installed",
        "Every session that runs a benchmark script (and the hexagon session's packets)",
        "def tests(session: nox.Session) -> None:",
        "| `nox -s tests` | all packages, each alone, then `integration/` |",
        "an issue with the manifest is reported by field",
        "DEFAULT_ACTIVATION_BYTES = 256 << 20",
    ]
    missed = [line for line in bad if not worklog_findings(line)]
    assert not missed, f"not caught: {missed}"
    flagged = [line for line in good if worklog_findings(line)]
    assert not flagged, f"wrongly caught: {flagged}"


def test_only_the_generated_headline_region_is_exempt() -> None:
    """The README's generated headline (between its markers) may carry its run's date; the same
    line outside the markers is still a finding, and line numbers after the region stay right."""
    dated = "`nox -s bench_engine` on a 2-vCPU VM, 20" + "26-12-03."
    inside = f"<!-- bench:headline:start -->\n{dated}\n<!-- bench:headline:end -->\n{dated}\n"
    blanked = _GENERATED_REGION.sub(lambda m: "\n" * m.group(0).count("\n"), inside)
    assert [n for n, _, _ in worklog_findings(blanked)] == [4]
    assert [n for n, _, _ in worklog_findings(inside)] == [2, 4]


def test_no_tracker_references_or_work_logs_in_the_repository() -> None:
    """No file of the repository (code, tests, docs, configuration) cites a tracker reference
    ("issue N", "defect N") or reads as a dated work log; generated benchmark results are
    exempt."""
    problems = []
    scanned = 0
    for path in repository_files():
        rel = path.relative_to(ROOT)
        if dated_by_design(rel) or rel.as_posix() == _SELF:
            continue
        text = _text(path)
        if text is None:
            continue
        scanned += 1
        # a generated region keeps its lines (blank), so line numbers stay right
        text = _GENERATED_REGION.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        problems += [f"{rel}:{n}: {kind}: {line[:120]}" for n, kind, line in worklog_findings(text)]
    assert scanned > 50, f"only {scanned} text files found under {ROOT}"
    assert not problems, "tracker references or work-log text:\n" + "\n".join(problems)


# -- Python blocks run as written ---------------------------------------------------------------
FENCE_OPEN = re.compile(r"^```(\S*)\s*$")
SETUP = re.compile(r"^<!--\s*setup:\s*(.+?)\s*-->\s*$")


def documents() -> list[Path]:
    readmes = [
        p
        for p in (ROOT / "packages").rglob("README.md")
        if not (_NOT_SOURCE & set(p.relative_to(ROOT).parts))
        and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    ]
    return [ROOT / "README.md", *sorted(readmes), *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[tuple[int, list[str], str]]:
    """(line of the opening fence, setup commands, code) of every ``python`` block of a
    Markdown file; setup commands are the ``<!-- setup: … -->`` lines right above the fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i].strip())
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{path}:{start + 1}: unclosed code fence"
        if lang == "python":
            setup = []
            k = start - 1
            while k >= 0 and SETUP.match(lines[k].strip()):
                setup.insert(0, SETUP.match(lines[k].strip()).group(1))
                k -= 1
            blocks.append((start + 1, setup, "\n".join(lines[start + 1 : j]) + "\n"))
        i = j + 1
    return blocks


def _cases() -> list:
    cases = []
    for doc in documents():
        for line, setup, code in python_blocks(doc):
            rel = doc.relative_to(ROOT).as_posix()
            cases.append(pytest.param(doc, line, setup, code, id=f"{rel}:{line}"))
    return cases


CASES = _cases()


def test_the_documents_have_python_examples() -> None:
    """The block finder sees the examples the READMEs hold (a broken finder would make the
    test below pass vacuously)."""
    docs_with_blocks = {case.values[0] for case in CASES}
    assert ROOT / "README.md" in docs_with_blocks
    assert len(docs_with_blocks) >= 5, sorted(str(d) for d in docs_with_blocks)


@pytest.mark.parametrize(("doc", "line", "setup", "code"), CASES)
def test_python_block_runs_as_written(
    doc: Path, line: int, setup: list[str], code: str, tmp_path: Path
) -> None:
    """The block, run as written after its declared setup, exits 0."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("ESTREAM_VOCAB_DIR", None)  # the package's own vocabulary files, as for a user
    where = f"{doc.relative_to(ROOT)}:{line}"
    for cmd in setup:
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", cmd],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, f"{where}: setup `{cmd}` failed:\n{proc.stderr[-3000:]}"
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"{where}: the Python block exited {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
