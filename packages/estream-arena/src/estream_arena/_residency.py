"""The residency table Φ_layer and the bank/group state machine, without threads or I/O.

Bank states (docs/design.md §5)::

    AVAILABLE --reserve--> FILLING --complete--> FILLED --publish--> READY --acquire--> IN_USE
        ^                     |                    |                   |                  |
        +-------fail----------+                    +--retire (drop)----+                  |
        +-----------------------------------------------------------------release--------+

FILLED is the instant between "every byte arrived (and was verified)" and "the binding is
visible"; a group dropped while its read was in flight goes FILLED → AVAILABLE by ``retire``
instead of being published. A binding (record position → slot) is visible only while its bank
is READY or IN_USE. A bank is reserved only from AVAILABLE, so never while a consumer may read it.

Group states per layer: PENDING (submitted, no bank) → FILLING → FILLED → READY → IN_USE →
RELEASED, or → DROPPED (no routes) from PENDING/FILLING/FILLED/READY/FAILED, or → FAILED.
Every illegal transition raises :class:`ProtocolError`; :meth:`Residency.check_valid` re-derives
every invariant from scratch (expensive, for tests).
"""

from __future__ import annotations

import enum
from collections import deque

import attrs

from ._errors import ProtocolError

__all__ = ["Bank", "BankState", "GroupState", "Residency"]


class BankState(enum.Enum):
    AVAILABLE = "Available"
    FILLING = "Filling"
    FILLED = "Filled"
    READY = "Ready"
    IN_USE = "InUse"


class GroupState(enum.Enum):
    PENDING = "Pending"
    FILLING = "Filling"
    FILLED = "Filled"
    READY = "Ready"
    IN_USE = "InUse"
    RELEASED = "Released"
    DROPPED = "Dropped"
    FAILED = "Failed"


#: Group states that need nothing more from anybody before the layer may end.
SETTLED = frozenset({GroupState.RELEASED, GroupState.DROPPED, GroupState.FAILED})


@attrs.frozen
class Bank:
    """A bank handed to a consumer: its ``slots`` hold records 0..n_records-1 of ``group``."""

    index: int
    group: int
    layer: int
    slots: range
    n_records: int


@attrs.define
class _Group:
    n_records: int
    state: GroupState = GroupState.PENDING
    bank: int | None = None
    error: BaseException | None = None
    reported: bool = False  # a FAILED group's error reached a consumer (acquire)


