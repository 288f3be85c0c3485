"""Refuse early when a filesystem cannot hold what is about to be written.

Synthesizing or packing a Mixtral-8x7B-sized model writes ~26 GB; running out of space at 90%
wastes many minutes and leaves the user to find out why. Both writers know their output size
before writing a byte, so they check it against `shutil.disk_usage` first.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import InsufficientDiskSpaceError

__all__ = ["check_disk_space", "format_size"]


def format_size(n: float) -> str:
    """Bytes in binary units, as a user reads them (``26.3 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_disk_space(
    target: str | os.PathLike[str], needed: int, what: str, *, reclaimed: int = 0
) -> None:
    """Raise `InsufficientDiskSpaceError` unless the filesystem holding `target` (a file or
    directory to be created; its nearest existing ancestor is asked) has `needed` bytes free.

    `reclaimed`: bytes the write frees as it goes (e.g. a file it truncates and replaces).
    """
    where = Path(target).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = int(shutil.disk_usage(where).free)
    if free + int(reclaimed) < int(needed):
        raise InsufficientDiskSpaceError(
            f"{what} needs {format_size(needed)} on the filesystem of {where}, which has only "
            f"{format_size(free + reclaimed)} free; free {format_size(needed - free - reclaimed)} "
            "or choose another output directory",
            needed=int(needed),
            free=free,
            path=str(where),
        )
