"""estream-arena: a bounded expert arena, its residency protocol, and a disk-saturating loader.

The arena knows slots, banks, groups, byte extents and readiness — nothing about models or
kernels — so any runtime can embed it (see the README).
"""

from __future__ import annotations

from ._arena import (
    ALIGN,
    PLANES,
    Arena,
    RecordLayout,
    huge_page_bytes_in,
    private_mapping,
    thp_mode,
)
from ._errors import (
    ArenaError,
    ChecksumError,
    FileChangedError,
    LoaderClosedError,
    ProtocolError,
    ReadError,
    ShortReadError,
)
from ._loader import GroupLoader, GroupRequest, LoaderStats, Reader, ReadEvent
from ._residency import Bank, BankState, GroupState, Residency

__version__ = "0.1.0"

__all__ = [
    "ALIGN",
    "PLANES",
    "Arena",
    "ArenaError",
    "Bank",
    "BankState",
    "ChecksumError",
    "FileChangedError",
    "GroupLoader",
    "GroupRequest",
    "GroupState",
    "LoaderClosedError",
    "LoaderStats",
    "ProtocolError",
    "ReadError",
    "ReadEvent",
    "Reader",
    "RecordLayout",
    "Residency",
    "ShortReadError",
    "__version__",
    "huge_page_bytes_in",
    "private_mapping",
    "thp_mode",
]
