"""The arena: three planes of fixed-address slots, allocated once; shareable (memfd) or private
(anonymous, on transparent huge pages)."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ._errors import ArenaError

__all__ = ["ALIGN", "PLANES", "Arena", "RecordLayout"]

#: Every offset, size and address the loader hands to ``O_DIRECT`` is a multiple of this.
ALIGN = 4096
#: Plane names, in plane index order.
PLANES = ("gate", "up", "down")


def _check_planes(
    instance: RecordLayout, attribute: attrs.Attribute[Any], planes: tuple[tuple[int, int], ...]
) -> None:
    if len(planes) != 3:
        raise ValueError(f"RecordLayout needs 3 planes (gate, up, down), got {len(planes)}")
    rb = instance.record_bytes
    spans = []
    for name, (off, size) in zip(PLANES, planes):
        if off < 0 or size <= 0:
            raise ValueError(f"{name} plane: offset {off} must be >= 0 and size {size} > 0")
        if off % ALIGN or size % ALIGN:
            raise ValueError(
                f"{name} plane: offset {off} and padded size {size} must be multiples of "
                f"{ALIGN} (projections are padded to {ALIGN} bytes for O_DIRECT)"
            )
        if off + size > rb:
            raise ValueError(f"{name} plane [{off}, {off + size}) does not fit in record {rb} B")
        spans.append((off, off + size, name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{a} and {b} planes overlap in the record")


def _check_record_bytes(instance: RecordLayout, attribute: attrs.Attribute[Any], rb: int) -> None:
    if rb <= 0 or rb % ALIGN:
        raise ValueError(f"record_bytes {rb} must be a positive multiple of {ALIGN}")


def _to_planes(value: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(o), int(s)) for o, s in value)


@attrs.frozen
class RecordLayout:
    """Where the three projections sit inside one expert record of ``record_bytes`` bytes.

    ``planes[j] = (offset_in_record, padded_bytes)`` for j = gate, up, down. Bytes of the record
    outside the three planes (padding) are read but not kept.
    """

    record_bytes: int = attrs.field(converter=int, validator=_check_record_bytes)
    planes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] = attrs.field(
        converter=_to_planes, validator=_check_planes
    )

    @classmethod
    def contiguous(cls, gate: int, up: int, down: int) -> RecordLayout:
        """``[gate | up | down]`` back to back, each size already padded (docs/contracts.md §2)."""
        return cls(gate + up + down, ((0, gate), (gate, up), (gate + up, down)))

    @property
    def plane_bytes(self) -> tuple[int, int, int]:
        """Padded size of each projection = slot stride of each plane."""
        return tuple(s for _, s in self.planes)  # type: ignore[return-value]

    def segments(self) -> list[tuple[int, int, int]]:
        """The record cut in order into ``(offset, nbytes, plane)``; plane -1 is padding."""
        out: list[tuple[int, int, int]] = []
        pos = 0
        for off, size, j in sorted((o, s, j) for j, (o, s) in enumerate(self.planes)):
            if off > pos:
                out.append((pos, off - pos, -1))
            out.append((off, size, j))
            pos = off + size
        if pos < self.record_bytes:
            out.append((pos, self.record_bytes - pos, -1))
        return out

    @property
    def padding_bytes(self) -> int:
        """Bytes per record outside the three planes."""
        return self.record_bytes - sum(self.plane_bytes)


class Arena:
    """``B`` banks × ``G`` slots in each of three planes; the only memory experts ever occupy.

    Plane ``j`` is one mapping of ``n_slots * padded_bytes_j`` bytes; slot ``s`` is at
    ``plane_address(j) + s * padded_bytes_j`` and never moves until :meth:`close`.

    ``shared=True`` (default): each plane is a ``MAP_SHARED`` mapping of a memfd, so another
    process (an executor, a DSP driver) can map the same pages (:meth:`fd`). ``shared=False``:
    a private anonymous mapping, for consumers in this process only. Either way the planes are
    advised onto transparent huge pages (``MADV_HUGEPAGE``): private memory gets them wherever
    THP is ``always`` or ``madvise``; shared memory only where the kernel's ``shmem_enabled``
    allows. Huge pages matter here: a group's ``O_DIRECT`` read lands in a few 2 MiB pages
    instead of thousands of 4 KiB ones, and the kernels stream the weights without a TLB miss
    (and a hardware-prefetch stop) every 4 KiB. :attr:`huge_page_bytes` says what was granted.
    """

    def __init__(
        self, layout: RecordLayout, n_banks: int, group_size: int, *, shared: bool = True
    ) -> None:
        if n_banks < 1 or group_size < 1:
            raise ValueError(f"need n_banks >= 1 and group_size >= 1, got {n_banks}, {group_size}")
        self.layout = layout
        self.n_banks = int(n_banks)
        self.group_size = int(group_size)
        self.n_slots = self.n_banks * self.group_size
        self.slot_bytes: tuple[int, int, int] = layout.plane_bytes
        self.shared = bool(shared)
        self._lock = threading.Lock()
        self._closed = False
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []
        self._on_close: weakref.WeakSet[Any] = weakref.WeakSet()
        try:
            for name, stride in zip(PLANES, self.slot_bytes):
                size = self.n_slots * stride
                if self.shared:
                    fd = _memfd(f"estream-arena-{name}")
                    self._fds.append(fd)
                    os.ftruncate(fd, size)
                    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                    self._maps.append(mm)
                    _advise_huge(mm)
                else:
                    mm = private_mapping(size)
                    self._maps.append(mm)
                view = np.frombuffer(mm, dtype=np.uint8)
                if view.ctypes.data % ALIGN:
                    raise ArenaError(f"{name} plane mapping is not {ALIGN}-aligned")
                self._views.append(view)
        except BaseException:
            self.close()
            raise

    @property
    def total_bytes(self) -> int:
        """Exact bytes mapped by the three planes: the number a memory budget must cover."""
        return sum(self.n_slots * s for s in self.slot_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    def _plane(self, j: int) -> np.ndarray:
        if self._closed:
            raise ArenaError("the arena is closed")
        if not 0 <= j < 3:
            raise IndexError(f"plane {j} out of range 0..2")
        return self._views[j]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.n_slots - 1}")

    def plane_address(self, j: int) -> int:
        """Base address of plane ``j`` (0 gate, 1 up, 2 down) as an integer."""
        return int(self._plane(j).ctypes.data)

    def slot_address(self, j: int, slot: int) -> int:
        """Address of ``slot`` in plane ``j``: ``plane_address(j) + slot * slot_bytes[j]``."""
        self._check_slot(slot)
        return self.plane_address(j) + slot * self.slot_bytes[j]

    def plane_view(self, j: int) -> np.ndarray:
        """The whole plane as a writable uint8 array (no copy)."""
        return self._plane(j)[:]

    def slot_view(self, j: int, slot: int) -> np.ndarray:
        """One slot of plane ``j`` as a writable uint8 array (no copy)."""
        self._check_slot(slot)
        stride = self.slot_bytes[j]
        return self._plane(j)[slot * stride : (slot + 1) * stride]

    def bank_slots(self, bank: int) -> range:
        """Slots of bank ``bank``: ``bank*G .. bank*G+G-1``."""
        if not 0 <= bank < self.n_banks:
            raise IndexError(f"bank {bank} out of range 0..{self.n_banks - 1}")
        return range(bank * self.group_size, (bank + 1) * self.group_size)

    def fd(self, j: int) -> int:
        """The memfd of plane ``j``, for sharing the plane with another process."""
        self._plane(j)
        if not self.shared:
            raise ArenaError(
                "this arena's planes are private to the process (shared=False): no memfd to "
                "share; create it with shared=True for another process to map"
            )
        return self._fds[j]

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the planes the kernel currently backs with huge pages (from
        ``/proc/self/smaps``; pages are granted as they are first written). 0 where the kernel
        grants none, or does not say."""
        if self._closed:
            return 0
        spans = [(v.ctypes.data, v.ctypes.data + v.nbytes) for v in self._views if v.nbytes]
        return huge_page_bytes_in(spans)

    def _register(self, closer: Any) -> None:
        """Objects (loaders) that write into the arena; closed before the planes are unmapped."""
        with self._lock:
            if self._closed:
                raise ArenaError("the arena is closed")
            self._on_close.add(closer)

    def close(self) -> None:
        """Stop every loader writing into the arena, then unmap and close the planes.

        Idempotent. If a caller still holds a numpy view of a plane, that mapping stays alive
        until the view is dropped (Python refuses to unmap exported memory), never dangling.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            users = list(self._on_close)
        for user in users:
            user.close()
        self._views.clear()
        for mm in self._maps:
            with contextlib.suppress(BufferError):
                mm.close()  # fails only while a view is held outside; the mapping dies with it
        self._maps.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mib = self.total_bytes / 2**20
        return f"Arena(B={self.n_banks}, G={self.group_size}, {mib:.1f} MiB, closed={self._closed})"


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting: ``'always'``, ``'madvise'``, ``'never'``, or
    ``''`` where it cannot be read (not Linux, no THP). Private memory the arena advises gets
    2 MiB pages under ``'always'`` and ``'madvise'``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def private_mapping(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous read-write memory (at least one page), page-aligned and
    advised onto transparent huge pages: what a private arena plane is, and what a runtime can
    read whole weight files into. Raises OSError when the kernel refuses the mapping."""
    mm = mmap.mmap(-1, max(int(nbytes), 1), mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    _advise_huge(mm)
    return mm


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages; a kernel without them (or a refusal) is not an error."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mm.madvise(advice)


_HUGE_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")


def huge_page_bytes_in(spans: list[tuple[int, int]]) -> int:
    """Bytes backed by huge pages (the huge-page fields of ``/proc/self/smaps``) in the mappings
    that overlap any ``(start, end)`` address span; 0 where the kernel does not say."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0
    total = 0
    inside = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo_s, _, hi_s = head.partition("-")
            try:
                lo, hi = int(lo_s, 16), int(hi_s, 16)
            except ValueError:
                continue
            inside = any(lo < b and a < hi for a, b in spans)
        elif inside and head in _HUGE_FIELDS:
            total += int(line.split()[1]) * 1024
    return total


def _memfd(name: str) -> int:
    create: Callable[..., int] | None = getattr(os, "memfd_create", None)
    if create is None:  # pragma: no cover - non-Linux
        import tempfile

        fd, path = tempfile.mkstemp(prefix=name)
        os.unlink(path)
        return fd
    return create(name, os.MFD_CLOEXEC)
