"""The allocator setting the engine applies once per process."""

from __future__ import annotations

import platform

from estream import memory


def test_keep_freed_heap_on_glibc() -> None:
    on_glibc = platform.libc_ver()[0] == "glibc"
    assert memory.keep_freed_heap() is on_glibc
    assert memory.keep_freed_heap() is on_glibc  # once per process, same answer
