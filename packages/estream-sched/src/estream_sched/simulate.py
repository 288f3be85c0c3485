"""A discrete-event simulator of the loading/execution pipeline, written independently of the
recurrence: an event queue, explicit bank objects with the arena's state machine, ``q`` reader
actors and one executor actor. It is the oracle for :func:`~estream_sched.pipeline_time` in the
tests and the tool for what-if studies the recurrence does not cover:

* ``reader_policy="round_robin"`` (default): group ``k`` is read by reader ``k mod q`` into bank
  ``k mod b`` — the semantics of the recurrence (``d_{k-q}``, ``f_{k-b}``), equal to it exactly.
* ``reader_policy="shared_queue"``: a FIFO work queue served by ``q`` threads, reads issued in
  storage order into the next bank released — what a thread-pool loader does. It equals the
  recurrence whenever reads complete in issue order (e.g. equal-size groups).
* ``simulate_layers(..., cross_layer_readahead=True)``: the loader may start the next layer's
  reads into banks freed by the current layer (an oracle that knows the next layer's routed
  groups: an upper bound on what read-ahead can win).
* ``reads_wait=True``: a layer's reads start only when its non-expert work has ended (the
  ``after-routing`` schedule with a router after attention); the recurrence with
  ``t_read = t_ne``.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np
from numpy.typing import ArrayLike

from ._model import Schedule

__all__ = ["RequestSchedule", "SimulationError", "simulate", "simulate_layers"]

ReaderPolicy = Literal["round_robin", "shared_queue"]


class SimulationError(RuntimeError):
    """The simulated pipeline broke one of its own invariants (a bug, never a user error)."""


class BankState(enum.Enum):
    AVAILABLE = "available"
    FILLING = "filling"
    READY = "ready"
    IN_USE = "in_use"


_LEGAL = {
    (BankState.AVAILABLE, BankState.FILLING),
    (BankState.FILLING, BankState.READY),
    (BankState.READY, BankState.IN_USE),
    (BankState.IN_USE, BankState.AVAILABLE),
}


class Bank:
    def __init__(self, index: int) -> None:
        self.index = index
        self.state = BankState.AVAILABLE
        self.group: int | None = None
        self.next_group = index  # round-robin: the next group this bank may hold

    def move(self, to: BankState, group: int) -> None:
        if (self.state, to) not in _LEGAL:
            raise SimulationError(f"bank {self.index}: illegal {self.state.name} -> {to.name}")
        if to is BankState.FILLING:
            self.group = group
        elif self.group != group:
            raise SimulationError(f"bank {self.index} holds group {self.group}, not {group}")
        if to is BankState.AVAILABLE:
            self.group = None
        self.state = to


class Reader:
    def __init__(self, index: int) -> None:
        self.index = index
        self.busy_with: int | None = None
        self.next_group = index  # round-robin: the next group this reader serves


@attrs.define
class _Group:
    layer: int
    k: int
    L: float
    X: float
    bank: int = -1
    a: float = np.nan
    d: float = np.nan
    s: float = np.nan
    f: float = np.nan


@attrs.frozen
class RequestSchedule:
    """Per layer: the schedule in absolute times (``t_ne`` = absolute end of non-expert work),
    the layer start times, and the end of the last layer."""

    layers: tuple[Schedule, ...]
    starts: tuple[float, ...]
    total_s: float


# Event kinds, ordered only for determinism of ties (times decide everything else).
_NE_DONE, _READ_DONE, _EXEC_DONE = 0, 1, 2


class _Sim:
    def __init__(
        self,
        layers: Sequence[tuple[np.ndarray, np.ndarray, float]],
        q: int,
        b: int,
        policy: ReaderPolicy,
        readahead: bool,
        wait: bool = False,
    ) -> None:
        self.layers = layers
        self.q, self.b, self.policy, self.readahead = q, b, policy, readahead
        self.wait = wait
        self.groups: list[_Group] = []
        self.first: list[int] = []  # global index of each layer's first group
        for li, (L, X, _) in enumerate(layers):
            self.first.append(len(self.groups))
            self.groups += [_Group(li, k, float(L[k]), float(X[k])) for k in range(len(L))]
        self.banks = [Bank(i) for i in range(b)]
        self.readers = [Reader(i) for i in range(q)]
        self.free_banks: deque[int] = deque(range(b))
        self.next_read = 0  # shared_queue: next group to issue
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        # executor
        self.layer = -1
        self.layer_start: list[float] = []
        self.ne_done = False
        self.exec_busy = False
        self.next_exec = 0  # global index of the next group to execute
        self.ne_end: list[float] = []
        self.in_flight = 0

    def push(self, t: float, kind: int, x: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, x))

    def start_layer(self, li: int, t: float) -> None:
        self.layer = li
        self.layer_start.append(t)
        self.ne_done = False
        self.exec_busy = True  # the executor runs the layer's non-expert work first
        end = t + float(self.layers[li][2])
        self.ne_end.append(end)
        self.push(end, _NE_DONE, li)

    def may_read(self, j: int) -> bool:
        if self.wait:  # the layer's routes are known once its non-expert work is done
            return self.groups[j].layer == self.layer and self.ne_done
        return self.readahead or self.groups[j].layer <= self.layer

    def begin_read(self, t: float, j: int, reader: Reader, bank: Bank) -> None:
        g = self.groups[j]
        bank.move(BankState.FILLING, j)
        reader.busy_with = j
        g.bank = bank.index
        g.a = t
        g.d = t + g.L
        self.in_flight += 1
        if self.in_flight > self.q:
            raise SimulationError(f"{self.in_flight} reads in flight with q={self.q}")
        self.push(g.d, _READ_DONE, j)

    def dispatch_reads(self, t: float) -> None:
        n = len(self.groups)
        if self.policy == "round_robin":
            progress = True
            while progress:
                progress = False
                for r in self.readers:
                    j = r.next_group
                    if r.busy_with is not None or j >= n or not self.may_read(j):
                        continue
                    bank = self.banks[j % self.b]
                    if bank.next_group != j or bank.state is not BankState.AVAILABLE:
                        continue
                    r.next_group += self.q
                    bank.next_group += self.b
                    self.begin_read(t, j, r, bank)
                    progress = True
        else:
            while self.next_read < n and self.free_banks and self.may_read(self.next_read):
                idle = [r for r in self.readers if r.busy_with is None]
                if not idle:
                    break
                bank = self.banks[self.free_banks.popleft()]
                self.begin_read(t, self.next_read, idle[0], bank)
                self.next_read += 1

    def dispatch_exec(self, t: float) -> None:
        if self.exec_busy or not self.ne_done:
            return
        j = self.next_exec
        if j >= len(self.groups) or self.groups[j].layer != self.layer:
            return
        g = self.groups[j]
        bank = self.banks[g.bank] if g.bank >= 0 else None
        if bank is None or bank.state is not BankState.READY or bank.group != j:
            return
        bank.move(BankState.IN_USE, j)
        self.exec_busy = True
        g.s = t
        g.f = t + g.X
        self.push(g.f, _EXEC_DONE, j)

    def layer_done(self, li: int) -> bool:
        end = self.first[li + 1] if li + 1 < len(self.layers) else len(self.groups)
        return self.next_exec >= end

    def run(self) -> None:
        if not self.layers:
            return
        self.start_layer(0, 0.0)
        self.dispatch_reads(0.0)
        while self.heap:
            t, kind, _, x = heapq.heappop(self.heap)
            if kind == _READ_DONE:
                g = self.groups[x]
                self.banks[g.bank].move(BankState.READY, x)
                reader = next(r for r in self.readers if r.busy_with == x)
                reader.busy_with = None
                self.in_flight -= 1
            elif kind == _NE_DONE:
                self.ne_done = True
                self.exec_busy = False
            else:
                g = self.groups[x]
                bank = self.banks[g.bank]
                bank.move(BankState.AVAILABLE, x)
                if self.policy == "shared_queue":
                    self.free_banks.append(bank.index)
                self.exec_busy = False
                self.next_exec = x + 1
            # A layer ends when its last group (or, with none, its non-expert work) is done.
            if (
                not self.exec_busy
                and self.ne_done
                and self.layer_done(self.layer)
                and self.layer + 1 < len(self.layers)
            ):
                self.start_layer(self.layer + 1, t)
            self.dispatch_exec(t)
            self.dispatch_reads(t)
            self.dispatch_exec(t)
        if self.next_exec != len(self.groups) or len(self.layer_start) != len(self.layers):
            raise SimulationError("simulation deadlocked before every group executed")

    def result(self) -> RequestSchedule:
        scheds = []
        for li in range(len(self.layers)):
            end = self.first[li + 1] if li + 1 < len(self.layers) else len(self.groups)
            gs = self.groups[self.first[li] : end]
            scheds.append(
                Schedule(
                    a=[g.a for g in gs],
                    d=[g.d for g in gs],
                    s=[g.s for g in gs],
                    f=[g.f for g in gs],
                    t_ne=self.ne_end[li],
                )
            )
        last = scheds[-1] if scheds else None
        total = 0.0 if last is None else float(last.total)
        return RequestSchedule(layers=tuple(scheds), starts=tuple(self.layer_start), total_s=total)


def _layer(L: ArrayLike, X: ArrayLike, t_ne: float) -> tuple[np.ndarray, np.ndarray, float]:
    L_ = np.asarray(L, dtype=np.float64)
    X_ = np.asarray(X, dtype=np.float64)
    if L_.ndim != 1 or L_.shape != X_.shape:
        raise ValueError(f"L and X must be 1-D of equal length, got {L_.shape} and {X_.shape}")
    if not (np.all(np.isfinite(L_)) and np.all(np.isfinite(X_)) and np.isfinite(t_ne)):
        raise ValueError("times must be finite")
    if (L_.size and (L_.min() < 0 or X_.min() < 0)) or t_ne < 0:
        raise ValueError("times must be >= 0")
    return L_, X_, float(t_ne)


def _check_qb(q: int, b: int, policy: str) -> None:
    for name, v in (("q", q), ("b", b)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if policy not in ("round_robin", "shared_queue"):
        raise ValueError(f"reader_policy must be 'round_robin' or 'shared_queue', got {policy!r}")


def simulate(
    L: ArrayLike,
    X: ArrayLike,
    t_ne: float,
    q: int,
    b: int,
    *,
    reader_policy: ReaderPolicy = "round_robin",
    reads_wait: bool = False,
) -> Schedule:
    """Simulate one layer (1-D ``L``, ``X``); returns its :class:`Schedule`. ``reads_wait``:
    no read starts before the non-expert work ends (module docstring)."""
    _check_qb(q, b, reader_policy)
    sim = _Sim([_layer(L, X, t_ne)], int(q), int(b), reader_policy, False, bool(reads_wait))
    sim.run()
    return sim.result().layers[0]


def simulate_layers(
    layers: Sequence[tuple[ArrayLike, ArrayLike, float]],
    q: int,
    b: int,
    *,
    reader_policy: ReaderPolicy = "round_robin",
    cross_layer_readahead: bool = False,
) -> RequestSchedule:
    """Simulate consecutive layers ``[(L, X, t_ne), ...]``: layer ``l+1`` starts (non-expert work
    on the executor, and its reads unless ``cross_layer_readahead``) when layer ``l`` ends."""
    _check_qb(q, b, reader_policy)
    sim = _Sim(
        [_layer(L, X, t) for L, X, t in layers],
        int(q),
        int(b),
        reader_policy,
        cross_layer_readahead,
    )
    sim.run()
    return sim.result()
