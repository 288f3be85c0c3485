"""Every command line of every README runs, as a reader would type it.

The usage blocks are the fenced ``sh`` blocks of ``README.md`` and ``packages/*/README.md``.
Each command line (``\\``-continuations joined) runs through ``bash`` in a scratch directory, one
directory per README and in the README's order, so the files one line writes are there for the
next, with this environment's ``bin/`` first on ``PATH`` (the ``estream``, ``estream-synth`` and
``estream-pack`` console scripts the nox session installed). Only three things change, each so the
suite stays short and self-contained:

* the large synthetic presets (``olmoe-1b-7b``, ``small``, and ``estream demo``'s default) become
  ``tiny``;
* ``pip install`` lines run from the repository root with ``--dry-run`` added: they resolve and
  build the metadata of exactly the packages and extras they name, but do not reinstall the
  environment under test (the nox sessions install those same paths, ``nox -s build`` the wheels);
* the quick-start lines that run nox sessions are not run here (``nox -s tests`` would run this
  test again): they must be, verbatim, the lines ``.ci/run`` executes on a fresh copy of the
  repository.

Untagged blocks that spell out a command's options (``estream prefill m.estream [--top-k N]``)
are synopses, not command lines: every option they name must exist in that command's ``--help``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\s*$")
BIN = Path(sys.executable).parent
TIMEOUT_S = 900


def fenced_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced block of a Markdown file."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line.strip())
        if m and lang is None:
            lang, lines = m.group(1), []
        elif line.strip() == "```" and lang is not None:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"{path}: unclosed code fence"
    return blocks


def command_lines(path: Path) -> list[str]:
    """The command lines of a README's shell blocks, continuations joined, comments kept (bash
    drops them)."""
    out: list[str] = []
    for lang, lines in fenced_blocks(path):
        if lang not in SHELL_LANGS:
            continue
        pending = ""
        for line in lines:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            full = (pending + line).strip()
            pending = ""
            if full and not full.startswith("#"):
                out.append(full)
        assert not pending, f"{path}: a shell block ends with a continuation"
    return out


def ci_lines() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]


def runs_nox(line: str) -> bool:
    return re.search(r"\bnox\s+-s\b", line) is not None


TINY = [
    (re.compile(r"--preset\s+(olmoe-1b-7b|small|demo)\b"), "--preset tiny"),
    (re.compile(r"^(estream demo)(?!.*--preset)"), r"\1 --preset tiny"),
]


def adapt(line: str) -> tuple[str, Path | None]:
    """The line as this test runs it, and the directory it must run in (None: the scratch
    directory)."""
    for pat, repl in TINY:
        line = pat.sub(repl, line)
    if re.match(r"^pip\s+install\b", line):
        return re.sub(r"^pip\s+install\b", "pip install --dry-run", line), ROOT
    return line, None


def _case_id(path: Path) -> str:
    return str(path.relative_to(ROOT).parent) if path != ROOT / "README.md" else "top"


@pytest.mark.parametrize("readme", READMES, ids=_case_id)
def test_readme_command_lines_run(readme: Path, tmp_path: Path) -> None:
    lines = command_lines(readme)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("ESTREAM_VOCAB_DIR", None)  # the package's own vocabulary files, as for a user
    ran = 0
    for line in lines:
        if runs_nox(line):
            assert line in ci_lines(), (
                f"{readme.name}: {line!r} runs nox sessions; .ci/run must run it verbatim"
            )
            continue
        cmd, cwd = adapt(line)
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", cmd],
            cwd=cwd or tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, (
            f"{readme.relative_to(ROOT)}: `{line}` (run as `{cmd}`) exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
        ran += 1
    if readme == ROOT / "README.md":
        assert ran >= 5, "the top-level README lost its usage lines"


def test_readme_lists_and_ci_runs_both_quick_start_commands() -> None:
    nox_lines = [ln for ln in command_lines(ROOT / "README.md") if runs_nox(ln)]
    want = {
        f"python3 -m venv .venv && .venv/bin/pip install -q nox && .venv/bin/nox -s {s}"
        for s in ("demo", "tests")
    }
    assert want <= set(nox_lines), nox_lines
    assert want <= set(ci_lines())


# -- synopses ---------------------------------------------------------------------------------
def synopsis_options(path: Path) -> list[tuple[tuple[str, ...], str]]:
    """(command, option) for every ``--option`` named on a synopsis line of an untagged block.

    A synopsis line starts with ``estream``/``estream-*``; indented lines continue the previous
    one; text after `` #`` is a comment. ``common options:`` lines apply to every command of
    their block."""
    found: list[tuple[tuple[str, ...], str]] = []
    for lang, lines in fenced_blocks(path):
        if lang not in ("", "text"):
            continue
        cmd: tuple[str, ...] | None = None
        block_cmds: list[tuple[str, ...]] = []
        for line in lines:
            text = line.split(" #", 1)[0]
            words = text.split()
            if not words:
                continue
            if words[0] == "estream" and len(words) > 1:
                cmd = ("estream", words[1])
                block_cmds.append(cmd)
            elif words[0].startswith("estream-"):
                cmd = (words[0],)
                block_cmds.append(cmd)
            elif words[0] == "common" and block_cmds:
                for c in block_cmds:
                    found += [(c, o) for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)]
                continue
            elif not line.startswith(" ") or cmd is None:
                cmd = None
                continue
            # every option on "estream tokenize m "text" ...; estream detokenize ..." lines
            for part in re.split(r";\s*(?=estream)", text):
                pw = part.split()
                c = cmd
                if len(pw) > 1 and pw[0] == "estream":
                    c = ("estream", pw[1])
                found += [(c, o) for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", part)]
    return found


@pytest.mark.parametrize("readme", READMES, ids=_case_id)
def test_readme_synopses_name_only_real_options(readme: Path) -> None:
    helps: dict[tuple[str, ...], str] = {}
    missing = []
    for cmd, opt in synopsis_options(readme):
        if cmd not in helps:
            exe = str(BIN / cmd[0])
            proc = subprocess.run([exe, *cmd[1:], "--help"], capture_output=True, text=True)
            assert proc.returncode == 0, f"{' '.join(cmd)} --help failed: {proc.stderr}"
            helps[cmd] = proc.stdout
        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", helps[cmd]):
            missing.append(f"{' '.join(cmd)} {opt}")
    assert not missing, f"{readme.relative_to(ROOT)} names options that do not exist: {missing}"
