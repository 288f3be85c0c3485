"""Helpers for tests of code that embeds the arena: synthetic record files and fault-injecting
readers. Public so that other packages' tests (and integration/) can reuse them; needs only numpy.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._arena import RecordLayout
from ._loader import GroupRequest, Reader

__all__ = [
    "DelayedReader",
    "FailingReader",
    "RecordFile",
    "ShortReader",
    "write_record_file",
]


class RecordFile:
    """A file of ``n_records`` random records of ``layout`` (``zlib.crc32`` per record)."""

    def __init__(self, path: str, layout: RecordLayout, n_records: int, checksums: list[int]):
        self.path = path
        self.layout = layout
        self.n_records = n_records
        self.checksums = checksums

    def record(self, i: int) -> bytes:
        rb = self.layout.record_bytes
        with open(self.path, "rb") as f:
            f.seek(i * rb)
            return f.read(rb)

    def projection(self, i: int, j: int) -> bytes:
        off, size = self.layout.planes[j]
        return self.record(i)[off : off + size]

    def request(self, group: int, first: int, n: int, *, base: int = 0) -> GroupRequest:
        """Group ``group`` = records ``first .. first+n-1`` (file offset ``base + first*rb``)."""
        rb = self.layout.record_bytes
        return GroupRequest(group, base + first * rb, n, tuple(self.checksums[first : first + n]))


def write_record_file(
    path: str | os.PathLike[str], layout: RecordLayout, n_records: int, seed: int = 0
) -> RecordFile:
    """Write ``n_records`` records of random bytes; every record differs from every other."""
    rng = np.random.default_rng(seed)
    rb = layout.record_bytes
    sums = []
    with open(path, "wb") as f:
        for i in range(n_records):
            rec = rng.integers(0, 256, rb, dtype=np.uint8)
            rec[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
            f.write(rec.tobytes())
            sums.append(zlib.crc32(rec))
        f.flush()
        os.fsync(f.fileno())
    return RecordFile(os.fspath(path), layout, n_records, sums)


class DelayedReader:
    """``os.preadv`` after a random sleep of up to ``max_delay`` seconds (seeded)."""

    def __init__(self, max_delay: float, seed: int = 0, inner: Reader = os.preadv) -> None:
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._inner = inner
        self.calls = 0

    def __call__(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        with self._lock:
            delay = self._rng.uniform(0, self.max_delay)
            self.calls += 1
        time.sleep(delay)
        return self._inner(fd, buffers, offset)


class FailingReader:
    """Raises ``OSError(err)`` for reads whose extent starts in ``[lo, hi)`` of the file;
    everything else goes to ``os.preadv``."""

    def __init__(
        self,
        lo: int,
        hi: int,
        err: int = errno.EIO,
        inner: Reader = os.preadv,
        when: Callable[[], bool] = lambda: True,
    ) -> None:
        self.lo, self.hi, self.err, self._inner, self._when = lo, hi, err, inner, when

    def __call__(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self.lo <= offset < self.hi and self._when():
            raise OSError(self.err, os.strerror(self.err))
        return self._inner(fd, buffers, offset)


class ShortReader:
    """Pretends the file ends at byte ``end``: reads stop there (returns 0 at/after ``end``)."""

    def __init__(self, end: int, inner: Reader = os.preadv) -> None:
        self.end, self._inner = end, inner

    def __call__(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if offset >= self.end:
            return 0
        keep: list[Any] = []
        room = self.end - offset
        for b in buffers:
            if room <= 0:
                break
            mv = memoryview(b)
            keep.append(mv[:room] if len(mv) > room else mv)
            room -= len(mv)
        return self._inner(fd, keep, offset)
