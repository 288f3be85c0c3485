"""The allocator setting the engine applies once per process."""

from __future__ import annotations

import platform

import numpy as np

from estream import memory


def test_keep_freed_heap_on_glibc() -> None:
    on_glibc = platform.libc_ver()[0] == "glibc"
    assert memory.keep_freed_heap() is on_glibc
    assert memory.keep_freed_heap() is on_glibc  # once per process, same answer


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def test_trim_heap_returns_what_the_kept_heap_holds() -> None:
    """With the heap kept (`keep_freed_heap`), a freed 256 MiB array stays resident; `trim_heap`
    gives it back to the system (glibc; what an engine's close does)."""
    on_glibc = platform.libc_ver()[0] == "glibc"
    assert memory.keep_freed_heap() is on_glibc
    if not on_glibc:
        assert memory.trim_heap() is False
        return
    a = np.ones(256 << 18, dtype=np.float32)  # 256 MiB, every page touched
    held = _rss()
    del a
    kept = _rss()
    assert kept > held - (64 << 20)  # freed, but still in the process
    memory.trim_heap()
    assert _rss() < kept - (192 << 20)
