"""`Backend.activations()`: the activation arena of a full-accelerator pass. Memory the
backend's ops read in place (registered with an executor; private to the process on the host
kind), stage arenas that never hand out the previous stage's memory, and a size that stays
bounded over layers and passes."""

from __future__ import annotations

import numpy as np
import pytest

import estream_htp as htp


def _span(a: np.ndarray) -> tuple[int, int]:
    p = int(a.ctypes.data)
    return p, p + a.nbytes


def _disjoint(a: np.ndarray, b: np.ndarray) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a1 <= b0 or b1 <= a0


@pytest.mark.parametrize("kind", ["host", "host-process"])
def test_stages_alternate_are_in_backend_memory_and_bounded(kind: str) -> None:
    """Every array lies in registered memory on an executor backend and in private (not
    registered) memory on the host; a stage never overwrites its input or the pass's inputs;
    the arena's size is the same after the second pass as after the third: two layer-sized
    stage arenas and the 1 MiB input arena."""
    with htp.Backend(kind, n_threads=1) as be:
        pool = be.activations()
        registered = be.shared_memory
        sizes = []
        for _ in range(3):  # passes
            pool.begin_pass()
            pos = pool.put_input(np.arange(37, dtype=np.int32))
            pool.begin_stage()
            x = pool.empty((37, 300))  # the embedding's output
            x[...] = 1.0
            for _layer in range(6):
                pool.begin_stage()
                tmp = [pool.empty((37, 1000)) for _ in range(9)]  # > 1 MiB: the arena grows
                y = pool.empty((37, 300))
                for a in (*tmp, y):
                    assert (be._resolve(int(a.ctypes.data), a.nbytes) is not None) == registered
                    assert int(a.ctypes.data) % htp.ActivationArena.ALIGN == 0
                    assert pool.owns(a)
                    assert _disjoint(a, x) and _disjoint(a, pos)  # the input stays intact
                y[...] = x + 1.0
                x = y
            assert (x == 7.0).all() and (pos == np.arange(37)).all()
            sizes.append(pool.nbytes)
        # the grown arenas were coalesced (in the first pass) into one chunk of what a layer
        # used; later passes reuse them as they are: two layer-sized arenas, the 1 MiB inputs
        assert sizes[1] == sizes[2]
        rnd = htp.ActivationArena.ALIGN
        stage = 9 * -(-37 * 1000 * 4 // rnd) * rnd + -(-37 * 300 * 4 // rnd) * rnd
        assert sizes[2] == 2 * stage + (1 << 20), (sizes, stage)


@pytest.mark.parametrize("kind", ["host", "host-process"])
def test_route_buffers_pass_in_place_what_the_ops_can_read(kind: str) -> None:
    """`RouteBuffers` hand the host's ops the arrays themselves and an executor's a copy in
    registered memory (the same values), reused for the next put of the same name; an array
    already in registered memory is used in place on every backend."""
    with htp.Backend(kind, n_threads=1) as be:
        rb = be.route_buffers()
        a = np.arange(10, dtype=np.int32)
        v = rb.put("t", a)
        assert np.array_equal(v, a)
        assert (v is a) == (not be.shared_memory)
        assert rb.in_place(a) == (not be.shared_memory)
        if be.shared_memory:
            assert be._resolve(int(v.ctypes.data), v.nbytes) is not None
            w = rb.put("t", a[:4] + 1)  # the same buffer, reused
            assert int(w.ctypes.data) == int(v.ctypes.data) and np.array_equal(w, a[:4] + 1)
        shared = be.empty(8, np.float32)
        assert rb.in_place(shared) and rb.activation("x", shared) is shared


@pytest.mark.parametrize("kind", ["host", "host-process"])
def test_buffer_and_visible_give_memory_the_ops_read(kind: str) -> None:
    """`Backend.buffer` is private memory on the host (the caller's allocator when given) and
    registered shared memory on an executor; `visible` is the array itself on the host and a
    registered copy with the same values on an executor; `expose` makes a mapping resolve."""
    with htp.Backend(kind, n_threads=1) as be:
        made: list[int] = []

        def private(n: int) -> np.ndarray:
            made.append(n)
            return np.zeros(n + 64, np.uint8)

        b = be.buffer((3, 5), np.float32, private=private)
        assert b.shape == (3, 5) and b.dtype == np.float32
        assert (be._resolve(int(b.ctypes.data), b.nbytes) is not None) == be.shared_memory
        assert made == ([] if be.shared_memory else [60])
        w = np.arange(12, dtype=np.float32)
        vis = be.visible(w)
        assert np.array_equal(vis, w) and (vis is w) == (not be.shared_memory)
        if be.shared_memory:
            with pytest.raises(htp.HTPInputError, match="fd"):
                be.expose(int(w.ctypes.data), w.nbytes)
        else:
            bid = be.expose(int(w.ctypes.data), w.nbytes, writable=False)
            assert be._resolve(int(w.ctypes.data), w.nbytes) == (bid, 0)
            be.unregister(bid)
