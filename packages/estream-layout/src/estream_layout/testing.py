"""Hypothesis strategies for tests of code that consumes EStream's formats.

Public so that other packages' tests (and `integration/`) can draw the same awkward inputs:
random GGML Q4_0 / Q8_0 block matrices with row counts that are not multiples of 32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from .tiles import tile_format

__all__ = ["block_matrices", "finite_scales", "q4_0_blocks", "q8_0_blocks"]


def finite_scales(
    rng: np.random.Generator, shape: tuple[int, ...], max_abs: float = 1.0
) -> np.ndarray:
    """Finite, mostly small fp16 scales as raw bytes `[..., 2]` (some exact zeros and negatives)."""
    d = rng.uniform(-max_abs, max_abs, size=shape).astype(np.float16)
    d[rng.random(shape) < 0.05] = 0
    return d.view(np.uint8).reshape(*shape, 2)


@st.composite
def block_matrices(
    draw: Any,
    fmt: str = "q4_0-t32r4",
    *,
    max_rows: int = 97,
    max_blocks: int = 6,
    max_batch: int = 1,
    finite: bool = False,
) -> np.ndarray:
    """uint8 GGML block rows `[N, K/32*bs]` (or `[B, N, ...]` when `max_batch > 1`).

    Row counts 1..max_rows (mostly not multiples of 32). With `finite=False` the scale bytes are
    arbitrary (NaN/inf patterns included: packing must still be bit-exact); with `finite=True`
    scales are finite fp16 so the matrix can be dequantized and compared numerically.
    """
    f = tile_format(fmt)
    n = draw(st.integers(1, max_rows))
    kb = draw(st.integers(1, max_blocks))
    batch = draw(st.integers(1, max_batch))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (batch, n, kb, f.block_bytes)
    blocks = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if finite:
        blocks[..., :2] = finite_scales(rng, shape[:-1])
    out = blocks.reshape(batch, n, kb * f.block_bytes)
    return out if max_batch > 1 else out[0]


def q4_0_blocks(**kw: Any) -> st.SearchStrategy[np.ndarray]:
    """`block_matrices` of GGML Q4_0 blocks (18 bytes: fp16 scale + 16 nibble bytes)."""
    return block_matrices("q4_0-t32r4", **kw)


def q8_0_blocks(**kw: Any) -> st.SearchStrategy[np.ndarray]:
    """`block_matrices` of GGML Q8_0 blocks (34 bytes: fp16 scale + 32 int8)."""
    return block_matrices("q8_0-t32r4", **kw)
