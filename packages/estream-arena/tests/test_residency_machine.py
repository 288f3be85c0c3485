"""The residency protocol against a shadow model, one transition at a time (no threads)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from estream_arena import Bank, BankState, GroupState, ProtocolError, ReadError, Residency

N_GROUPS = 4  # group indices drawn from 0..N_GROUPS-1 (some never submitted)

A, FI, FD, R, U = "Available", "Filling", "Filled", "Ready", "InUse"


class ResidencyMachine(RuleBasedStateMachine):
    """Shadow: per bank (state, group); per group (state, bank, n_records, error, reported)."""

    @initialize(n_banks=st.integers(1, 3), group_size=st.integers(1, 3))
    def setup(self, n_banks: int, group_size: int) -> None:
        self.B, self.G = n_banks, group_size
        self.res = Residency(n_banks, group_size)
        self.banks: list[list] = [[A, None] for _ in range(n_banks)]
        self.groups: dict[int, dict] = {}
        self.layer: int | None = None
        self.next_layer = 0

    # -- helpers -------------------------------------------------------------------------------
    def snapshot(self):
        groups = {g: {**r, "error": id(r["error"])} for g, r in self.groups.items()}
        return copy.deepcopy((self.banks, groups, self.layer))

    def illegal(self, fn, *args) -> None:
        """An illegal transition raises ProtocolError and changes nothing."""
        before = self.snapshot()
        with pytest.raises(ProtocolError):
            fn(*args)
        assert self.snapshot() == before
        self.compare()

    def free_bank(self, b: int) -> None:
        self.banks[b] = [A, None]

    def compare(self) -> None:
        for b in range(self.B):
            assert self.res.bank_state(b).value == self.banks[b][0], (b, self.banks)
            assert self.res.bank_owner(b) == self.banks[b][1]
        assert self.res.layer == self.layer
        assert {g: s.value for g, s in self.res.groups().items()} == {
            g: rec["state"] for g, rec in self.groups.items()
        }

    # -- layer switch --------------------------------------------------------------------------
    @precondition(lambda self: self.layer is None)
    @rule()
    def begin_layer(self) -> None:
        self.res.begin_layer(self.next_layer)
        self.layer = self.next_layer
        self.next_layer += 1
        self.groups = {}

    @precondition(lambda self: self.layer is not None)
    @rule()
    def begin_layer_twice(self) -> None:
        self.illegal(self.res.begin_layer, 99)

    @precondition(lambda self: self.layer is not None)
    @rule()
    def end_layer(self) -> None:
        settled = all(
            r["state"] in ("Released", "Dropped") or (r["state"] == "Failed" and r["reported"])
            for r in self.groups.values()
        ) and all(s == A for s, _ in self.banks)
        if not settled:
            self.illegal(self.res.end_layer)
            return
        self.res.end_layer()
        self.layer = None
        self.groups = {}

    # -- submit / reserve / complete / publish -------------------------------------------------
    def submit(self, group: int, n: int) -> None:
        if group in self.groups or not 1 <= n <= self.G:
            self.illegal(self.res.submit, group, n)
            return
        self.res.submit(group, n)
        self.groups[group] = dict(state="Pending", bank=None, n=n, error=None, reported=False)

    def reserve(self, group: int) -> None:
        rec = self.groups.get(group)
        if rec is None or rec["state"] != "Pending" or all(s != A for s, _ in self.banks):
            self.illegal(self.res.reserve, group)
            return
        bank = self.res.reserve(group)
        assert self.banks[bank][0] == A, "reserved a bank that was not Available"
        self.banks[bank] = [FI, group]
        rec.update(state="Filling", bank=bank)

    def complete(self, bank: int) -> None:
        if bank >= self.B or self.banks[bank][0] != FI:
            self.illegal(self.res.complete, bank)
            return
        self.res.complete(bank)
        g = self.banks[bank][1]
        self.banks[bank][0] = FD
        if self.groups[g]["state"] == "Filling":
            self.groups[g]["state"] = "Filled"

    def publish(self, bank: int) -> None:
        if bank >= self.B or self.banks[bank][0] != FD:
            self.illegal(self.res.publish, bank)
            return
        g = self.banks[bank][1]
        if self.groups[g]["state"] == "Dropped":
            self.illegal(self.res.publish, bank)
            return
        self.res.publish(bank)
        self.banks[bank][0] = R
        self.groups[g]["state"] = "Ready"

    def fail(self, bank: int) -> None:
        err = ReadError("injected", layer=self.layer or 0, group=-1, offset=0, nbytes=0)
        if bank >= self.B or self.banks[bank][0] != FI:
            self.illegal(self.res.fail, bank, err)
            return
        self.res.fail(bank, err)
        g = self.banks[bank][1]
        self.free_bank(bank)
        rec = self.groups[g]
        rec["bank"] = None
        if rec["state"] == "Filling":
            rec.update(state="Failed", error=err)

    # -- consumer side -------------------------------------------------------------------------
    def acquire(self, group: int) -> None:
        rec = self.groups.get(group)
        if rec is not None and rec["state"] == "Failed":
            with pytest.raises(ReadError) as info:
                self.res.acquire(group)
            assert info.value is rec["error"]
            rec["reported"] = True
            return
        if rec is None or rec["state"] != "Ready":
            self.illegal(self.res.acquire, group)
            return
        bank = self.res.acquire(group)
        assert isinstance(bank, Bank)
        assert bank.index == rec["bank"] and bank.group == group and bank.layer == self.layer
        assert bank.slots == range(bank.index * self.G, bank.index * self.G + rec["n"])
        assert self.banks[bank.index] == [R, group]
        self.banks[bank.index][0] = U
        rec["state"] = "InUse"

    def release(self, bank: int) -> None:
        if bank >= self.B or self.banks[bank][0] != U:
            self.illegal(self.res.release, bank)
            return
        g = self.banks[bank][1]
        self.res.release(bank)
        self.free_bank(bank)
        self.groups[g].update(state="Released", bank=None)

    def retire(self, bank: int) -> None:
        legal = bank < self.B and (
            self.banks[bank][0] == R
            or (
                self.banks[bank][0] == FD and self.groups[self.banks[bank][1]]["state"] == "Dropped"
            )
        )
        if not legal:
            self.illegal(self.res.retire, bank)
            return
        g = self.banks[bank][1]
        self.res.retire(bank)
        self.free_bank(bank)
        self.groups[g].update(state="Dropped", bank=None)

    def drop(self, group: int) -> None:
        rec = self.groups.get(group)
        if rec is None or rec["state"] in ("InUse", "Released"):
            self.illegal(self.res.drop, group)
            return
        freed = self.res.drop(group)
        if rec["state"] == "Ready":
            assert freed == rec["bank"]
            self.free_bank(rec["bank"])
            rec["bank"] = None
        else:
            assert freed is None
        if rec["state"] in ("Pending", "Failed"):
            rec["error"] = None
        rec["state"] = "Dropped"

    # -- any transition on an arbitrary target: legal ones are applied, illegal ones must raise
    @precondition(lambda self: self.layer is not None)
    @rule(
        op=st.sampled_from(
            [
                "submit",
                "reserve",
                "complete",
                "publish",
                "fail",
                "acquire",
                "release",
                "retire",
                "drop",
            ]
        ),
        idx=st.integers(0, N_GROUPS - 1),
        n=st.integers(0, 4),
    )
    def anything(self, op: str, idx: int, n: int) -> None:
        if op == "submit":
            self.submit(idx, n)
        else:
            getattr(self, op)(idx)

    # -- targeted moves: pick among the banks/groups where the transition is legal, so that long
    #    legal histories (reserve → drop → complete → retire, fail → acquire → end_layer ...)
    #    are common; the rules above also try every transition on arbitrary targets.
    def banks_in(self, *states: str) -> list[int]:
        return [b for b in range(self.B) if self.banks[b][0] in states]

    def groups_in(self, *states: str) -> list[int]:
        return [g for g, r in self.groups.items() if r["state"] in states]

    @precondition(lambda self: self.layer is not None and len(self.groups) < N_GROUPS)
    @rule(data=st.data())
    def submit_new(self, data: st.DataObject) -> None:
        free = [g for g in range(N_GROUPS) if g not in self.groups]
        self.submit(data.draw(st.sampled_from(free)), data.draw(st.integers(1, self.G)))

    @precondition(lambda self: self.layer is not None and self.groups_in("Pending"))
    @rule(data=st.data())
    def reserve_pending(self, data: st.DataObject) -> None:
        self.reserve(data.draw(st.sampled_from(self.groups_in("Pending"))))

    @precondition(lambda self: self.layer is not None and self.banks_in(FI))
    @rule(data=st.data(), ok=st.booleans())
    def finish_read(self, data: st.DataObject, ok: bool) -> None:
        bank = data.draw(st.sampled_from(self.banks_in(FI)))
        if ok:
            self.complete(bank)
        else:
            self.fail(bank)

    @precondition(lambda self: self.layer is not None and self.banks_in(FD))
    @rule(data=st.data())
    def publish_filled(self, data: st.DataObject) -> None:
        self.publish(data.draw(st.sampled_from(self.banks_in(FD))))

    @precondition(lambda self: self.layer is not None and self.banks_in(FD, R))
    @rule(data=st.data())
    def retire_some(self, data: st.DataObject) -> None:
        self.retire(data.draw(st.sampled_from(self.banks_in(FD, R))))

    @precondition(lambda self: self.layer is not None and self.groups_in("Ready", "Failed"))
    @rule(data=st.data())
    def acquire_ready(self, data: st.DataObject) -> None:
        self.acquire(data.draw(st.sampled_from(self.groups_in("Ready", "Failed"))))

    @precondition(lambda self: self.layer is not None and self.banks_in(U))
    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        self.release(data.draw(st.sampled_from(self.banks_in(U))))

    @precondition(lambda self: self.layer is not None and self.groups)
    @rule(data=st.data())
    def drop_submitted(self, data: st.DataObject) -> None:
        self.drop(data.draw(st.sampled_from(sorted(self.groups))))

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def valid(self) -> None:
        self.res.check_valid()

    @invariant()
    def agrees_with_shadow(self) -> None:
        if hasattr(self, "res"):
            self.compare()

    @invariant()
    def bindings_only_to_ready_banks(self) -> None:
        if not hasattr(self, "res"):
            return
        want = {}
        for g, rec in self.groups.items():
            if rec["state"] in ("Ready", "InUse"):
                for i in range(rec["n"]):
                    want[g * self.G + i] = rec["bank"] * self.G + i
        got = self.res.bindings()
        assert got == want
        for slot in got.values():
            assert self.banks[slot // self.G][0] in (R, U)

    @invariant()
    def no_bank_owned_twice(self) -> None:
        if not hasattr(self, "res"):
            return
        owners = [self.res.bank_owner(b) for b in range(self.B)]
        live = [g for g in owners if g is not None]
        assert len(live) == len(set(live))
        assert self.res.n_available == sum(
            self.res.bank_state(b) is BankState.AVAILABLE for b in range(self.B)
        )


TestResidencyMachine = ResidencyMachine.TestCase


def test_check_valid_catches_corruption() -> None:
    """check_valid is not vacuous: corrupt the private state and it must fail."""
    res = Residency(2, 2)
    res.begin_layer(0)
    res.submit(0, 2)
    bank = res.reserve(0)
    res.complete(bank)
    res.publish(bank)
    res.check_valid()
    res._state[bank] = BankState.FILLING  # a visible binding to a non-Ready bank
    with pytest.raises(AssertionError):
        res.check_valid()
    res._state[bank] = BankState.READY
    res._free.append(bank)  # a Ready bank on the free list: could be refilled under a reader
    with pytest.raises(AssertionError):
        res.check_valid()
    res._free.pop()
    res._owner[1 - bank] = 0  # one group owning two banks
    res._state[1 - bank] = BankState.READY
    res._free.remove(1 - bank)
    with pytest.raises(AssertionError):
        res.check_valid()


def test_in_use_bank_is_never_reserved() -> None:
    res = Residency(1, 1)
    res.begin_layer(3)
    res.submit(0, 1)
    res.submit(1, 1)
    b = res.reserve(0)
    res.complete(b)
    res.publish(b)
    held = res.acquire(0)
    with pytest.raises(ProtocolError, match="no Available bank"):
        res.reserve(1)
    assert res.group_state(1) is GroupState.PENDING
    res.release(held.index)
    assert res.reserve(1) == b
