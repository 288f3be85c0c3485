"""A caller that drops its fences half-way (an exception or Ctrl-C between submit and wait) loses
no op and no queue slot: the backend holds outstanding fences until `Backend.drain` (or a
wait) takes their completions, a submit cut short as the C call returns is recovered by the
next submit, and a registered mapping whose finalizer is interrupted is still unregistered."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref
from typing import Any

import numpy as np
import pytest
from helpers import KINDS, REMOTE_KINDS

import estream_htp as htp
from estream_htp import _backend
from estream_htp._ffi import ffi, lib


def _nop(be: htp.Backend) -> Any:
    c = be.call(lib.HTP_OP_NOP)
    c.what = "nop"
    return c


def _fill_and_wait(be: htp.Backend) -> None:
    """A whole queue's worth of ops submitted, then waited for: no CapacityError."""
    fences = [be.submit(_nop(be)) for _ in range(lib.HTP_QUEUE_DEPTH)]
    for f in fences:
        f.wait(10)
    assert not be._pending


@pytest.mark.parametrize("kind", KINDS)
def test_dropped_fences_are_drained(kind: str) -> None:
    """A queue's worth of fences dropped unwaited: drain takes every completion, and the
    queue takes a full depth of ops again."""
    with htp.Backend(kind, n_threads=1) as be:
        for _ in range(lib.HTP_QUEUE_DEPTH):
            be.submit(_nop(be))
        gc.collect()
        assert len(be._pending) == lib.HTP_QUEUE_DEPTH  # held, not forgotten
        be.drain()
        assert not be._pending
        _fill_and_wait(be)


class _CutLib:
    """The C library with htp_op_submit raising KeyboardInterrupt before or after the call."""

    def __init__(self, after: bool) -> None:
        self.after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(lib, name)

    def htp_op_submit(self, *args: Any) -> Any:
        if not self.after:
            raise KeyboardInterrupt
        lib.htp_op_submit(*args)
        raise KeyboardInterrupt


@pytest.mark.parametrize("after", [True, False], ids=["issued", "not-issued"])
@pytest.mark.parametrize("kind", KINDS)
def test_submit_cut_short_loses_no_op_and_no_slot(
    kind: str, after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt as the C submit returns (the op issued) or before it (not issued):
    afterwards a full queue depth of ops runs and the next fence is the C side's next
    number."""
    with htp.Backend(kind, n_threads=1) as be:
        for _ in range(3):
            with monkeypatch.context() as m:
                m.setattr(_backend, "lib", _CutLib(after))
                with pytest.raises(KeyboardInterrupt):
                    be.submit(_nop(be))
        _fill_and_wait(be)
        f = be.submit(_nop(be))
        f.wait(10)
        assert f.value == (3 if after else 0) + lib.HTP_QUEUE_DEPTH + 1  # the C side's count
        st = ffi.new("htp_status *")
        assert lib.htp_fence_wait(be._b, f.value, 0, st) == lib.HTP_E_FENCE  # taken, by us


@pytest.mark.parametrize("kind", KINDS)
def test_interrupted_finalizer_still_unregisters(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt raised inside a mapping's finalizer: the buffer is unregistered
    (its range forgotten, its id freed on the C side) and the interrupt is raised again in
    the main thread (where SIGINT is Python's: a test run started in the background, with
    SIGINT ignored, gets Python's handler for this test)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_finalizer(kind, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_finalizer(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with htp.Backend(kind, n_threads=1) as be:
        a = be.empty(4096, np.uint8)
        bid = next(b for s, e, b in be._regions if s == int(a.ctypes.data))
        real = htp.Backend.unregister
        calls = []

        def interrupted_once(self: htp.Backend, b: int) -> None:
            calls.append(b)
            if len(calls) == 1:
                raise KeyboardInterrupt
            real(self, b)

        monkeypatch.setattr(htp.Backend, "unregister", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            _backend._unregister_quietly(weakref.ref(be), bid)
            for _ in range(10**6):  # the re-raised interrupt arrives at the next check
                pass
        assert calls == [bid, bid]
        assert all(b != bid for _, _, b in be._regions)
        assert lib.htp_buffer_unregister(be._b, bid) != lib.HTP_OK  # no longer registered
        del a


def _eventfds() -> set[int]:
    """This process's open eventfds."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventfd]":
                out.add(int(name))
        except OSError:
            pass  # the listing's own descriptor, closed since
    return out


@pytest.mark.parametrize("kind", REMOTE_KINDS)
def test_an_executor_whose_doorbell_is_lost_still_serves_the_ring(kind: str) -> None:
    """The executor sleeps on a doorbell (an eventfd) when its ring is idle. A doorbell lost
    to memory ordering (under qemu-user a guest fence need not be a host one) must not stall
    the ring for good: the host's doorbell is pointed at an eventfd nobody watches, and every
    op submitted after the executor has gone to sleep still completes, within its bounded
    sleep (`EXEC_SLEEP_MS`), not never."""
    before = _eventfds()
    with htp.Backend(kind, n_threads=1) as be:  # type: ignore[arg-type]
        be.submit(_nop(be)).wait(timeout=60)  # started, hello done
        submit_fd = min(_eventfds() - before)  # the host's doorbell: made first
        nobody = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        os.dup2(nobody, submit_fd)  # from now on every doorbell rings nobody
        os.close(nobody)
        for _ in range(3):
            time.sleep(0.25)  # past the executor's spin: it sleeps
            be.submit(_nop(be)).wait(timeout=10)  # TimeoutError if it slept for good
