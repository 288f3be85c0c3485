"""The ``hexagon`` backend's executor: the library compiled for Hexagon (v67 + HVX) with the
freestanding runtime of csrc/hexagon/, run as the "DSP" process under
``qemu-hexagon-static -cpu v67`` over the host-process protocol (socket + SCM_RIGHTS buffers,
shared-memory ring, eventfd doorbells).

Where the executor binary comes from, first match wins:

1. ``ESTREAM_HTP_HEXAGON_EXECUTOR`` — a path to a prebuilt executor;
2. the package tree (an in-tree or editable install: csrc/ and tools/ next to src/): built
   on first use into ``$XDG_CACHE_HOME/estream-htp/`` (default ``~/.cache``), one file per hash
   of its sources and flags, so an edit to the C sources is always picked up;
3. ``estream_htp/hexagon/htp_executor``, built when the package was installed (setup.py builds
   it when clang-19 and ld.lld-19 are present).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from estream_htp import _hexagon_build as build

__all__ = ["executor_command", "executor_path", "missing_tools"]

PKG_TREE = Path(__file__).resolve().parents[2]
PACKAGED = Path(__file__).resolve().parent / "hexagon" / "htp_executor"
QEMU_CPU = "v67"
_lock = threading.Lock()


class HexagonToolError(RuntimeError):
    """A tool the hexagon backend needs (qemu-hexagon-static, clang-19, ld.lld-19) is missing."""


def missing_tools() -> list[str]:
    """Tools missing to *run* the hexagon backend here: qemu always, the compiler and linker
    only when no prebuilt executor is available."""
    need: tuple[str, ...] = ("qemu",)
    if not os.environ.get("ESTREAM_HTP_HEXAGON_EXECUTOR") and (
        (PKG_TREE / "csrc" / "hexagon").is_dir() or not PACKAGED.exists()
    ):
        need = ("clang", "lld", "qemu")
    return build.missing_tools(need)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "estream-htp"


def executor_path() -> Path:
    """The Hexagon executor program (built on first use from the package tree)."""
    env = os.environ.get("ESTREAM_HTP_HEXAGON_EXECUTOR")
    if env:
        p = Path(env)
        if not p.is_file():
            raise HexagonToolError(f"ESTREAM_HTP_HEXAGON_EXECUTOR={env}: no such file")
        return p
    if (PKG_TREE / "csrc" / "hexagon").is_dir() and (PKG_TREE / build.MAIN).is_file():
        out = _cache_dir() / f"htp_executor-hexagon-{build.source_digest(PKG_TREE)}"
        with _lock:
            if not out.is_file():
                miss = build.missing_tools(("clang", "lld"))
                if miss:
                    raise HexagonToolError(
                        "the hexagon backend builds its executor with "
                        + " and ".join(miss)
                        + ", which are not installed (Debian: apt-get install clang-19 lld-19)"
                    )
                build.build_executor(PKG_TREE, out)
        return out
    if PACKAGED.is_file():
        return PACKAGED
    raise HexagonToolError(
        "no Hexagon executor: estream-htp was installed without one (clang-19 and ld.lld-19 "
        "were missing at build time) and its C sources are not here to build it; install them "
        "and reinstall, or set ESTREAM_HTP_HEXAGON_EXECUTOR"
    )


def executor_command() -> list[str]:
    """``qemu-hexagon-static -cpu v67 <executor>``: the Backend appends the socket's fd."""
    qemu = build.tool("qemu")
    if shutil.which(qemu) is None:
        raise HexagonToolError(
            f"the hexagon backend runs its executor under {qemu}, which is not installed "
            "(Debian: apt-get install qemu-user-static)"
        )
    return [qemu, "-cpu", QEMU_CPU, str(executor_path())]
