"""Memory accounting: sizes with units, process high-water mark, system available memory.

Peak memory of a run = max(process high-water mark, drop of the system's MemAvailable since the
engine started loading). The second term catches memory a process causes but does not own.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re

from .errors import BadRequestError

__all__ = [
    "drop_file_cache",
    "format_bytes",
    "keep_freed_heap",
    "mem_available",
    "parse_bytes",
    "peak_rss",
    "reset_peak",
    "trim_heap",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_bytes(value: int | float | str) -> int:
    """`1.5GiB`, `800MB`, `300 MiB`, `1073741824` → bytes."""
    if isinstance(value, int | float):
        if value <= 0:
            raise BadRequestError(f"memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise BadRequestError(
            f"cannot read memory size {value!r}: use e.g. 1.5GiB, 800MiB, 2GB or a byte count"
        )
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise BadRequestError(f"memory size must be positive, got {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """Process high-water mark (VmHWM) in bytes; ru_maxrss where /proc is missing."""
    kib = _status_kib("VmHWM")
    if kib:
        return kib * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc ``malloc_trim(0)``): what
    `keep_freed_heap` keeps for reuse stays resident otherwise, after the arrays that used it
    are gone (a closed engine's weights and activations). False where that is not glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """Evict a file's cached pages (posix_fadvise DONTNEED); best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@functools.cache
def keep_freed_heap() -> bool:
    """Make glibc keep freed large blocks in the heap (mmap and trim thresholds at 1 GiB), once
    per process; False where that is not glibc.

    A prefill allocates and frees many `[T, d]` float32 arrays per layer (32 MiB each at 4K
    tokens). Above glibc's mmap threshold every one is a fresh mapping whose pages fault in on
    first touch; kept in the heap they are reused. Measured on a 4K-token OLMoE-shaped resident
    prefill: ~14 % less CPU time (page faults), peak RSS +0.5 %."""
    try:  # the process's own symbols: libc is loaded (no library search, no subprocess)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 30))
