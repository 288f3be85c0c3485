"""Each fault reaches the waiting consumer as a specific exception naming layer, group and file
offset; nothing hangs; no loader thread survives close (checked by the autouse fixture)."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from estream_arena import (
    ALIGN,
    Arena,
    ChecksumError,
    FileChangedError,
    GroupLoader,
    GroupRequest,
    ProtocolError,
    ReadError,
    RecordLayout,
    ShortReadError,
)
from estream_arena.testing import FailingReader, RecordFile, ShortReader, write_record_file

LAYOUT = RecordLayout(5 * ALIGN, ((0, ALIGN), (2 * ALIGN, ALIGN), (3 * ALIGN, 2 * ALIGN)))
G = 3
RB = LAYOUT.record_bytes


@pytest.fixture
def rf(workdir) -> RecordFile:
    return write_record_file(workdir / "experts.bin", LAYOUT, 12, seed=3)


def reqs(rf: RecordFile, groups=range(4)):
    return [rf.request(k, k * G, G) for k in groups]


def assert_names(err: ReadError, layer: int, group: int, offset: int) -> None:
    assert (err.layer, err.group, err.offset) == (layer, group, offset)
    assert f"layer {layer}, group {group}, file offset {offset}" in str(err)


def consume_all_but(ld: GroupLoader, rf: RecordFile, arena: Arena, skip: set[int]) -> None:
    for k in range(4):
        if k in skip:
            continue
        bank = ld.acquire(k, timeout=10)
        for i, slot in enumerate(bank.slots):
            assert bytes(arena.slot_view(2, slot)) == rf.projection(k * G + i, 2)
        ld.release(bank)


@pytest.mark.parametrize("direct", [True, False])
def test_eio_names_the_group(rf, direct) -> None:
    reader = FailingReader(2 * G * RB, 3 * G * RB, errno.EIO)
    with (
        Arena(LAYOUT, 2, G) as arena,
        GroupLoader(arena, rf.path, 2, direct=direct, reader=reader) as ld,
    ):
        ld.begin_layer(5)
        ld.submit(reqs(rf))
        consume_all_but(ld, rf, arena, {2})
        with pytest.raises(ReadError) as info:
            ld.acquire(2, timeout=10)
        assert type(info.value) is ReadError and info.value.errno == errno.EIO
        assert isinstance(info.value.__cause__, OSError)
        assert_names(info.value, 5, 2, 2 * G * RB)
        assert "Input/output error" in str(info.value)
        ld.end_layer()  # the error was delivered: the layer may end
        assert ld.stats.n_failed == 1


def test_kept_errors_do_not_pin_the_arena(rf) -> None:
    """After an error was raised and is still referenced, closing unmaps every plane."""
    reader = FailingReader(0, RB, errno.EIO)
    arena = Arena(LAYOUT, 2, G)
    maps = list(arena._maps)
    with GroupLoader(arena, rf.path, 2, reader=reader) as ld:
        ld.begin_layer(0)
        ld.submit(reqs(rf, [0, 1]))
        with pytest.raises(ReadError) as info:
            ld.acquire(0, timeout=10)
        ld.release(ld.acquire(1, timeout=10))
        ld.end_layer()
    arena.close()
    assert info.value.group == 0
    assert all(mm.closed for mm in maps), "a plane is still mapped"


def test_failed_group_must_be_acquired_or_dropped(rf) -> None:
    reader = FailingReader(0, RB, errno.EIO)
    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 1, reader=reader) as ld:
        ld.begin_layer(0)
        ld.submit(reqs(rf, [0]))
        deadline = time.monotonic() + 10
        while ld.stats.n_failed == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(ProtocolError, match="error never acquired"):
            ld.end_layer()
        ld.drop([0])  # a group without routes does not care that its read failed
        ld.end_layer()


def test_request_beyond_end_of_file_is_a_short_read(rf) -> None:
    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 1) as ld:
        ld.begin_layer(1)
        ld.submit([rf.request(0, 0, G), GroupRequest(1, 10 * RB, G)])  # records 10..12: no 12
        ld.release(ld.acquire(0, timeout=10))
        with pytest.raises(ShortReadError) as info:
            ld.acquire(1, timeout=10)
        assert_names(info.value, 1, 1, 10 * RB)
        assert "file ended" in str(info.value)
        ld.end_layer()


def test_injected_short_read(rf) -> None:
    reader = ShortReader(end=7 * RB + 2 * ALIGN)  # ends inside record 7 (group 2)
    with Arena(LAYOUT, 4, G) as arena, GroupLoader(arena, rf.path, 2, reader=reader) as ld:
        ld.begin_layer(0)
        ld.submit(reqs(rf))
        with pytest.raises(ShortReadError) as info:
            ld.acquire(2, timeout=10)
        assert_names(info.value, 0, 2, 2 * G * RB)
        with pytest.raises(ShortReadError):
            ld.acquire(3, timeout=10)
        consume_all_but(ld, rf, arena, {2, 3})
        ld.end_layer()


@pytest.mark.parametrize("direct", [True, False])
def test_file_truncated_under_the_loader(rf, direct) -> None:
    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 2, direct=direct) as ld:
        ld.begin_layer(2)
        ld.submit(reqs(rf, [0]))
        ld.release(ld.acquire(0, timeout=10))
        os.truncate(rf.path, 7 * RB)
        ld.submit(reqs(rf, [1, 3]))
        for k in (1, 3):  # 1 lies before the cut, 3 after it: both come from a changed file
            with pytest.raises(FileChangedError, match="size changed") as info:
                ld.acquire(k, timeout=10)
            assert_names(info.value, 2, k, k * G * RB)
        ld.end_layer()


def test_file_replaced_under_the_loader(rf, workdir) -> None:
    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 2) as ld:
        ld.begin_layer(0)
        ld.submit(reqs(rf, [0]))
        ld.release(ld.acquire(0, timeout=10))
        other = write_record_file(workdir / "other.bin", LAYOUT, 12, seed=4)
        os.replace(other.path, rf.path)
        ld.submit(reqs(rf, [1]))
        with pytest.raises(FileChangedError, match="replaced") as info:
            ld.acquire(1, timeout=10)
        assert_names(info.value, 0, 1, G * RB)
        ld.end_layer()


def test_file_deleted_under_the_loader(rf) -> None:
    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 1) as ld:
        os.unlink(rf.path)
        ld.begin_layer(0)
        ld.submit(reqs(rf, [0]))
        with pytest.raises(FileChangedError, match="deleted"):
            ld.acquire(0, timeout=10)
        ld.end_layer()


def _corrupt(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("where", [0, 1 * ALIGN + 17, 4 * ALIGN + 5])  # gate, padding, down
def test_checksum_mismatch(rf, where) -> None:
    _corrupt(rf.path, 7 * RB + where)  # record 7 = group 2, record 1 of it
    with Arena(LAYOUT, 4, G) as arena:
        with GroupLoader(arena, rf.path, 2, verify=True) as ld:
            ld.begin_layer(4)
            ld.submit(reqs(rf))
            with pytest.raises(ChecksumError) as info:
                ld.acquire(2, timeout=10)
            err = info.value
            assert_names(err, 4, 2, 2 * G * RB)
            assert err.record == 1 and err.expected == rf.checksums[7] != err.actual
            assert f"file offset {7 * RB}" in str(err)
            consume_all_but(ld, rf, arena, {2})
            ld.end_layer()
        with GroupLoader(arena, rf.path, 2, verify=False) as ld:  # not verified: served as is
            ld.begin_layer(4)
            ld.submit(reqs(rf, [2]))
            ld.release(ld.acquire(2, timeout=10))
            ld.end_layer()


def test_interrupt_inside_a_read_fails_the_group_not_the_loader(rf) -> None:
    def reader(fd, buffers, offset):
        if offset == G * RB:
            raise KeyboardInterrupt
        return os.preadv(fd, buffers, offset)

    with Arena(LAYOUT, 2, G) as arena, GroupLoader(arena, rf.path, 2, reader=reader) as ld:
        ld.begin_layer(0)
        ld.submit(reqs(rf))
        with pytest.raises(ReadError, match="unexpected failure") as info:
            ld.acquire(1, timeout=10)
        assert isinstance(info.value.__cause__, KeyboardInterrupt)
        consume_all_but(ld, rf, arena, {1})
        ld.end_layer()


def test_exception_in_consumer_leaves_no_thread(rf) -> None:
    slow = FailingReader(-1, -1)  # never fails; slow it down with a sleep wrapper

    def reader(fd, buffers, offset):
        time.sleep(0.02)
        return slow(fd, buffers, offset)

    with (
        pytest.raises(KeyboardInterrupt),
        Arena(LAYOUT, 2, G) as arena,
        GroupLoader(arena, rf.path, 2, reader=reader) as ld,
    ):
        ld.begin_layer(0)
        ld.submit(reqs(rf))
        ld.acquire(0, timeout=10)  # held, never released
        raise KeyboardInterrupt
    assert ld.closed and arena.closed


def test_real_sigint_while_waiting(rf) -> None:
    """A SIGINT delivered while the consumer blocks in acquire: KeyboardInterrupt, clean exit."""
    gate = threading.Event()

    def reader(fd, buffers, offset):
        gate.wait(10)
        return os.preadv(fd, buffers, offset)

    def interrupt() -> None:
        time.sleep(0.1)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.1)
        gate.set()

    assert threading.current_thread() is threading.main_thread()
    # A runner started in the background (nohup, `cmd &`) inherits SIGINT ignored: install
    # Python's own handler for this test, as an interactive process has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt)
    try:
        with (
            pytest.raises(KeyboardInterrupt),
            Arena(LAYOUT, 2, G) as arena,
            GroupLoader(arena, rf.path, 2, direct=False, reader=reader) as ld,
        ):
            ld.begin_layer(0)
            ld.submit(reqs(rf))
            t.start()
            ld.acquire(0)  # no timeout: only the signal ends this wait
        t.join(10)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ld.closed
