"""How the rows of a forward pass are sequences: segments, requests and positions.

A pass packs several requests into one array of rows (llama.cpp's ubatch with its sequence
ids); `SeqLayout` says which rows are which sequence, so that attention and the short
convolution never cross requests and a branch continues its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

__all__ = ["Segment", "SeqLayout", "segment_rows"]


# -- how the rows of a pass are sequences -------------------------------------------------------
@attrs.frozen
class Segment:
    """Rows ``start .. start + length`` of a pass: consecutive tokens of one sequence.

    A segment with ``parent = -1`` starts a sequence (positions from 0, no history); otherwise
    it *continues* segment ``parent`` (a branch after its shared prefix): it attends to all of
    its ancestors' rows and causally to its own, its positions follow theirs (``pos0`` = their
    total length) and a short convolution sees their last rows as its history."""

    start: int
    length: int
    parent: int = -1
    pos0: int = 0


@attrs.frozen
class SeqLayout:
    """The sequence structure of one forward pass over packed rows.

    ``segments`` in row order; ``requests`` the row range ``[start, end)`` of each request (a
    root segment and the segments that continue it, contiguous). Attention is block-diagonal
    over requests and causal within each sequence; every op whose per-row result could depend
    on how many rows it is given (BLAS f32 products) runs per request, so a request's numbers
    do not depend on what it was packed with."""

    segments: tuple[Segment, ...]
    requests: tuple[tuple[int, int], ...]

    @classmethod
    def pack(cls, requests: Sequence[Sequence[int]]) -> SeqLayout:
        """Requests given as segment lengths: ``[n]`` a plain sequence of ``n`` tokens;
        ``[p, n1, n2, ...]`` a prefix of ``p`` tokens and branches of ``n1, n2, ...`` that each
        continue it. Rows are laid out request after request, prefix before its branches."""
        segs: list[Segment] = []
        spans: list[tuple[int, int]] = []
        row = 0
        for lens in requests:
            if not lens or any(int(n) < 1 for n in lens):
                raise ValueError(f"segment lengths must be positive, got {list(lens)}")
            first = row
            root = len(segs)
            segs.append(Segment(row, int(lens[0])))
            row += int(lens[0])
            for n in lens[1:]:
                segs.append(Segment(row, int(n), root, int(lens[0])))
                row += int(n)
            spans.append((first, row))
        return cls(tuple(segs), tuple(spans))

    @property
    def n_rows(self) -> int:
        return self.requests[-1][1] if self.requests else 0

    @property
    def single(self) -> bool:
        """One plain sequence: the whole pass is one causal attention."""
        return len(self.segments) == 1

    def positions(self) -> np.ndarray:
        pos = np.empty(self.n_rows, dtype=np.int32)
        for s in self.segments:
            pos[s.start : s.start + s.length] = np.arange(s.pos0, s.pos0 + s.length)
        return pos

    def context(self, i: int) -> list[Segment]:
        """The ancestors of segment ``i``, root first (empty for a root)."""
        out = []
        j = self.segments[i].parent
        while j >= 0:
            out.append(self.segments[j])
            j = self.segments[j].parent
        return out[::-1]


def segment_rows(x: np.ndarray, segs: Sequence[Segment]) -> np.ndarray:
    """The rows of ``segs`` of ``x``, back to back (a view for one segment)."""
    parts = [x[s.start : s.start + s.length] for s in segs]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
