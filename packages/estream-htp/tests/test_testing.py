"""`estream_htp.testing`'s deadline for tests of executors that may hang."""

from __future__ import annotations

import subprocess
import sys
import time

_PROG = """
import subprocess, sys, time
from estream_htp import testing as T
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
cancel = T.end_run_after({seconds}, "the hung op")
if {cancel}:
    cancel()
time.sleep(3)
print("finished", flush=True)
"""


def _run(seconds: float, cancel: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", _PROG.format(seconds=seconds, cancel=cancel)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return p, time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_end_run_after_ends_the_process_with_tracebacks_and_kills_its_children() -> None:
    p, took = _run(0.5, cancel=False)
    assert p.returncode == 1 and took < 3 and "finished" not in p.stdout
    assert "the hung op: still running after 0.5 s; ending the run" in p.stderr
    assert "most recent call first" in p.stderr  # the threads' tracebacks
    time.sleep(0.2)
    assert not _alive(int(p.stdout.split()[0]))  # the child was killed, not left sleeping


def test_end_run_after_cancelled_lets_the_process_finish() -> None:
    p, _ = _run(0.5, cancel=True)
    assert p.returncode == 0 and "finished" in p.stdout and p.stderr == ""
    child = int(p.stdout.split()[0])
    assert _alive(child)  # left alone (it ends by itself)
    subprocess.run(["kill", str(child)], check=False)
