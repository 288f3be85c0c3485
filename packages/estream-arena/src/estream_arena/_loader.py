"""GroupLoader: Q reads in flight, each one vectored ``preadv`` of a group's extent straight into
a bank's slots of the three planes, published only when every byte arrived.

Threads, not io_uring: ``os.preadv`` releases the GIL for the whole syscall, so Q threads keep Q
requests in the device queue, which is all a sequential grouped read needs.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import mmap
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from ._arena import ALIGN, Arena
from ._errors import (
    ArenaError,
    ChecksumError,
    FileChangedError,
    LoaderClosedError,
    ProtocolError,
    ReadError,
    ShortReadError,
)
from ._residency import Bank, GroupState, Residency

__all__ = ["GroupLoader", "GroupRequest", "LoaderStats", "ReadEvent", "Reader"]

#: ``reader(fd, buffers, offset) -> bytes read``; ``os.preadv`` by default. Tests inject delays
#: and failures here.
Reader = Callable[[int, Sequence[Any], int], int]

_IOV_MAX = 1024  # Linux UIO_MAXIOV
_MAX_SYSCALL_BYTES = 0x7FFFF000  # Linux caps one read at this


def _checksums(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(c) & 0xFFFFFFFF for c in value)


@attrs.frozen
class GroupRequest:
    """Read ``n_records`` consecutive records starting at file ``offset`` as ``group``.

    ``checksums``: optional ``zlib.crc32`` of each whole record (checked when ``verify=True``).
    """

    group: int = attrs.field(converter=int)
    offset: int = attrs.field(converter=int)
    n_records: int = attrs.field(converter=int)
    checksums: tuple[int, ...] | None = attrs.field(default=None, converter=_checksums)


@attrs.frozen
class ReadEvent:
    """One group read, with ``time.perf_counter()`` stamps (submitted, started, finished)."""

    layer: int
    group: int
    bank: int
    t_submit: float
    t_start: float
    t_end: float
    nbytes: int
    outcome: str  # "published", "retired" (dropped while in flight) or "failed"


@attrs.define
class LoaderStats:
    bytes_read: int = 0
    n_reads: int = 0
    n_syscalls: int = 0
    n_failed: int = 0
    events: list[ReadEvent] = attrs.Factory(list)


def _advance(iovs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of a list of buffers (after a partial read)."""
    out: list[memoryview] = []
    for buf in iovs:
        if n >= len(buf):
            n -= len(buf)
            continue
        out.append(buf[n:] if n else buf)
        n = 0
    return out


