"""The submit / complete / release protocol across the process boundary, as a state machine.

A small bank table lives in shared memory registered with a host-process backend. Rules fill
banks that no in-flight op reads, submit expert ops that read a bank (the bank is then InUse until
the op's fence is seen), and complete fences in any order. Each completed op must equal, bit for
bit, the host backend's result on the bank's bytes *at submission* — so an op that read a bank
refilled behind its back would fail — and each completion is delivered exactly once."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import estream_htp as htp
from estream_htp import _core
from estream_htp import testing as T

D, FF, N_BANKS, N_EXPERTS, T_TOK = 32, 64, 3, 5, 6
_shared: dict[str, Any] = {}


def _world() -> dict[str, Any]:
    """One executor and one host backend for every example (spawning is the slow part)."""
    if not _shared or _shared["proc"].closed:
        rng = np.random.default_rng(0)
        _shared["experts"] = T.random_experts(rng, N_EXPERTS, D, FF)
        _shared["proc"] = htp.Backend("host-process", n_threads=2)
        _shared["host"] = htp.Backend("host", n_threads=1)
    return _shared


class BankProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        w = _world()
        self.proc: htp.Backend = w["proc"]
        self.host: htp.Backend = w["host"]
        self.experts = w["experts"]
        nbytes = [p.shape[1] for p in self.experts]
        # one slot per bank in each plane, in shared memory the executor maps itself
        self.planes = [self.proc.empty((N_BANKS, nb), np.uint8) for nb in nbytes]
        self.graph = htp.ExpertGraph(D, FF, 64, T_TOK, backend=self.proc)
        self.host_graph = htp.ExpertGraph(D, FF, 64, T_TOK, backend=self.host)
        self.content: list[int | None] = [None] * N_BANKS  # expert held by each bank
        self.readers = [0] * N_BANKS  # in-flight ops reading each bank (InUse while > 0)
        self.inflight: list[tuple[htp.Fence, int, np.ndarray, np.ndarray]] = []
        self.seen: list[int] = []
        self.rng = np.random.default_rng(1)

    @rule(data=st.data(), expert=st.integers(0, N_EXPERTS - 1))
    def fill(self, data: st.DataObject, expert: int) -> None:
        free = [b for b in range(N_BANKS) if self.readers[b] == 0]
        if not free:
            return
        b = data.draw(st.sampled_from(free))
        for plane, src in zip(self.planes, self.experts):
            plane[b] = src[expert]
        self.content[b] = expert

    @precondition(lambda self: any(c is not None for c in self.content))
    @rule(data=st.data(), n_routes=st.integers(1, T_TOK), act=st.sampled_from(["q8", "f32"]))
    def submit(self, data: st.DataObject, n_routes: int, act: str) -> None:
        filled = [b for b in range(N_BANKS) if self.content[b] is not None]
        b = data.draw(st.sampled_from(filled))
        e = self.content[b]
        assert e is not None
        slot_of_expert = np.full(N_EXPERTS, -1, np.int32)
        slot_of_expert[e] = b
        x = self.rng.standard_normal((T_TOK, D)).astype(np.float32)
        tokens = self.rng.permutation(T_TOK)[:n_routes].astype(np.int32)
        experts = np.full(n_routes, e, np.int32)
        wts = self.rng.random(n_routes).astype(np.float32)
        strides = [p.strides[0] for p in self.planes]
        addrs = [p.ctypes.data for p in self.planes]
        # expected: the host backend on the bank's bytes as they are now
        want = np.zeros((T_TOK, D), np.float32)
        self.host_graph.run(x, tokens, experts, wts, slot_of_expert, addrs, strides, want, act=act)
        y = self.proc.empty((T_TOK, D), np.float32)
        y[...] = 0
        f = self.graph.submit(x, tokens, experts, wts, slot_of_expert, addrs, strides, y, act=act)
        assert f is not None
        self.readers[b] += 1
        self.inflight.append((f, b, y, want))

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.inflight) - 1))
        f, b, y, want = self.inflight.pop(i)
        f.wait(timeout=30)
        assert y.tobytes() == want.tobytes()
        self.readers[b] -= 1  # release: the bank may be refilled once no op reads it
        self.seen.append(f.value)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def completion_is_delivered_once(self, data: st.DataObject) -> None:
        v = data.draw(st.sampled_from(self.seen))
        st_ = _core.ffi.new("htp_status *")
        assert _core.lib.htp_fence_wait(self.proc._b, v, 0, st_) == _core.lib.HTP_E_FENCE

    @invariant()
    def banks_in_use_match_in_flight_ops(self) -> None:
        assert sum(self.readers) == len(self.inflight)
        assert all(r >= 0 for r in self.readers)
        assert len(set(self.seen)) == len(self.seen)

    def teardown(self) -> None:
        for f, _b, y, want in self.inflight:
            f.wait(timeout=30)
            assert y.tobytes() == want.tobytes()
        self.inflight.clear()


BankProtocol.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
test_bank_protocol = BankProtocol.TestCase
