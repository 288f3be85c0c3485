from __future__ import annotations

import errno
import fcntl
import os
import threading
import time

import pytest

from estream_arena import (
    ALIGN,
    Arena,
    ArenaError,
    ChecksumError,
    GroupLoader,
    GroupRequest,
    LoaderClosedError,
    ProtocolError,
    RecordLayout,
)
from estream_arena.testing import RecordFile, write_record_file

# Planes out of record order, with padding before, between and after them.
PADDED = RecordLayout(9 * ALIGN, ((4 * ALIGN, 2 * ALIGN), (ALIGN, ALIGN), (6 * ALIGN, 2 * ALIGN)))
DENSE = RecordLayout.contiguous(ALIGN, 2 * ALIGN, ALIGN)


@pytest.fixture(params=[PADDED, DENSE], ids=["padded", "dense"])
def rfile(request, workdir) -> RecordFile:
    return write_record_file(workdir / "experts.bin", request.param, 23, seed=7)


def groups_of(rf: RecordFile, G: int) -> list[GroupRequest]:
    return [
        rf.request(k, k * G, min(G, rf.n_records - k * G)) for k in range(-(-rf.n_records // G))
    ]


def check_bank(arena: Arena, rf: RecordFile, bank, G: int) -> None:
    for i, slot in enumerate(bank.slots):
        for j in range(3):
            got = bytes(arena.slot_view(j, slot))
            assert got == rf.projection(bank.group * G + i, j), (bank, i, j)


class Recorder:
    """os.preadv that logs (offset, n_buffers, sizes) and the peak number of concurrent calls."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.delay = delay
        self.gate = gate

    def __call__(self, fd, buffers, offset):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            time.sleep(self.delay)
            n = os.preadv(fd, buffers, offset)
            with self.lock:
                self.calls.append((offset, len(buffers), sum(len(memoryview(b)) for b in buffers)))
            return n
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("direct", [None, True, False])
@pytest.mark.parametrize(("B", "G", "Q"), [(1, 1, 1), (3, 4, 2), (4, 3, 4), (2, 5, 1)])
def test_every_group_lands_in_its_bank(rfile, B, G, Q, direct, shared) -> None:
    with (
        Arena(rfile.layout, B, G, shared=shared) as arena,
        GroupLoader(arena, rfile.path, Q, direct=direct, verify=True) as ld,
    ):
        assert ld.direct is (direct is not False)  # ext4/tmp accept O_DIRECT
        for layer in range(2):
            ld.begin_layer(layer)
            reqs = groups_of(rfile, G)
            ld.submit(reqs)
            for r in reqs:
                bank = ld.acquire(r.group, timeout=10)
                assert bank.layer == layer and bank.group == r.group
                assert bank.n_records == r.n_records
                assert bank.slots == range(bank.index * G, bank.index * G + r.n_records)
                vis = ld.residency()
                for i, slot in enumerate(bank.slots):
                    assert vis[r.group * G + i] == slot
                check_bank(arena, rfile, bank, G)
                ld.release(bank)
                ld.check_valid()
            ld.end_layer()
        st = ld.stats
        assert st.n_reads == 2 * len(reqs)
        assert st.bytes_read == 2 * rfile.n_records * rfile.layout.record_bytes
        assert len(st.events) == st.n_reads
        for ev in st.events:
            assert ev.t_submit <= ev.t_start <= ev.t_end and ev.outcome == "published"


def test_one_vectored_syscall_per_group(rfile) -> None:
    G = 4
    rec = Recorder()
    with Arena(rfile.layout, 2, G) as arena, GroupLoader(arena, rfile.path, 2, reader=rec) as ld:
        ld.begin_layer(0)
        reqs = groups_of(rfile, G)
        ld.submit(reqs)
        for r in reqs:
            ld.release(ld.acquire(r.group, timeout=10))
        ld.end_layer()
        assert ld.stats.n_syscalls == len(reqs)
    n_segments = len(rfile.layout.segments())
    by_offset = {
        off: (nbuf, nbytes) for off, nbuf, nbytes in rec.calls if off != 0 or nbytes != ALIGN
    }
    for r in reqs:
        assert by_offset[r.offset] == (
            n_segments * r.n_records,
            r.n_records * rfile.layout.record_bytes,
        )


@pytest.mark.parametrize("verify", [False, True])
def test_adjacent_groups_are_merged_into_one_read(rfile, verify) -> None:
    """merge_bytes: groups queued one after another whose extents follow each other in the file
    are read by one preadv (within merge_bytes, each into its own free bank), and every group
    is still published on its own with its own bytes."""
    G, B = 2, 6
    rb = rfile.layout.record_bytes
    rec = Recorder()
    with (
        Arena(rfile.layout, B, G) as arena,
        GroupLoader(arena, rfile.path, 1, reader=rec, verify=verify, merge_bytes=3 * G * rb) as ld,
    ):
        rec.calls.clear()  # the O_DIRECT probe
        for layer in range(2):
            ld.begin_layer(layer)
            reqs = groups_of(rfile, G)  # 12 groups, the last one of 1 record
            ld.submit(reqs)
            for r in reqs:
                bank = ld.acquire(r.group, timeout=10)
                check_bank(arena, rfile, bank, G)
                ld.release(bank)
                ld.check_valid()
            ld.end_layer()
        st = ld.stats
    assert st.n_reads == 2 * len(reqs) and len(st.events) == st.n_reads
    assert st.bytes_read == 2 * rfile.n_records * rb
    sizes = [nbytes for _, _, nbytes in rec.calls]
    assert st.n_syscalls == len(rec.calls) < st.n_reads
    assert max(sizes) == 3 * G * rb  # three groups in one call, never more
    assert sum(sizes) == st.bytes_read
    n_seg = len(rfile.layout.segments())
    assert all(nbuf == n_seg * nbytes // rb for _, nbuf, nbytes in rec.calls)
    offsets = sorted(off for off, _, _ in rec.calls)
    assert offsets[0] == 0 and offsets[1] == 0  # the file read twice, calls back to back
    for ev in st.events:
        assert (
            ev.outcome == "published" and ev.nbytes == min(G, rfile.n_records - ev.group * G) * rb
        )


def test_only_adjacent_queued_groups_are_merged(rfile) -> None:
    rb = rfile.layout.record_bytes
    rec = Recorder()
    gate = threading.Event()
    with (
        Arena(rfile.layout, 8, 1) as arena,
        GroupLoader(arena, rfile.path, 1, reader=rec, merge_bytes=100 * rb) as ld,
    ):
        rec.calls.clear()
        rec.gate = gate  # hold the first read until everything is queued
        ld.begin_layer(0)
        order = [0, 5, 1, 2, 3, 9, 10]
        ld.submit([rfile.request(g, g, 1) for g in order])
        gate.set()
        for g in order:
            ld.release(ld.acquire(g, timeout=10))
        ld.end_layer()
    calls = [(off // rb, nbytes // rb) for off, _, nbytes in rec.calls]
    # 5 does not follow 0 in the file, 1-2-3 follow each other, 9 does not follow 3, 10 does 9
    assert calls == [(0, 1), (5, 1), (1, 3), (9, 2)]


def test_a_fault_in_a_merged_read_ends_only_its_group(rfile) -> None:
    """A merged read that fails is read again group by group: only the group whose extent is
    bad fails, with that group's layer, group and offset; its neighbours arrive intact."""
    from estream_arena import ReadError

    G = 1
    rb = rfile.layout.record_bytes
    bad = 4  # the group whose own read fails; merged reads that start before it fail too
    inner = Recorder()

    def reader(fd, buffers, offset):
        nbytes = sum(len(memoryview(b)) for b in buffers)
        if offset <= bad * rb < offset + nbytes and nbytes > ALIGN:
            raise OSError(errno.EIO, "Input/output error")
        return inner(fd, buffers, offset)

    with (
        Arena(rfile.layout, 8, G) as arena,
        GroupLoader(arena, rfile.path, 2, reader=reader, merge_bytes=4 * rb) as ld,
    ):
        ld.begin_layer(0)
        reqs = groups_of(rfile, G)
        ld.submit(reqs)
        for r in reqs:
            if r.group == bad:
                with pytest.raises(ReadError, match=f"layer 0, group {bad}, file offset") as ei:
                    ld.acquire(r.group, timeout=10)
                assert ei.value.errno == errno.EIO and ei.value.offset == bad * rb
                assert ei.value.nbytes == rb
                continue
            bank = ld.acquire(r.group, timeout=10)
            check_bank(arena, rfile, bank, G)
            ld.release(bank)
        ld.end_layer()
        st = ld.stats
    assert st.n_failed == 1 and st.n_reads == len(reqs) - 1
    assert [e.group for e in st.events if e.outcome == "failed"] == [bad]


def test_merge_bytes_is_checked(rfile) -> None:
    with Arena(rfile.layout, 2, 1) as arena:
        for bad in (-1, 1.5, True, "8"):
            with pytest.raises(ValueError, match="merge_bytes"):
                GroupLoader(arena, rfile.path, 1, merge_bytes=bad)


def test_huge_group_is_split_at_iov_max(workdir) -> None:
    lay = RecordLayout.contiguous(ALIGN, ALIGN, ALIGN)
    rf = write_record_file(workdir / "big.bin", lay, 700)
    with Arena(lay, 1, 700) as arena, GroupLoader(arena, rf.path, 1, verify=True) as ld:
        ld.begin_layer(0)
        ld.submit([rf.request(0, 0, 700)])
        bank = ld.acquire(0, timeout=20)
        check_bank(arena, rf, bank, 700)
        ld.release(bank)
        ld.end_layer()
        assert ld.stats.n_syscalls == 3  # 1024 // 3 = 341 records per preadv


@pytest.mark.parametrize("Q", [1, 2, 3])
def test_at_most_q_reads_in_flight(rfile, Q) -> None:
    rec = Recorder(delay=0.01)
    G = 1
    with Arena(rfile.layout, 6, G) as arena, GroupLoader(arena, rfile.path, Q, reader=rec) as ld:
        rec.peak = 0
        ld.begin_layer(0)
        reqs = groups_of(rfile, G)
        ld.submit(reqs)
        for r in reqs:
            ld.release(ld.acquire(r.group, timeout=10))
        ld.end_layer()
    assert rec.peak == Q


def test_reads_follow_submit_order(rfile) -> None:
    rec = Recorder()
    with Arena(rfile.layout, 1, 1) as arena, GroupLoader(arena, rfile.path, 1, reader=rec) as ld:
        rec.calls.clear()
        ld.begin_layer(0)
        order = [5, 1, 9, 0, 3]
        ld.submit([rfile.request(g, g, 1) for g in order])
        for g in order:
            ld.release(ld.acquire(g, timeout=10))
        ld.end_layer()
    assert [off // rfile.layout.record_bytes for off, _, _ in rec.calls] == order


def test_drop_queued_ready_and_filling(rfile) -> None:
    gate = threading.Event()
    rec = Recorder(gate=gate)
    gate.set()
    rb = rfile.layout.record_bytes
    with Arena(rfile.layout, 2, 1) as arena, GroupLoader(arena, rfile.path, 1, reader=rec) as ld:
        rec.calls.clear()
        ld.begin_layer(0)
        ld.submit([rfile.request(g, g, 1) for g in range(2)])
        b0 = ld.acquire(0, timeout=10)
        deadline = time.monotonic() + 10
        while 1 not in {p // 1 for p in ld.residency()} and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ld.residency() == {0: b0.slots[0], 1: 1 - b0.index}  # 1 is Ready, not InUse
        ld.drop([1])  # Ready → Available at once
        assert ld.residency() == {0: b0.slots[0]}
        gate.clear()  # the next read blocks inside the reader: Filling
        ld.submit([rfile.request(g, g, 1) for g in (2, 3, 4)])
        while not rec.active and time.monotonic() < deadline:
            time.sleep(0.001)
        ld.drop([2, 4])  # 2 is Filling (in the reader), 4 is queued
        with pytest.raises(ProtocolError, match="Dropped"):
            ld.acquire(2)
        gate.set()
        b3 = ld.acquire(3, timeout=10)
        check_bank(arena, rfile, b3, 1)
        ld.release(b3)
        ld.release(b0)
        ld.end_layer()
        offsets = [off for off, _, _ in rec.calls]
        assert 4 * rb not in offsets, "a dropped queued group was read"
        assert 2 * rb in offsets
        outcomes = {ev.group: ev.outcome for ev in ld.stats.events}
        assert outcomes[2] == "retired" and outcomes[3] == "published"


def test_protocol_misuse_raises(rfile) -> None:
    with Arena(rfile.layout, 1, 2) as arena, GroupLoader(arena, rfile.path, 1) as ld:
        with pytest.raises(ProtocolError, match="begin_layer"):
            ld.submit([rfile.request(0, 0, 2)])
        ld.begin_layer(0)
        with pytest.raises(ProtocolError, match="still open"):
            ld.begin_layer(1)
        with pytest.raises(ProtocolError, match="never submitted"):
            ld.acquire(0, timeout=1)
        ld.submit([rfile.request(0, 0, 2), rfile.request(1, 2, 2)])
        with pytest.raises(ProtocolError, match="already submitted"):
            ld.submit([rfile.request(0, 0, 2)])
        with pytest.raises(ProtocolError, match="twice"):
            ld.submit([rfile.request(5, 0, 1), rfile.request(5, 0, 1)])
        with pytest.raises(ProtocolError, match="records"):
            ld.submit([rfile.request(6, 0, 3)])
        with pytest.raises(ArenaError, match="multiple of 4096"):
            ld.submit([GroupRequest(7, 100, 1)])
        with pytest.raises(ProtocolError, match="neither released nor dropped"):
            ld.end_layer()
        bank = ld.acquire(0, timeout=10)
        with pytest.raises(ProtocolError, match="InUse"):
            ld.drop([0])
        with pytest.raises(ProtocolError, match="InUse"):
            ld.acquire(0)
        # Only one bank, held: group 1 cannot become Ready.
        with pytest.raises(TimeoutError, match="group 1 of layer 0"):
            ld.acquire(1, timeout=0.1)
        ld.release(bank)
        with pytest.raises(ProtocolError, match="not held"):
            ld.release(bank)
        ld.drop([1])
        ld.end_layer()
        with pytest.raises(ProtocolError, match="no layer"):
            ld.end_layer()


def test_close_wakes_waiters_and_is_idempotent(rfile) -> None:
    gate = threading.Event()
    with Arena(rfile.layout, 1, 1) as arena:
        ld = GroupLoader(arena, rfile.path, 1, direct=False, reader=Recorder(gate=gate))
        ld.begin_layer(0)
        ld.submit([rfile.request(0, 0, 1)])
        got: list[BaseException] = []

        def consumer() -> None:
            try:
                ld.acquire(0)
            except BaseException as e:
                got.append(e)

        t = threading.Thread(target=consumer)
        t.start()
        time.sleep(0.05)
        closer = threading.Thread(target=ld.close)
        closer.start()
        time.sleep(0.05)
        gate.set()  # let the in-flight read finish so that close can join its thread
        closer.join(10)
        t.join(10)
        assert not t.is_alive() and not closer.is_alive()
        assert len(got) == 1 and isinstance(got[0], LoaderClosedError)
        ld.close()
        with pytest.raises(LoaderClosedError):
            ld.begin_layer(1)


def test_closing_the_arena_closes_its_loaders(rfile) -> None:
    arena = Arena(rfile.layout, 2, 2)
    ld = GroupLoader(arena, rfile.path, 2)
    ld.begin_layer(0)
    ld.submit(groups_of(rfile, 2))
    arena.close()
    assert ld.closed
    with pytest.raises(LoaderClosedError):
        ld.acquire(0)


def _refuse_direct(fd, buffers, offset):
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        raise OSError(errno.EINVAL, "Invalid argument")
    return os.preadv(fd, buffers, offset)


def test_falls_back_to_buffered_when_o_direct_is_refused(rfile) -> None:
    with Arena(rfile.layout, 2, 3) as arena:
        with GroupLoader(arena, rfile.path, 2, reader=_refuse_direct, verify=True) as ld:
            assert ld.direct is False
            ld.begin_layer(0)
            reqs = groups_of(rfile, 3)
            ld.submit(reqs)
            for r in reqs:
                b = ld.acquire(r.group, timeout=10)
                check_bank(arena, rfile, b, 3)
                ld.release(b)
            ld.end_layer()
        with pytest.raises(ArenaError, match="refuses O_DIRECT"):
            GroupLoader(arena, rfile.path, 1, direct=True, reader=_refuse_direct)


def test_acquire_any_takes_groups_in_completion_order(rfile) -> None:
    rb = rfile.layout.record_bytes
    slow = {2 * rb}

    def reader(fd, buffers, offset):
        if offset in slow:
            time.sleep(0.2)
        return os.preadv(fd, buffers, offset)

    with (
        Arena(rfile.layout, 4, 1) as arena,
        GroupLoader(arena, rfile.path, 4, direct=False, reader=reader) as ld,
    ):
        ld.begin_layer(0)
        ld.submit([rfile.request(g, g, 1) for g in (2, 3, 4)])
        got = []
        left = [2, 3, 4]
        while left:
            bank = ld.acquire_any(left, timeout=10)
            check_bank(arena, rfile, bank, 1)
            got.append(bank.group)
            left.remove(bank.group)
            ld.release(bank)
        assert got[-1] == 2 and sorted(got) == [2, 3, 4]
        with pytest.raises(ProtocolError, match="Released"):
            ld.acquire_any([3], timeout=1)
        with pytest.raises(ProtocolError, match="never submitted"):
            ld.acquire_any([9], timeout=1)
        ld.end_layer()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm on this host")
def test_tmpfs_file_with_auto_direct() -> None:
    """tmpfs refuses O_DIRECT on older kernels and accepts it on newer ones: auto mode works on
    both and reports which one it used."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        rf = write_record_file(os.path.join(d, "experts.bin"), PADDED, 9, seed=1)
        with Arena(PADDED, 2, 3) as arena, GroupLoader(arena, rf.path, 2, verify=True) as ld:
            assert isinstance(ld.direct, bool)
            ld.begin_layer(0)
            reqs = groups_of(rf, 3)
            ld.submit(reqs)
            for r in reqs:
                b = ld.acquire(r.group, timeout=10)
                check_bank(arena, rf, b, 3)
                ld.release(b)
            ld.end_layer()


def test_constructor_failures_leave_nothing_behind(rfile, workdir) -> None:
    arena = Arena(rfile.layout, 2, 2)
    maps = list(arena._maps)
    with pytest.raises(FileNotFoundError):
        GroupLoader(arena, workdir / "missing.bin", 2)
    with pytest.raises(ValueError, match="queue_depth"):
        GroupLoader(arena, rfile.path, 0)
    arena.close()
    assert all(mm.closed for mm in maps)
    with pytest.raises(LoaderClosedError, match="arena is closed"):
        GroupLoader(arena, rfile.path, 1)


def _sleeps(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def _settled(threads: list[threading.Thread]) -> list[int]:
    """The threads' sleep counts once they stay the same for 0.2 s (a loaded machine may be
    slow to let a woken thread run and sleep again)."""
    deadline = time.monotonic() + 10
    last = [_sleeps(t.native_id) for t in threads]
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = [_sleeps(t.native_id) for t in threads]
        if now == last:
            return now
        last = now
    raise AssertionError("the reader threads never settled")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread counters: Linux")
def test_a_freed_bank_wakes_one_idle_reader_not_all(rfile) -> None:
    """Releasing the only bank makes one queued read possible: one of the Q idle reader threads
    wakes (its sleep count grows) and reads it; the others sleep on, and releasing a bank with
    nothing queued wakes none. Every reader woken at each release would cost Q context
    switches on the cores the consumer computes on."""
    Q = 4
    with Arena(rfile.layout, 1, 1) as arena, GroupLoader(arena, rfile.path, Q) as ld:
        readers = [t for t in threading.enumerate() if t.name.startswith("estream-arena-loader")]
        assert len(readers) == Q
        ld.begin_layer(0)
        ld.submit(groups_of(rfile, 1)[:2])
        bank = ld.acquire(0, timeout=10)
        before = _settled(readers)  # every reader idle: one bank, held here
        ld.release(bank)
        ld.release(ld.acquire(1, timeout=10))
        after = _settled(readers)  # the reader of group 1 idle again
        assert sum(a != b for a, b in zip(after, before, strict=True)) == 1, (before, after)
        ld.end_layer()


@pytest.mark.parametrize("direct", [None, False])
def test_read_into_fills_the_banks_it_is_given_and_checks_them(rfile, direct) -> None:
    """`read_into`: groups read now into the banks named, in any order (records land in the
    bank's slots; padding is not kept), counted in the stats as layer -1; a corrupt record's
    checksum raises `ChecksumError` and ends the call there; refused while a layer is open,
    for a bank out of range or given twice, and for requests and banks of different lengths."""
    G = 4
    reqs = groups_of(rfile, G)
    banks = list(reversed(range(len(reqs))))  # group k into bank n-1-k
    with (
        Arena(rfile.layout, len(reqs), G) as arena,
        GroupLoader(arena, rfile.path, 1, direct=direct, verify=True) as ld,
    ):
        for j in range(3):
            arena.plane_view(j)[:] = 0xA5  # poisoned: every byte checked below was written
        ld.read_into(reqs, banks)
        for r, b in zip(reqs, banks, strict=True):
            for i in range(r.n_records):
                for j in range(3):
                    got = bytes(arena.slot_view(j, b * G + i))
                    assert got == rfile.projection(r.group * G + i, j), (r.group, i, j)
        st = ld.stats
        assert st.n_reads == len(reqs) and st.n_failed == 0
        assert st.bytes_read == rfile.n_records * rfile.layout.record_bytes
        assert [(e.layer, e.group, e.bank) for e in st.events] == [
            (-1, r.group, b) for r, b in zip(reqs, banks, strict=True)
        ]
        bad = GroupRequest(1, reqs[1].offset, reqs[1].n_records, (0,) * reqs[1].n_records)
        with pytest.raises(ChecksumError, match=r"layer 7, group 1, .* record 0 .* has crc32"):
            ld.read_into([reqs[0], bad, reqs[2]], [0, 1, 2], layer=7)
        assert [e.layer for e in ld.stats.events[-2:]] == [7, 7]
        assert ld.stats.n_failed == 1 and ld.stats.n_reads == len(reqs) + 1  # reqs[2]: not read
        with pytest.raises(ValueError, match="2 requests for 1 banks"):
            ld.read_into(reqs[:2], [0])
        with pytest.raises(IndexError, match=f"bank {len(reqs)} out of range"):
            ld.read_into(reqs[:1], [len(reqs)])
        with pytest.raises(ProtocolError, match="a bank appears twice"):
            ld.read_into(reqs[:2], [1, 1])
        ld.begin_layer(0)
        with pytest.raises(ProtocolError, match="no layer open and no read queued"):
            ld.read_into(reqs[:1], [0])
        ld.end_layer()
