"""As a program (`estream-pack`, `estream-synth`), a Ctrl-C while numpy and gguf load ends like
one during the command, not with an import traceback: the package imports this module first,
and `pack_main` / `synth_main` put Python's KeyboardInterrupt back before they do any work.
Once their output is in place they ignore Ctrl-C (`ignore`): a late one would only turn the
finished command's last line into a traceback."""

from __future__ import annotations

import os
import signal
import sys
import threading

PROGRAMS = ("estream-pack", "estream-synth")


def interrupted_while_starting(signum: int, frame: object) -> None:
    """SIGINT handler while the program imports its modules: one line, exit status 130."""
    name = os.path.basename(sys.argv[0]) if sys.argv else "estream-layout"
    os.write(2, f"{name}: error: interrupted\n".encode())
    os._exit(130)


_restored = False  # restore() put KeyboardInterrupt back: this process runs as the program


def ignore() -> None:
    """Ctrl-C is ignored from now on, if `restore` was the one to put KeyboardInterrupt back
    (the process runs as the program; a caller's own handler is left as it is)."""
    if _restored and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def restore() -> None:
    """Ctrl-C raises KeyboardInterrupt again, if the handler above is the one installed (any
    other handler, or an ignored SIGINT, is left as it is)."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting and (
        threading.current_thread() is threading.main_thread()
    ):
        global _restored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _restored = True


if (
    sys.argv
    and os.path.basename(sys.argv[0]) in PROGRAMS
    and threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
):
    signal.signal(signal.SIGINT, interrupted_while_starting)
