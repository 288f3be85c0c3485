"""The `estream` command: argument parsing, printing and output files over the `estream` library.

`estream_cli` imports `estream`, never the reverse; embedding the engine (`import estream`) loads
none of these modules.
"""

from __future__ import annotations

import os
import signal
import sys

__version__ = "0.1.0"


def interrupted_while_starting(signum: int, frame: object) -> None:
    """SIGINT handler while the program imports its modules: one line, exit status 130."""
    os.write(2, b"estream: error: interrupted\n")
    os._exit(130)


# As a program (`estream`, `python -m estream_cli.main`), a Ctrl-C while numpy and the engine
# load (most of a second) ends like one during a command, not with an import traceback; the
# command's `main` puts Python's KeyboardInterrupt back before it does any work.
_SCRIPT = os.path.basename(sys.argv[0]) if sys.argv else ""
if _SCRIPT == "estream" or getattr(sys, "orig_argv", [])[1:3] == ["-m", "estream_cli.main"]:
    signal.signal(signal.SIGINT, interrupted_while_starting)
