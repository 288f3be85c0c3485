"""A Ctrl-C (SIGINT) at any moment of `estream-pack` and `estream-synth`, the imports of numpy
and gguf included, ends with one ``<program>: error: interrupted…`` line and exit status 130
(or the command finishes): never an import traceback, never a half-written output."""

from __future__ import annotations

import os
import shutil
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
    """How long this machine takes, now, to do what a console script does before any of the
    package's code runs (start Python, import `re` and `sys`, find the package) plus import what
    a handler needs (`signal`, `threading`): the part of a program's life no handler of its own
    can cover. Twice the median of five (the program also runs its entry script and the
    package's first line; a loaded machine's slower start is not taken for the program's, and
    one slow start does not push every signal past the run), and never under 0.05 s."""
    code = "import re, sys, importlib.util, signal, threading\n"
    code += "importlib.util.find_spec('estream_layout')"
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return max(0.05, 2 * sorted(times)[2])


def _sigint_dfl() -> None:
    """In the child before it runs the program: SIGINT's default action, so that Python installs
    its handler (a test run started in the background inherits an ignored SIGINT, which a
    program rightly keeps ignoring)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _argv(program: str, gguf: Path, out: Path) -> list[str]:
    if program == "estream-pack":
        return [_program(program), str(gguf), "-o", f"{out}.estream", "--no-progress"]
    return [_program(program), "--arch", "olmoe", "--preset", "small", "-o", f"{out}.gguf"]


@pytest.mark.parametrize("program", ["estream-pack", "estream-synth"])
def test_sigint_at_any_moment_is_one_line(gguf: Path, tmp_path: Path, program: str) -> None:
    """SIGINT at eight moments spread from the end of the interpreter's own start to the end of
    an uninterrupted run timed just before (the imports of numpy and gguf, the option parser,
    the work, the exit): each run either finished (exit 0, or its result printed and the signal
    hit the interpreter's exit) or ended with exactly one ``<program>: error: interrupted``
    line and status 130 and left no output behind; at least one signal lands inside the run."""
    interrupted = 0
    start = _interpreter_start_s()
    t0 = time.perf_counter()
    whole = subprocess.run(_argv(program, gguf, tmp_path / "whole"), capture_output=True)
    run_s = time.perf_counter() - t0
    assert whole.returncode == 0, whole.stderr
    shutil.rmtree(tmp_path)  # the timed run's output: not one of the runs checked below
    tmp_path.mkdir()
    span = max(run_s - start, 0.05)
    offsets = [span * x for x in (0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)]
    for i, delay in enumerate(start + d for d in offsets):
        argv = _argv(program, gguf, tmp_path / f"out{i}")
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_dfl
        )
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
    assert interrupted >= 1, f"no signal landed in a run (start {start:.3f} s, run {run_s:.3f} s)"


@pytest.mark.parametrize("placed", [False, True])
def test_an_interrupt_after_the_pack_is_placed_reports_it_written(
    gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    placed: bool,
) -> None:
    """A Ctrl-C that lands after the finished pack was renamed into place (while its manifest is
    read back) is not reported as "nothing was written": the command prints the packed line and
    exits 0; one that lands before the pack is placed is the usual one-line error and 130."""
    from estream_layout import cli, pack

    out = tmp_path / "m.estream"
    real = pack.pack_model

    def interrupted(src, dst, **kw):  # type: ignore[no-untyped-def]
        if placed:
            real(src, dst, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "pack_model", interrupted)
    code = cli.pack_main([str(gguf), "-o", str(out), "--no-progress"])
    cap = capsys.readouterr()
    if placed:
        assert code == 0 and cap.out.startswith(f"packed {gguf} -> {out}"), cap
        assert "error" not in cap.err and (out / "manifest.json").is_file()
    else:
        assert code == 130 and not out.exists(), cap
        assert cap.err.strip() == "estream-pack: error: interrupted; nothing was written"


@pytest.mark.parametrize("placed", [False, True])
def test_an_interrupt_after_the_synthetic_file_is_placed_reports_it_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    placed: bool,
) -> None:
    """`estream-synth`: a Ctrl-C that lands after the finished file was renamed into place
    prints the written line and exits 0 (the file is there); one that lands before is the
    one-line error and 130 with nothing left. In-process, the caller's SIGINT handler is left
    as it was."""
    from estream_layout import cli, synth

    out = tmp_path / "m.gguf"
    real = synth.synth_model

    def interrupted(*a, **kw):  # type: ignore[no-untyped-def]
        if placed:
            real(*a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "synth_model", interrupted)
    # Python's own handler, as a caller's (a run started in the background inherits SIG_IGN)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.synth_main(
            ["--arch", "olmoe", "--preset", "tiny", "-o", str(out), "--no-progress"]
        )
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    cap = capsys.readouterr()
    if placed:
        assert code == 0 and cap.out.startswith(f"wrote {out} ("), cap
        assert "error" not in cap.err and out.is_file()
    else:
        assert code == 130 and not out.exists() and os.listdir(tmp_path) == [], cap
        assert cap.err.strip() == "estream-synth: error: interrupted"


def test_a_program_ignores_a_ctrl_c_once_its_output_is_in_place() -> None:
    """Run as a program (``argv[0]`` one of theirs), `_sigint.ignore` after `_sigint.restore`
    makes a later SIGINT do nothing (the command's last line is printed whole); run as a
    library, it leaves the SIGINT handler alone."""
    code = (
        "import os, signal, sys\n"
        "sys.argv[0] = 'estream-synth'\n"
        "from estream_layout import _sigint\n"
        "_sigint.restore()\n"
        "_sigint.ignore()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('finished')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=_sigint_dfl
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "finished\n", "")
    library = code.replace("sys.argv[0] = 'estream-synth'\n", "")
    cut = subprocess.run(
        [sys.executable, "-c", library], capture_output=True, text=True, preexec_fn=_sigint_dfl
    )
    assert cut.returncode != 0 and "KeyboardInterrupt" in cut.stderr