def _detach(err: BaseException) -> None:
    """Drop the tracebacks of an error kept for a consumer: their frames hold views of the arena
    (which would keep it mapped after close); the message already names the failed extent."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


class GroupLoader:
    """Reads groups of records from ``path`` into the banks of ``arena``, ``queue_depth`` at a time.

    Per layer: :meth:`begin_layer`, :meth:`submit` groups in the order they should be read,
    :meth:`drop` groups found to have no routes, :meth:`acquire` / :meth:`release` each routed
    group, :meth:`end_layer`. Thread-safe: consumers may acquire/release from several threads.
    """

    def __init__(
        self,
        arena: Arena,
        path: str | os.PathLike[str],
        queue_depth: int,
        *,
        direct: bool | None = None,
        verify: bool = False,
        reader: Reader | None = None,
        merge_bytes: int = 0,
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if isinstance(merge_bytes, bool) or not isinstance(merge_bytes, int) or merge_bytes < 0:
            raise ValueError(f"merge_bytes must be an integer >= 0, got {merge_bytes!r}")
        #: Queued groups whose extents follow each other in the file are read by one preadv
        #: while it stays within this many bytes (0: one group per read).
        self.merge_bytes = merge_bytes
        self._max_records = max(arena.group_size, merge_bytes // arena.layout.record_bytes)
        self._arena = arena
        self._layout = arena.layout
        self._G = arena.group_size
        self._path = os.path.abspath(os.fspath(path))  # re-stat'ed after every read
        self.queue_depth = int(queue_depth)
        self.verify = bool(verify)
        self._reader: Reader = reader if reader is not None else os.preadv
        lock = threading.Lock()
        #: Consumers (acquire, end_layer) wait here: every read's completion wakes them.
        self._cond = threading.Condition(lock)
        #: Idle reader threads wait here, woken one per read made possible (a request queued,
        #: a bank freed) rather than all at once: a reader woken for nothing still takes a CPU
        #: from the compute threads for its context switch.
        self._work = threading.Condition(lock)
        self._res = Residency(arena.n_banks, arena.group_size)
        self._queue: deque[tuple[GroupRequest, float]] = deque()
        self._closed = False
        self._inflight = 0
        self._stats = LoaderStats()
        self._threads: list[threading.Thread] = []
        self._fd = -1
        self._segments = self._layout.segments()
        self._pad_per_record = self._layout.padding_bytes
        self._planes: list[memoryview] = []
        self._slot_bytes = arena.slot_bytes
        if arena.closed:
            raise LoaderClosedError("the arena is closed")
        self._fd, self.direct = self._open(direct)
        try:
            self._planes = [memoryview(arena.plane_view(j)) for j in range(3)]
            st = os.fstat(self._fd)
            self._ident = (st.st_dev, st.st_ino)
            self._size = st.st_size
            self._mtime = st.st_mtime_ns
            arena._register(self)
            for i in range(self.queue_depth):
                t = threading.Thread(
                    target=self._worker, name=f"estream-arena-loader-{i}", daemon=True
                )
                try:
                    t.start()
                except RuntimeError as e:  # "can't start new thread": say so, not a join error
                    raise ArenaError(
                        f"cannot start loader thread {i + 1} of {self.queue_depth} ({e}); "
                        "lower the queue depth or raise the process's thread limit"
                    ) from None
                self._threads.append(t)  # only started threads are joined by close()
        except BaseException:
            self.close()
            raise

    # -- file ----------------------------------------------------------------------------------
    def _open(self, direct: bool | None) -> tuple[int, bool]:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        o_direct = getattr(os, "O_DIRECT", 0)
        if direct is False or not o_direct:
            if direct:
                raise ArenaError("O_DIRECT is not available on this platform; pass direct=None")
            return os.open(self._path, flags), False
        try:
            fd = os.open(self._path, flags | o_direct)
        except OSError as e:
            if e.errno != _errno.EINVAL or direct:
                raise
            return os.open(self._path, flags), False
        if os.fstat(fd).st_size >= ALIGN:  # some filesystems accept the flag but refuse reads
            probe = mmap.mmap(-1, ALIGN)
            view = memoryview(probe)
            try:
                self._reader(fd, [view], 0)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    pass  # not a refusal of O_DIRECT; real reads will report it per group
                else:
                    os.close(fd)
                    if direct:
                        raise ArenaError(
                            f"{self._path}: the filesystem refuses O_DIRECT reads; "
                            "pass direct=None (auto) or direct=False"
                        ) from e
                    return os.open(self._path, flags), False
            finally:
                view.release()
                probe.close()
        return fd, True

    def _check_file(self, ctx: dict[str, Any]) -> None:
        """Raise FileChangedError if the file was truncated, rewritten or replaced since open."""
        st = os.fstat(self._fd)
        why = ""
        if st.st_size != self._size:
            why = f"its size changed from {self._size} to {st.st_size} bytes (truncated?)"
        elif st.st_mtime_ns != self._mtime:
            why = "it was modified in place since the loader opened it"
        else:
            try:
                cur = os.stat(self._path)
            except FileNotFoundError:
                why = "it was deleted or renamed"
            else:
                if (cur.st_dev, cur.st_ino) != self._ident:
                    why = "it was replaced by another file (inode changed)"
        if why:
            raise FileChangedError(f"the file changed under the loader: {why}", **ctx)

    # -- worker --------------------------------------------------------------------------------
    def _next_job(self) -> tuple[list[tuple[GroupRequest, int, float]], int] | None:
        """The next read: the first queued group in a free bank, plus (``merge_bytes``) the
        groups queued right after it whose extents continue it in the file, each in a free bank,
        while the read stays within ``merge_bytes``."""
        while True:
            if self._closed:
                return None
            q = self._queue
            while q and self._res.group_state(q[0][0].group) is not GroupState.PENDING:
                q.popleft()  # dropped before it was read
            if q and self._res.n_available:
                layer = self._res.layer
                assert layer is not None
                req, t_submit = q.popleft()
                jobs = [(req, self._res.reserve(req.group), t_submit)]
                rb = self._layout.record_bytes
                nbytes = req.n_records * rb
                while q and self._res.n_available:
                    nxt, t_next = q[0]
                    if self._res.group_state(nxt.group) is not GroupState.PENDING:
                        q.popleft()
                        continue
                    nb = nxt.n_records * rb
                    if nxt.offset != req.offset + nbytes or nbytes + nb > self.merge_bytes:
                        break
                    q.popleft()
                    jobs.append((nxt, self._res.reserve(nxt.group), t_next))
                    nbytes += nb
                return jobs, layer
            self._work.wait()

    def _worker(self) -> None:
        scratch = None
        if self._pad_per_record:
            scratch = mmap.mmap(-1, self._pad_per_record * self._max_records)
        rb = self._layout.record_bytes
        try:
            while True:
                with self._cond:
                    job = self._next_job()
                    if job is None:
                        return
                    self._inflight += 1
                jobs, layer = job
                t_start = time.perf_counter()
                errs, n_sys = self._read_jobs(jobs, layer, scratch)
                t_end = time.perf_counter()
                with self._cond:
                    self._inflight -= 1
                    st = self._stats
                    st.n_syscalls += n_sys
                    freed = 0
                    for (req, bank, t_submit), err in zip(jobs, errs, strict=True):
                        nbytes = req.n_records * rb
                        if err is None:
                            self._res.complete(bank)
                            if self._res.group_state(req.group) is GroupState.DROPPED:
                                self._res.retire(bank)
                                outcome = "retired"
                                freed += 1
                            else:
                                self._res.publish(bank)
                                outcome = "published"
                            st.bytes_read += nbytes
                            st.n_reads += 1
                        else:
                            self._res.fail(bank, err)
                            st.n_failed += 1
                            outcome = "failed"
                        st.events.append(
                            ReadEvent(
                                layer, req.group, bank, t_submit, t_start, t_end, nbytes, outcome
                            )
                        )
                    self._cond.notify_all()
                    if freed and self._queue:
                        self._work.notify(freed)
        finally:
            if scratch is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view: GC frees it
                    scratch.close()

    def _read_jobs(
        self, jobs: list[tuple[GroupRequest, int, float]], layer: int, scratch: mmap.mmap | None
    ) -> tuple[list[BaseException | None], int]:
        """Read the (file-adjacent) groups of one job; each group's error or None, and the
        number of preadv calls. A merged read that fails is read again group by group, so
        that a fault ends only the group it concerns and names that group's extent."""
        rb = self._layout.record_bytes
        ctxs = [
            dict(
                layer=layer,
                group=req.group,
                offset=req.offset,
                nbytes=req.n_records * rb,
                path=self._path,
            )
            for req, _, _ in jobs
        ]
        n_sys = [0]
        if len(jobs) > 1:
            try:
                return self._read_extent(jobs, ctxs, scratch, n_sys), n_sys[0]
            except BaseException:  # read again group by group below, each keeping its error
                pass
        errs: list[BaseException | None] = []
        for job, ctx in zip(jobs, ctxs, strict=True):
            try:
                errs += self._read_extent([job], [ctx], scratch, n_sys)
            except ReadError as e:
                errs.append(e)
            except BaseException as e:  # a bug, an odd reader, an interrupt: end the group
                err = ReadError(f"unexpected failure: {e!r}", **ctx)
                err.__cause__ = e
                errs.append(err)
        for e in errs:
            if e is not None:
                _detach(e)
        return errs, n_sys[0]

    def _read_extent(
        self,
        jobs: list[tuple[GroupRequest, int, float]],
        ctxs: list[dict[str, Any]],
        scratch: mmap.mmap | None,
        n_sys: list[int],
    ) -> list[BaseException | None]:
        """One vectored read of the consecutive extents of ``jobs`` (split only at IOV_MAX
        iovecs or 2 GiB, or on a partial read) straight into their banks; raises ReadError if
        the read fails; returns each group's checksum error or None."""
        rb = self._layout.record_bytes
        G = self._G
        smv = memoryview(scratch) if scratch is not None else None
        records: list[list[memoryview]] = []
        spos = 0
        for req, bank, _ in jobs:
            for i in range(req.n_records):
                slot = bank * G + i
                parts: list[memoryview] = []
                for _, size, j in self._segments:
                    if j < 0:
                        assert smv is not None
                        parts.append(smv[spos : spos + size])
                        spos += size
                    else:
                        sb = self._slot_bytes[j]
                        parts.append(self._planes[j][slot * sb : slot * sb + sb])
                records.append(parts)
        ctx = ctxs[0]
        if len(jobs) > 1:
            ctx = dict(ctx, nbytes=len(records) * rb)
        try:
            per_chunk = max(1, min(_IOV_MAX // len(self._segments), _MAX_SYSCALL_BYTES // rb))
            off0 = jobs[0][0].offset
            for first in range(0, len(records), per_chunk):
                last = min(len(records), first + per_chunk)
                iovs = [buf for rec in records[first:last] for buf in rec]
                off = off0 + first * rb
                n_sys[0] += self._read_fully(iovs, off, (last - first) * rb, ctx)
                if not self.direct:
                    os.posix_fadvise(self._fd, off, (last - first) * rb, os.POSIX_FADV_DONTNEED)
            self._check_file(ctx)
            errs: list[BaseException | None] = []
            k = 0
            for (req, _, _), c in zip(jobs, ctxs, strict=True):
                errs.append(self._verify(req, records[k : k + req.n_records], c))
                k += req.n_records
            return errs
        finally:
            for parts in records:
                for buf in parts:
                    buf.release()
            if smv is not None:
                smv.release()

    def _verify(
        self, req: GroupRequest, records: list[list[memoryview]], ctx: dict[str, Any]
    ) -> ChecksumError | None:
        if not self.verify or req.checksums is None:
            return None
        rb = self._layout.record_bytes
        for i, parts in enumerate(records):
            crc = 0
            for buf in parts:
                crc = zlib.crc32(buf, crc)
            if crc != req.checksums[i]:
                return ChecksumError(
                    f"record {i} (file offset {req.offset + i * rb}) has crc32 {crc:#010x}, "
                    f"expected {req.checksums[i]:#010x}: the file is corrupt or not the one "
                    "the manifest describes",
                    record=i,
                    expected=req.checksums[i],
                    actual=crc,
                    **ctx,
                )
        return None

    def _read_fully(
        self, iovs: list[memoryview], offset: int, want: int, ctx: dict[str, Any]
    ) -> int:
        done = 0
        n_sys = 0
        while done < want:
            try:
                n = self._reader(self._fd, iovs, offset + done)
            except OSError as e:
                self._check_file(ctx)  # a truncated/replaced file explains errors best
                raise ReadError(
                    f"read failed at file offset {offset + done}: "
                    f"[errno {e.errno}] {e.strerror or e}",
                    errno=e.errno,
                    **ctx,
                ) from e
            n_sys += 1
            if n <= 0:
                self._check_file(ctx)
                raise ShortReadError(
                    f"short read: the file ended at offset {offset + done} "
                    f"({done} of {want} bytes read, file size {os.fstat(self._fd).st_size})",
                    **ctx,
                )
            if n > want - done:
                raise ReadError(f"reader returned {n} bytes, only {want - done} asked", **ctx)
            done += n
            if done < want:
                iovs = _advance(iovs, n)
        return n_sys

    # -- protocol ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError("the loader is closed")

    def begin_layer(self, layer: int) -> None:
        """Start layer ``layer`` with an empty residency table Φ_layer."""
        with self._cond:
            self._check_open()
            self._res.begin_layer(layer)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue group reads, read in this order, each into the next Available bank."""
        requests = list(requests)
        now = time.perf_counter()
        self._check_requests(requests)
        with self._cond:
            self._check_open()
            if self._res.layer is None:
                raise ProtocolError("no layer is open: call begin_layer first")
            for r in requests:
                if self._res.has_group(r.group):
                    raise ProtocolError(
                        f"group {r.group} already submitted in layer {self._res.layer}"
                    )
            for r in requests:
                self._res.submit(r.group, r.n_records)
                self._queue.append((r, now))
            self._work.notify(len(requests))

    def read_into(
        self, requests: Sequence[GroupRequest], banks: Sequence[int], *, layer: int = -1
    ) -> None:
        """Read group ``requests[i]`` into bank ``banks[i]`` now, on the calling thread, outside
        the layer protocol: for banks a caller keeps for its whole run (experts pinned in
        memory). Only on a loader with no layer open and nothing queued; a layer opened later
        may take these banks for its reads, so give such a loader an arena of its own. Checks
        the checksums under ``verify``; raises the first failed group's `ReadError` or
        `ChecksumError` (groups before it are in their banks, the rest are not read). The
        reads count in :attr:`stats` like a layer's; ``layer`` names the groups' layer in
        errors and events (-1: none)."""
        requests, banks = list(requests), [int(b) for b in banks]
        if len(requests) != len(banks):
            raise ValueError(f"{len(requests)} requests for {len(banks)} banks")
        self._check_requests(requests)
        for b in banks:
            if not 0 <= b < self._arena.n_banks:
                raise IndexError(f"bank {b} out of range 0..{self._arena.n_banks - 1}")
        if len(set(banks)) != len(banks):
            raise ProtocolError("a bank appears twice in one read_into")
        with self._cond:
            self._check_open()
            if self._res.layer is not None or self._queue or self._inflight:
                raise ProtocolError(
                    "read_into needs a loader with no layer open and no read queued"
                )
        scratch = None
        if self._pad_per_record:
            scratch = mmap.mmap(-1, self._pad_per_record * self._max_records)
        rb = self._layout.record_bytes
        try:
            for req, bank in zip(requests, banks, strict=True):
                t0 = time.perf_counter()
                errs, n_sys = self._read_jobs([(req, bank, t0)], layer, scratch)
                t1 = time.perf_counter()
                with self._cond:
                    st = self._stats
                    st.n_syscalls += n_sys
                    ok = errs[0] is None
                    st.bytes_read += req.n_records * rb if ok else 0
                    st.n_reads += ok
                    st.n_failed += not ok
                    st.events.append(
                        ReadEvent(
                            layer,
                            req.group,
                            bank,
                            t0,
                            t0,
                            t1,
                            req.n_records * rb,
                            "published" if ok else "failed",
                        )
                    )
                if errs[0] is not None:
                    raise errs[0]
        finally:
            if scratch is not None:
                with contextlib.suppress(BufferError):
                    scratch.close()

    def _check_requests(self, requests: list[GroupRequest]) -> None:
        seen: set[int] = set()
        for r in requests:
            if r.offset < 0 or r.offset % ALIGN:
                raise ArenaError(
                    f"group {r.group}: file offset {r.offset} is not a multiple of {ALIGN} "
                    "(records must start on page boundaries for O_DIRECT)"
                )
            if not 1 <= r.n_records <= self._G:
                raise ProtocolError(
                    f"group {r.group} has {r.n_records} records; must be 1..G={self._G}"
                )
            if r.checksums is not None and len(r.checksums) != r.n_records:
                raise ArenaError(
                    f"group {r.group}: {len(r.checksums)} checksums for {r.n_records} records"
                )
            if r.group in seen:
                raise ProtocolError(f"group {r.group} appears twice in one submit")
            seen.add(r.group)

    def drop(self, groups: Iterable[int]) -> None:
        """Groups with no routes: never read if queued; Ready banks freed at once; banks being
        filled freed when their read completes."""
        groups = list(groups)
        with self._cond:
            self._check_open()
            for g in groups:
                if not self._res.has_group(g):
                    raise ProtocolError(f"cannot drop group {g}: never submitted in this layer")
                st = self._res.group_state(g)
                if st in (GroupState.IN_USE, GroupState.RELEASED):
                    raise ProtocolError(f"cannot drop group {g}: it is {st.value}")
            for g in groups:
                self._res.drop(g)
            self._cond.notify_all()
            self._work.notify_all()  # Ready banks freed, queued reads gone

    def acquire(self, group: int, timeout: float | None = None) -> Bank:
        """Block until ``group`` is Ready, mark it InUse and return its bank.

        Raises the group's :class:`ReadError` if its read failed, :class:`TimeoutError` after
        ``timeout`` seconds, :class:`ProtocolError` if it was never submitted or was dropped.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if self._res.layer is None:
                    raise ProtocolError("no layer is open: call begin_layer first")
                if not self._res.has_group(group):
                    raise ProtocolError(
                        f"group {group} was never submitted in layer {self._res.layer}"
                    )
                st = self._res.group_state(group)
                if st in (GroupState.READY, GroupState.FAILED):
                    return self._res.acquire(group)
                if st not in (GroupState.PENDING, GroupState.FILLING, GroupState.FILLED):
                    raise ProtocolError(
                        f"cannot acquire group {group} of layer {self._res.layer}: it is {st.value}"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._stall_message(group, st, timeout))
                self._cond.wait(remaining)

    def acquire_any(self, groups: Iterable[int], timeout: float | None = None) -> Bank:
        """Acquire whichever of ``groups`` becomes Ready first (lowest index among those Ready
        at once), for executors that run groups in completion order. Errors as :meth:`acquire`;
        a failed group among them raises its read error."""
        wanted = list(dict.fromkeys(groups))
        if not wanted:
            raise ProtocolError("acquire_any needs at least one group")
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = (GroupState.PENDING, GroupState.FILLING, GroupState.FILLED)
        with self._cond:
            while True:
                self._check_open()
                if self._res.layer is None:
                    raise ProtocolError("no layer is open: call begin_layer first")
                states = {}
                for g in wanted:
                    if not self._res.has_group(g):
                        raise ProtocolError(
                            f"group {g} was never submitted in layer {self._res.layer}"
                        )
                    states[g] = self._res.group_state(g)
                for g in wanted:
                    if states[g] in (GroupState.READY, GroupState.FAILED):
                        return self._res.acquire(g)
                for g in wanted:
                    if states[g] not in waiting:
                        raise ProtocolError(
                            f"cannot acquire group {g} of layer {self._res.layer}: "
                            f"it is {states[g].value}"
                        )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._stall_message(wanted[0], states[wanted[0]], timeout))
                self._cond.wait(remaining)

    def _stall_message(self, group: int, st: GroupState, timeout: float | None) -> str:
        res = self._res
        msg = (
            f"group {group} of layer {res.layer} not Ready after {timeout} s: it is {st.value}, "
            f"{self._inflight} reads in flight, {res.n_available} of {res.n_banks} banks Available"
        )
        if st is GroupState.PENDING and not res.n_available:
            held = {res.bank_owner(b): res.bank_state(b).value for b in range(res.n_banks)}
            msg += (
                f"; every bank is held by groups {held}: acquire+release or drop those first "
                "(or give the arena more banks)"
            )
        return msg

    def release(self, bank: Bank) -> None:
        """The consumer is done with ``bank``: InUse → Available, refilled at once."""
        with self._cond:
            if self._closed:
                return  # everything is torn down; releasing on the way out is harmless
            if bank.layer != self._res.layer or self._res.bank_owner(bank.index) != bank.group:
                raise ProtocolError(
                    f"bank {bank.index} (group {bank.group}, layer {bank.layer}) is not held "
                    f"in the current layer {self._res.layer}"
                )
            self._res.release(bank.index)
            self._cond.notify_all()
            if self._queue:  # one bank freed: one queued read made possible
                self._work.notify()

    def end_layer(self) -> None:
        """Close the layer; every submitted group must be released or dropped.

        Waits for reads of dropped groups still in flight.
        """
        with self._cond:
            self._check_open()
            if self._res.layer is None:
                raise ProtocolError("no layer is open")
            busy = self._res.unsettled()
            if busy:
                raise ProtocolError(
                    f"cannot end layer {self._res.layer}: groups neither released nor dropped: "
                    f"{busy}"
                )
            while not self._res.settled():
                self._check_open()
                self._cond.wait()
            self._res.end_layer()
            self._queue.clear()

    def residency(self) -> dict[int, int]:
        """Visible bindings of the current layer: record position (group·G + i) → slot."""
        with self._cond:
            return self._res.bindings()

    def check_valid(self) -> None:
        """Run the residency table's self check under the loader's lock (tests)."""
        with self._cond:
            self._res.check_valid()
            assert 0 <= self._inflight <= self.queue_depth

    @property
    def stats(self) -> LoaderStats:
        """A snapshot of the counters and read events so far."""
        with self._cond:
            s = self._stats
            return LoaderStats(s.bytes_read, s.n_reads, s.n_syscalls, s.n_failed, list(s.events))

    def reset_stats(self) -> None:
        with self._cond:
            self._stats = LoaderStats()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def layer(self) -> int | None:
        return self._res.layer

    def close(self) -> None:
        """Cancel queued reads, wake every waiter (LoaderClosedError), join every thread.

        Idempotent; reads already in the kernel finish first (a ``preadv`` cannot be recalled).
        """
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            self._work.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
        with self._cond:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            for mv in self._planes:
                mv.release()
            self._planes = []

    def __enter__(self) -> GroupLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GroupLoader({self._path!r}, Q={self.queue_depth}, direct={self.direct}, "
            f"layer={self._res.layer}, closed={self._closed})"
        )
