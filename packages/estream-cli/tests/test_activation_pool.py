"""The activation pool of a full-accelerator pass: registered memory, stage arenas that never
hand out the previous stage's memory, and a size that stays bounded over layers and passes."""

from __future__ import annotations

import numpy as np

import estream_htp as htp
from estream.models.ops import ActivationPool


def _span(a: np.ndarray) -> tuple[int, int]:
    p = int(a.ctypes.data)
    return p, p + a.nbytes


def _disjoint(a: np.ndarray, b: np.ndarray) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a1 <= b0 or b1 <= a0


def test_stages_alternate_are_registered_and_bounded() -> None:
    with htp.Backend("host-process", n_threads=1) as be:
        pool = ActivationPool(be)
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
                    assert be._resolve(int(a.ctypes.data), a.nbytes) is not None
                    assert _disjoint(a, x) and _disjoint(a, pos)  # the input stays intact
                y[...] = x + 1.0
                x = y
            assert (x == 7.0).all() and (pos == np.arange(37)).all()
            sizes.append(pool.nbytes)
        # the grown arenas were coalesced (in the first pass) into one chunk of what a layer
        # used; later passes reuse them as they are: two layer-sized arenas, the 1 MiB inputs
        assert sizes[1] == sizes[2]
        rnd = ActivationPool.ALIGN
        stage = 9 * -(-37 * 1000 * 4 // rnd) * rnd + -(-37 * 300 * 4 // rnd) * rnd
        assert sizes[2] == 2 * stage + (1 << 20), (sizes, stage)