class Residency:
    """Bank and group states of one arena of ``n_banks`` × ``group_size`` slots."""

    def __init__(self, n_banks: int, group_size: int) -> None:
        if n_banks < 1 or group_size < 1:
            raise ValueError(f"need n_banks >= 1 and group_size >= 1, got {n_banks}, {group_size}")
        self.n_banks = n_banks
        self.group_size = group_size
        self._state = [BankState.AVAILABLE] * n_banks
        self._owner: list[int | None] = [None] * n_banks  # group currently holding the bank
        self._free: deque[int] = deque(range(n_banks))  # AVAILABLE banks, oldest freed first
        self._groups: dict[int, _Group] = {}
        self._layer: int | None = None

    # -- queries -------------------------------------------------------------------------------
    @property
    def layer(self) -> int | None:
        """The current layer, or None between layers."""
        return self._layer

    @property
    def n_available(self) -> int:
        return len(self._free)

    def bank_state(self, bank: int) -> BankState:
        return self._state[bank]

    def bank_owner(self, bank: int) -> int | None:
        return self._owner[bank]

    def group_state(self, group: int) -> GroupState:
        return self._need(group).state

    def group_error(self, group: int) -> BaseException | None:
        return self._need(group).error

    def has_group(self, group: int) -> bool:
        return group in self._groups

    def groups(self) -> dict[int, GroupState]:
        return {g: rec.state for g, rec in self._groups.items()}

    def unsettled(self) -> dict[int, str]:
        """Groups that still need an acquire+release or a drop before the layer may end."""
        out = {g: r.state.value for g, r in self._groups.items() if r.state not in SETTLED}
        for g, r in self._groups.items():
            if r.state is GroupState.FAILED and not r.reported:
                out[g] = f"Failed, error never acquired: {r.error}"
        return out

    def settled(self) -> bool:
        """Every submitted group is released, dropped or failed, and every bank is AVAILABLE."""
        return all(g.state in SETTLED for g in self._groups.values()) and len(self._free) == len(
            self._state
        )

    def bindings(self) -> dict[int, int]:
        """Visible Φ_layer: record position in the layer (group·G + i) → slot (bank·G + i)."""
        G = self.group_size
        out: dict[int, int] = {}
        for g, rec in self._groups.items():
            if rec.state in (GroupState.READY, GroupState.IN_USE):
                assert rec.bank is not None
                for i in range(rec.n_records):
                    out[g * G + i] = rec.bank * G + i
        return out

    def bank(self, bank: int) -> Bank:
        group = self._owner[bank]
        if group is None or self._layer is None:
            raise ProtocolError(f"bank {bank} is {self._state[bank].value}, it holds no group")
        n = self._groups[group].n_records
        start = bank * self.group_size
        return Bank(bank, group, self._layer, range(start, start + n), n)

    # -- helpers -------------------------------------------------------------------------------
    def _need(self, group: int) -> _Group:
        rec = self._groups.get(group)
        if rec is None:
            raise ProtocolError(f"group {group} was never submitted in layer {self._layer}")
        return rec

    def _need_layer(self) -> int:
        if self._layer is None:
            raise ProtocolError("no layer is open: call begin_layer first")
        return self._layer

    def _bank_in(self, bank: int, *states: BankState) -> int:
        if not 0 <= bank < self.n_banks:
            raise ProtocolError(f"bank {bank} out of range 0..{self.n_banks - 1}")
        if self._state[bank] not in states:
            want = "/".join(s.value for s in states)
            raise ProtocolError(
                f"bank {bank} is {self._state[bank].value}, expected {want} "
                f"(group {self._owner[bank]}, layer {self._layer})"
            )
        group = self._owner[bank]
        assert group is not None
        return group

    def _free_bank(self, bank: int) -> None:
        self._state[bank] = BankState.AVAILABLE
        self._owner[bank] = None
        self._free.append(bank)

    # -- transitions ---------------------------------------------------------------------------
    def begin_layer(self, layer: int) -> None:
        """Open layer ``layer`` with an empty residency table; the previous one must be ended."""
        if self._layer is not None:
            raise ProtocolError(f"layer {self._layer} is still open: call end_layer first")
        assert self.settled()
        self._layer = int(layer)
        self._groups = {}

    def end_layer(self) -> None:
        """Close the layer: every group released, dropped or failed, every bank AVAILABLE."""
        layer = self._need_layer()
        busy = self.unsettled()
        if busy:
            raise ProtocolError(
                f"cannot end layer {layer}: groups not released or dropped: {busy} "
                "(acquire+release or drop every submitted group)"
            )
        if len(self._free) != self.n_banks:
            raise ProtocolError(f"cannot end layer {layer}: a dropped group's read is in flight")
        self._layer = None
        self._groups = {}

    def submit(self, group: int, n_records: int) -> None:
        """Register ``group`` (``n_records`` records) as PENDING in the current layer."""
        layer = self._need_layer()
        if group in self._groups:
            raise ProtocolError(f"group {group} submitted twice in layer {layer}")
        if group < 0:
            raise ProtocolError(f"group index {group} must be >= 0")
        if not 1 <= n_records <= self.group_size:
            raise ProtocolError(
                f"group {group} has {n_records} records, must be 1..G={self.group_size}"
            )
        self._groups[group] = _Group(n_records)

    def reserve(self, group: int) -> int:
        """PENDING group takes the oldest AVAILABLE bank, which becomes FILLING; returns it."""
        rec = self._need(group)
        if rec.state is not GroupState.PENDING:
            raise ProtocolError(f"group {group} is {rec.state.value}, only Pending can be reserved")
        if not self._free:
            raise ProtocolError(f"no Available bank to reserve for group {group}")
        bank = self._free.popleft()
        assert self._state[bank] is BankState.AVAILABLE
        self._state[bank] = BankState.FILLING
        self._owner[bank] = group
        rec.state = GroupState.FILLING
        rec.bank = bank
        return bank

    def complete(self, bank: int) -> None:
        """Every byte of the bank's read arrived: FILLING → FILLED (still invisible)."""
        group = self._bank_in(bank, BankState.FILLING)
        self._state[bank] = BankState.FILLED
        rec = self._groups[group]
        if rec.state is GroupState.FILLING:
            rec.state = GroupState.FILLED

    def publish(self, bank: int) -> None:
        """FILLED → READY: the group's bindings become visible."""
        group = self._bank_in(bank, BankState.FILLED)
        rec = self._groups[group]
        if rec.state is not GroupState.FILLED:
            raise ProtocolError(
                f"group {group} in bank {bank} is {rec.state.value}; retire it, do not publish"
            )
        self._state[bank] = BankState.READY
        rec.state = GroupState.READY

    def fail(self, bank: int, error: BaseException) -> None:
        """The read into ``bank`` failed: the bank is AVAILABLE again, the group FAILED."""
        group = self._bank_in(bank, BankState.FILLING)
        rec = self._groups[group]
        rec.bank = None
        if rec.state is GroupState.FILLING:
            rec.state = GroupState.FAILED
            rec.error = error
        self._free_bank(bank)

    def acquire(self, group: int) -> Bank:
        """READY → IN_USE; a FAILED group raises its read error instead."""
        rec = self._need(group)
        if rec.state is GroupState.FAILED:
            assert rec.error is not None
            rec.reported = True
            raise rec.error
        if rec.state is not GroupState.READY:
            raise ProtocolError(
                f"group {group} of layer {self._layer} is {rec.state.value}, not Ready"
            )
        assert rec.bank is not None
        self._state[rec.bank] = BankState.IN_USE
        rec.state = GroupState.IN_USE
        return self.bank(rec.bank)

    def release(self, bank: int) -> None:
        """IN_USE → AVAILABLE: the consumer is done; the bank may be refilled at once."""
        group = self._bank_in(bank, BankState.IN_USE)
        rec = self._groups[group]
        rec.state = GroupState.RELEASED
        rec.bank = None
        self._free_bank(bank)

    def retire(self, bank: int) -> None:
        """READY → AVAILABLE (no routes), or FILLED → AVAILABLE for a group dropped mid-read."""
        group = self._bank_in(bank, BankState.READY, BankState.FILLED)
        rec = self._groups[group]
        if self._state[bank] is BankState.FILLED and rec.state is not GroupState.DROPPED:
            raise ProtocolError(f"bank {bank} is Filled with live group {group}: publish it")
        rec.state = GroupState.DROPPED
        rec.bank = None
        self._free_bank(bank)

    def drop(self, group: int) -> int | None:
        """The group has no routes. PENDING: never read. READY: bank AVAILABLE at once.
        FILLING/FILLED: marked DROPPED, its bank is retired when the read completes.
        Returns the bank freed at once, if any."""
        rec = self._need(group)
        st = rec.state
        if st in (GroupState.PENDING, GroupState.FAILED, GroupState.DROPPED):
            rec.state = GroupState.DROPPED
            rec.error = None
            return None
        if st in (GroupState.FILLING, GroupState.FILLED):
            rec.state = GroupState.DROPPED  # bank stays owned until retire
            return None
        if st is GroupState.READY:
            assert rec.bank is not None
            bank = rec.bank
            self.retire(bank)
            return bank
        raise ProtocolError(
            f"group {group} of layer {self._layer} is {st.value}; only unconsumed groups can be "
            "dropped"
        )

    # -- self check ----------------------------------------------------------------------------
    def check_valid(self) -> None:
        """Re-derive every invariant; raise AssertionError naming the first broken one."""
        B, G = self.n_banks, self.group_size
        free = list(self._free)
        assert len(set(free)) == len(free), f"bank listed free twice: {free}"
        assert set(free) == {b for b in range(B) if self._state[b] is BankState.AVAILABLE}, (
            f"free list {free} != Available banks {self._state}"
        )
        owners: dict[int, int] = {}
        for b in range(B):
            st, g = self._state[b], self._owner[b]
            if st is BankState.AVAILABLE:
                assert g is None, f"Available bank {b} owned by group {g}"
                continue
            assert g is not None, f"{st.value} bank {b} has no owner"
            assert g not in owners, f"group {g} owns banks {owners[g]} and {b}"
            owners[g] = b
            rec = self._groups.get(g)
            assert rec is not None, f"bank {b} owned by unknown group {g}"
            if rec.state is GroupState.DROPPED:
                assert st in (BankState.FILLING, BankState.FILLED), (
                    f"dropped group {g} still holds {st.value} bank {b}"
                )
                assert rec.bank is None or rec.bank == b
            else:
                assert rec.bank == b, f"group {g} says bank {rec.bank}, bank {b} says group {g}"
                assert rec.state.value == st.value, (
                    f"group {g} is {rec.state.value} but its bank {b} is {st.value}"
                )
        for g, rec in self._groups.items():
            assert 1 <= rec.n_records <= G
            if rec.state in (
                GroupState.FILLING,
                GroupState.FILLED,
                GroupState.READY,
                GroupState.IN_USE,
            ):
                assert owners.get(g) == rec.bank, f"group {g} {rec.state.value} without its bank"
            elif rec.state is not GroupState.DROPPED or g not in owners:
                assert g not in owners, f"{rec.state.value} group {g} still owns bank {owners[g]}"
                assert rec.bank is None, f"{rec.state.value} group {g} points at bank {rec.bank}"
            assert (rec.state is GroupState.FAILED) == (rec.error is not None)
        slots_seen: set[int] = set()
        for pos, slot in self.bindings().items():
            b = slot // G
            assert self._state[b] in (BankState.READY, BankState.IN_USE), (
                f"position {pos} visible in slot {slot} of {self._state[b].value} bank {b}"
            )
            assert slot not in slots_seen, f"slot {slot} bound twice"
            slots_seen.add(slot)
            assert pos % G == slot % G and self._owner[b] == pos // G
        if self._layer is None:
            assert not self._groups and len(free) == B
