"""A Ctrl-C (SIGINT) at any moment of `estream-pack` and `estream-synth`, the imports of numpy
and gguf included, ends with one ``<program>: error: interrupted…`` line and exit status 130
(or the command finishes): never an import traceback, never a half-written output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from estream_layout import synth_model

BIN = Path(sys.executable).parent
DONE = {"estream-pack": "packed ", "estream-synth": "wrote "}  # stdout of a finished run


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("sigint") / "m.gguf"
    synth_model("olmoe", "small", path, seed=1)  # packing it outlasts the last signal
    return path


def _program(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed next to {sys.executable}")
    return str(path)


def _interpreter_start_s() -> float:
    """How long this machine takes, now, to start Python, find the package and import what a
    handler needs (`signal`), before any of the package's code runs: the part of a program's
    life no handler of its own can cover (the longest of three, so that a loaded machine's
    slower start is not taken for the program's)."""
    code = "import importlib.util, signal, threading; importlib.util.find_spec('estream_layout')"
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return max(times)


@pytest.mark.parametrize("program", ["estream-pack", "estream-synth"])
def test_sigint_at_any_moment_is_one_line(gguf: Path, tmp_path: Path, program: str) -> None:
    """SIGINT from the end of the interpreter's own start to 0.55 s after it (the imports take a
    few tenths of a second): each run either finished (exit 0, or its result printed and the
    signal hit the interpreter's exit) or ended with exactly one ``<program>: error:
    interrupted`` line and status 130 and left no output behind; at least one signal lands
    inside the run."""
    interrupted = 0
    start = _interpreter_start_s()
    offsets = (0.0, 0.03, 0.05, 0.1, 0.15, 0.25, 0.35, 0.55)
    for i, delay in enumerate(start + d for d in offsets):
        out = tmp_path / f"out{i}"
        if program == "estream-pack":
            argv = [_program(program), str(gguf), "-o", f"{out}.estream", "--no-progress"]
        else:
            argv = [_program(program), "--arch", "olmoe", "--preset", "small", "-o", f"{out}.gguf"]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err)
        if p.returncode == 0 or (p.returncode == -signal.SIGINT and out.startswith(DONE[program])):
            continue  # finished; a signal during the interpreter's exit after the work is done
        assert p.returncode == 130, (delay, p.returncode, err)
        lines = [x for x in err.splitlines() if ": error: " in x]  # progress lines aside
        assert len(lines) == 1 and lines[0].startswith(f"{program}: error: interrupted"), err
        assert err.splitlines()[-1] == lines[0], err
        left = [f for f in os.listdir(tmp_path) if f"out{i}" in f]  # temporaries included
        assert left == [], left
        interrupted += 1
    assert interrupted >= 1
