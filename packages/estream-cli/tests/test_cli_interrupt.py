"""A Ctrl-C (SIGINT) at any moment of the `estream` program, the imports of numpy and the
engine included, ends with one line ``estream: error: interrupted`` and exit status 130:
never an import traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from estream_layout import synth_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("sigint") / "m.gguf"
    synth_model("olmoe", "tiny", path, seed=1)
    return path


def test_sigint_at_any_moment_is_one_line(gguf):
    """SIGINT after 0.05 .. 0.6 s (the imports take a few tenths of a second; before 0.05 s
    Python itself is still starting, which no program can change): each run either
    finished (exit 0) or ended with exactly the one interrupted line and status 130; at least
    one of the early signals lands inside the imports."""
    interrupted = 0
    for delay in (0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6):
        p = subprocess.Popen(
            [sys.executable, "-m", "estream_cli.main", "tokenize", str(gguf), "hello"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # SIGINT's default action in the child, so that Python installs its handler even
            # when this test run inherited an ignored SIGINT (a background job)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err)
        if p.returncode == 0:
            continue
        assert p.returncode == 130, (delay, p.returncode, err)
        assert err.splitlines() == ["estream: error: interrupted"], (delay, err)
        interrupted += 1
    assert interrupted >= 1
