"""The two merge loops: BPE by merge rank, SentencePiece (SPM) by token score.

Both follow llama.cpp's order exactly. BPE: repeatedly merge the adjacent pair with the lowest
rank in ``tokenizer.ggml.merges``, the leftmost one on ties. SPM: repeatedly merge the adjacent
pair whose concatenation is a vocabulary token with the highest score, the leftmost on ties.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping

__all__ = ["bpe_merge", "bpe_merge_heap", "bpe_merge_scan", "spm_merge", "spm_merge_heap"]

# Up to this many symbols the rank-list scan beats the heap's bookkeeping.
_SCAN_LIMIT = 256
_NO_RANK = 1 << 62
_NO_SCORE = float("-inf")


def bpe_merge_scan(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """BPE keeping a list of pair ranks, updated around each merge; the lowest (leftmost on
    ties) is found with C-level ``min``/``index``: O(n^2) but fast for ordinary words."""
    syms = list(word)
    if len(syms) < 2:
        return syms
    get = ranks.get
    none = _NO_RANK
    pair_ranks = [get(pair, none) for pair in itertools.pairwise(syms)]
    while pair_ranks:
        best = min(pair_ranks)
        if best == none:
            break
        i = pair_ranks.index(best)
        merged = syms[i] + syms[i + 1]
        syms[i : i + 2] = [merged]
        del pair_ranks[i]
        if i < len(pair_ranks):
            pair_ranks[i] = get((merged, syms[i + 1]), none)
        if i > 0:
            pair_ranks[i - 1] = get((syms[i - 1], merged), none)
    return syms


def bpe_merge_heap(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """BPE with a priority queue of candidate pairs: O(n log n), for long words."""
    text: list[str] = list(word)
    n = len(text)
    if n < 2:
        return text
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    get = ranks.get
    heap: list[tuple[int, int, int, str]] = []
    for i in range(n - 1):
        r = get((text[i], text[i + 1]))
        if r is not None:
            heap.append((r, i, i + 1, text[i] + text[i + 1]))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, merged = pop(heap)
        lt, rt = text[left], text[right]
        if not lt or not rt or lt + rt != merged:
            continue  # outdated: one side was merged since this pair was queued
        text[left] = merged
        text[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0:
            r = get((text[before], merged))
            if r is not None:
                push(heap, (r, before, left, text[before] + merged))
        if after >= 0:
            r = get((merged, text[after]))
            if r is not None:
                push(heap, (r, left, after, merged + text[after]))
    out = []
    i = 0
    while i >= 0:
        out.append(text[i])
        i = nxt[i]
    return out


def bpe_merge(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """The BPE symbols of ``word`` (a byte-level encoded word)."""
    if len(word) <= _SCAN_LIMIT:
        return bpe_merge_scan(word, ranks)
    return bpe_merge_heap(word, ranks)


def spm_merge(text: str, lookup: Callable[[str], int | None], scores: list[float]) -> list[str]:
    """SentencePiece merges over the code points of ``text``; returns the final pieces.

    ``lookup`` maps a string to its token id (or None). A pair is a candidate when its
    concatenation is a token; the highest score wins, the leftmost on ties. ``scores`` must
    be finite (-inf marks "no candidate" in the scan); see :func:`spm_merge_heap`.
    """
    if len(text) > _SCAN_LIMIT:
        return spm_merge_heap(text, lookup, scores)
    syms = list(text)
    if len(syms) < 2:
        return syms
    none = _NO_SCORE

    def score(pair: str) -> float:
        tid = lookup(pair)
        return none if tid is None else scores[tid]

    pair_scores = [score(a + b) for a, b in itertools.pairwise(syms)]
    while pair_scores:
        best = max(pair_scores)
        if best == none:
            break
        i = pair_scores.index(best)
        merged = syms[i] + syms[i + 1]
        syms[i : i + 2] = [merged]
        del pair_scores[i]
        if i < len(pair_scores):
            pair_scores[i] = score(merged + syms[i + 1])
        if i > 0:
            pair_scores[i - 1] = score(syms[i - 1] + merged)
    return syms


def spm_merge_heap(
    text: str, lookup: Callable[[str], int | None], scores: list[float]
) -> list[str]:
    """:func:`spm_merge` with a priority queue (llama.cpp's way): O(n log n), any scores."""
    sym: list[str] = list(text)
    n = len(sym)
    if n == 0:
        return []
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, str]] = []
    for i in range(n - 1):
        cat = sym[i] + sym[i + 1]
        tid = lookup(cat)
        if tid is not None:
            heap.append((-scores[tid], i, i + 1, cat))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, merged = pop(heap)
        lt, rt = sym[left], sym[right]
        if not lt or not rt or lt + rt != merged:
            continue
        sym[left] = merged
        sym[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0:
            cat = sym[before] + merged
            tid = lookup(cat)
            if tid is not None:
                push(heap, (-scores[tid], before, left, cat))
        if after >= 0:
            cat = merged + sym[after]
            tid = lookup(cat)
            if tid is not None:
                push(heap, (-scores[tid], left, after, cat))
    out = []
    i = 0
    while i >= 0:
        out.append(sym[i])
        i = nxt[i]
    return out
