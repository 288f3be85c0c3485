"""The two merge loops: BPE by merge rank, SentencePiece (SPM) by token score.

Both follow llama.cpp's order exactly. BPE: repeatedly merge the adjacent pair with the lowest
rank in ``tokenizer.ggml.merges``, the leftmost one on ties. SPM: repeatedly merge the adjacent
pair whose concatenation is a vocabulary token with the highest score, the leftmost on ties.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

__all__ = ["bpe_merge", "bpe_merge_heap", "bpe_merge_scan", "spm_merge"]

# Below this many symbols a plain rescan beats the heap's bookkeeping.
_SCAN_LIMIT = 24


def bpe_merge_scan(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """BPE by rescanning all pairs after each merge: O(n^2), fast for short words."""
    syms = list(word)
    get = ranks.get
    while len(syms) > 1:
        best_rank = -1
        best = -1
        prev = syms[0]
        for i in range(1, len(syms)):
            cur = syms[i]
            r = get((prev, cur))
            if r is not None and (best < 0 or r < best_rank):
                best_rank = r
                best = i - 1
            prev = cur
        if best < 0:
            break
        syms[best : best + 2] = [syms[best] + syms[best + 1]]
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
    concatenation is a token; the highest score wins, the leftmost on ties.
    """
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
