from __future__ import annotations

import itertools
import mmap
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_arena import (
    ALIGN,
    Arena,
    ArenaError,
    RecordLayout,
    huge_page_bytes_in,
    private_mapping,
    thp_mode,
)

OLMOE = RecordLayout.contiguous(1_179_648, 1_179_648, 1_179_648)


def test_contiguous_layout_matches_contract() -> None:
    assert OLMOE.record_bytes == 3_538_944
    assert OLMOE.planes == ((0, 1_179_648), (1_179_648, 1_179_648), (2_359_296, 1_179_648))
    assert OLMOE.padding_bytes == 0
    assert [j for _, _, j in OLMOE.segments()] == [0, 1, 2]


def test_layout_segments_cover_record_in_order() -> None:
    lay = RecordLayout(10 * ALIGN, ((5 * ALIGN, ALIGN), (ALIGN, 2 * ALIGN), (7 * ALIGN, ALIGN)))
    segs = lay.segments()
    assert segs == [
        (0, ALIGN, -1),
        (ALIGN, 2 * ALIGN, 1),
        (3 * ALIGN, 2 * ALIGN, -1),
        (5 * ALIGN, ALIGN, 0),
        (6 * ALIGN, ALIGN, -1),
        (7 * ALIGN, ALIGN, 2),
        (8 * ALIGN, 2 * ALIGN, -1),
    ]
    assert sum(n for _, n, _ in segs) == lay.record_bytes
    assert lay.padding_bytes == 6 * ALIGN


@st.composite
def layouts(draw: st.DrawFn) -> tuple[RecordLayout, list[int]]:
    sizes = [draw(st.integers(1, 4)) * ALIGN for _ in range(3)]
    gaps = [draw(st.integers(0, 2)) * ALIGN for _ in range(4)]
    order = draw(st.permutations(range(3)))
    planes = [(0, 0)] * 3
    pos = gaps[0]
    for k, j in enumerate(order):
        planes[j] = (pos, sizes[j])
        pos += sizes[j] + gaps[k + 1]
    return RecordLayout(pos, tuple(planes)), list(order)


@given(layouts())
def test_segments_tile_the_record(case) -> None:
    lay, order = case
    segs = lay.segments()
    pos = 0
    for off, n, _ in segs:
        assert off == pos and n > 0 and off % ALIGN == 0 and n % ALIGN == 0
        pos += n
    assert pos == lay.record_bytes
    assert [j for _, _, j in segs if j >= 0] == order
    assert {(o, n) for o, n, j in segs if j >= 0} == set(lay.planes)
    assert sum(n for _, n, j in segs if j < 0) == lay.padding_bytes
    assert all(a[2] >= 0 or b[2] >= 0 for a, b in itertools.pairwise(segs))  # gaps merged


@pytest.mark.parametrize(
    ("record_bytes", "planes", "match"),
    [
        (3 * ALIGN + 1, ((0, ALIGN), (ALIGN, ALIGN), (2 * ALIGN, ALIGN)), "record_bytes"),
        (3 * ALIGN, ((0, ALIGN), (ALIGN, ALIGN)), "3 planes"),
        (3 * ALIGN, ((0, ALIGN), (100, ALIGN), (2 * ALIGN, ALIGN)), "multiples"),
        (3 * ALIGN, ((0, ALIGN), (ALIGN, 2000), (2 * ALIGN, ALIGN)), "multiples"),
        (3 * ALIGN, ((0, 2 * ALIGN), (ALIGN, ALIGN), (2 * ALIGN, ALIGN)), "overlap"),
        (3 * ALIGN, ((0, ALIGN), (ALIGN, ALIGN), (2 * ALIGN, 2 * ALIGN)), "does not fit"),
        (3 * ALIGN, ((0, ALIGN), (ALIGN, 0), (2 * ALIGN, ALIGN)), "size"),
    ],
)
def test_layout_rejects_bad_geometry(record_bytes, planes, match) -> None:
    with pytest.raises(ValueError, match=match):
        RecordLayout(record_bytes, planes)


@pytest.mark.parametrize(("B", "G"), [(1, 1), (3, 4), (5, 2)])
def test_arena_addresses_and_views(B: int, G: int) -> None:
    lay = RecordLayout(7 * ALIGN, ((0, 2 * ALIGN), (3 * ALIGN, ALIGN), (4 * ALIGN, 3 * ALIGN)))
    with Arena(lay, B, G) as arena:
        assert arena.n_slots == B * G and arena.n_banks == B and arena.group_size == G
        assert arena.total_bytes == B * G * (2 + 1 + 3) * ALIGN
        for j, stride in enumerate(arena.slot_bytes):
            base = arena.plane_address(j)
            assert base % mmap.PAGESIZE == 0
            plane = arena.plane_view(j)
            assert plane.dtype == np.uint8 and plane.nbytes == B * G * stride
            assert plane.ctypes.data == base
            for s in range(arena.n_slots):
                assert arena.slot_address(j, s) == base + s * stride
                v = arena.slot_view(j, s)
                assert v.ctypes.data == base + s * stride and v.nbytes == stride
                v[:] = (j * 31 + s) % 251  # writable, no overlap between slots
            for s in range(arena.n_slots):
                assert np.all(arena.slot_view(j, s) == (j * 31 + s) % 251)
        assert arena.bank_slots(B - 1) == range((B - 1) * G, B * G)
        with pytest.raises(IndexError):
            arena.slot_address(0, B * G)
        with pytest.raises(IndexError):
            arena.plane_view(3)


def test_arena_planes_are_shareable_memfds() -> None:
    """A second mapping of the memfd (as another process would make) sees the same bytes."""
    lay = RecordLayout.contiguous(ALIGN, ALIGN, 2 * ALIGN)
    with Arena(lay, 2, 2) as arena:
        arena.slot_view(2, 3)[:] = 0xA5
        fd = os.dup(arena.fd(2))
        try:
            other = mmap.mmap(fd, 4 * 2 * ALIGN, mmap.MAP_SHARED, mmap.PROT_READ)
            assert other[3 * 2 * ALIGN : 4 * 2 * ALIGN] == b"\xa5" * (2 * ALIGN)
            other.close()
        finally:
            os.close(fd)


def test_arena_close_is_idempotent_and_final() -> None:
    lay = RecordLayout.contiguous(ALIGN, ALIGN, ALIGN)
    arena = Arena(lay, 2, 1)
    view = arena.slot_view(0, 1)
    arena.close()
    arena.close()
    assert arena.closed
    with pytest.raises(ArenaError, match="closed"):
        arena.plane_address(0)
    view[:] = 1  # a view held across close stays valid memory, never dangling
    assert view.sum() == ALIGN


def test_arena_rejects_empty() -> None:
    with pytest.raises(ValueError):
        Arena(RecordLayout.contiguous(ALIGN, ALIGN, ALIGN), 0, 4)


@pytest.mark.parametrize(("B", "G"), [(1, 1), (3, 4)])
def test_private_arena_has_the_same_geometry_and_no_fd(B: int, G: int) -> None:
    """shared=False: the same slots, strides and views as a shared arena, private to the process."""
    lay = RecordLayout(7 * ALIGN, ((0, 2 * ALIGN), (3 * ALIGN, ALIGN), (4 * ALIGN, 3 * ALIGN)))
    with Arena(lay, B, G) as shared, Arena(lay, B, G, shared=False) as private:
        assert shared.shared and not private.shared
        assert private.total_bytes == shared.total_bytes
        for j in range(3):
            base = private.plane_address(j)
            assert base % mmap.PAGESIZE == 0
            assert private.plane_view(j).nbytes == shared.plane_view(j).nbytes
            for s in range(private.n_slots):
                private.slot_view(j, s)[:] = (j * 17 + s) % 253
            for s in range(private.n_slots):
                assert private.slot_address(j, s) == base + s * private.slot_bytes[j]
                assert np.all(private.slot_view(j, s) == (j * 17 + s) % 253)
        with pytest.raises(ArenaError, match="shared=False"):
            private.fd(0)
        assert shared.fd(0) >= 0


def test_private_arena_is_on_huge_pages_where_the_kernel_grants_them() -> None:
    """Written private planes are backed by 2 MiB pages when THP is 'always' or 'madvise' (the
    arena advises them); where THP is 'never', huge_page_bytes says 0 rather than guessing."""
    mib = 1 << 20
    lay = RecordLayout.contiguous(4 * mib, 4 * mib, 4 * mib)
    with Arena(lay, 2, 2, shared=False) as arena:
        assert arena.huge_page_bytes == 0  # nothing is written yet: no page at all
        for j in range(3):
            arena.plane_view(j)[:] = 1
        huge = arena.huge_page_bytes
        assert 0 <= huge <= arena.total_bytes
        if thp_mode() in ("always", "madvise"):
            assert huge >= arena.total_bytes // 2, (huge, arena.total_bytes)
        elif thp_mode() == "never":
            assert huge == 0
    assert arena.huge_page_bytes == 0  # closed


@pytest.mark.parametrize("nbytes", [0, 1, mmap.PAGESIZE + 3, 6 << 20])
def test_private_mapping_is_aligned_writable_and_at_least_a_page(nbytes: int) -> None:
    mm = private_mapping(nbytes)
    try:
        assert len(mm) == max(nbytes, 1)
        view = np.frombuffer(mm, dtype=np.uint8)
        assert view.ctypes.data % mmap.PAGESIZE == 0
        view[:] = 0xA5
        assert int(view.min()) == int(view.max()) == 0xA5
        lo = view.ctypes.data
        huge = huge_page_bytes_in([(lo, lo + view.nbytes)])
        if nbytes >= 6 << 20 and thp_mode() in ("always", "madvise"):
            assert huge >= 2 << 20, huge  # at least the one aligned 2 MiB page inside 6 MiB
        elif thp_mode() == "never":
            assert huge == 0
        del view
    finally:
        mm.close()
