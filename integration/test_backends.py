"""The engine gives the same logits whether expert ops run in this process (``host``) or in an
executor process (``host-process``), in every mode and schedule, and the streamed path keeps
each bank InUse until the executor's completion fence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import estream
from estream_layout import pack_model, synth_model


@pytest.fixture(
    scope="module",
    params=["olmoe", "qwen3moe", "deepseek2", "lfm2moe", "smallthinker", "gpt-oss"],
)
def packed(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"backends-{arch}")
    src = d / f"{arch}.gguf"
    synth_model(arch, "tiny", src, seed=11)
    dst = d / f"{arch}.estream"
    pack_model(src, dst, progress=False)
    return dst


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "resident"},
        {"mode": "naive"},
        {"mode": "layer"},
        {"mode": "stream", "G": 1, "Q": 1, "B": 1},
        {"mode": "stream", "G": 2, "Q": 2, "B": 4},
        {"mode": "stream", "G": 3, "Q": 2, "B": 3, "act": "f32"},
        {"mode": "stream", "G": 2, "Q": 2, "B": 2, "schedule": "after-routing"},
        {"mode": "stream", "G": 2, "Q": 1, "B": 3, "schedule": "ondemand"},
        {"mode": "stream", "G": 2, "Q": 2, "B": 3, "pin": 80 << 10},  # the executor maps the pins
    ],
    ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()),
)
def test_modes_bit_identical_under_both_backends(packed, kw):
    toks = np.random.default_rng(4).integers(0, 64, size=41)
    out = {}
    for backend in ("host", "host-process"):
        with estream.load(packed, backend=backend, **kw) as eng:
            res = eng.prefill(toks, all_logits=True)
            assert res.metrics["backend"] == backend
            out[backend] = res.logits
            if "pin" in kw:
                assert eng.experts.pinned_bytes > 0
            if eng.config is not None:
                eng.experts.loader.check_valid()
                # every bank is back to Available: none leaked by the fence protocol
                assert eng.experts.loader._res.n_available == eng.config.B
    np.testing.assert_array_equal(out["host"], out["host-process"])


def test_host_process_streams_with_ops_in_flight(packed):
    """With B=4 the host submits a group's op and acquires the next bank before the op's fence:
    the records show a group starting before the previous one ended."""
    toks = np.random.default_rng(5).integers(0, 64, size=64)
    with estream.load(packed, backend="host-process", G=1, Q=1, B=4) as eng:
        res = eng.prefill(toks)
        first = eng.hp.moe_layers[0]  # deepseek2/lfm2moe: the leading layers are dense
        recs = [r for r in res.records if r.layer == first]
    assert len(recs) >= 2
    assert any(b.t_start < a.t_end for a, b in itertools.pairwise(recs))


def test_executor_killed_during_prefill_is_a_clear_error_and_frees_every_bank(packed):
    import os
    import signal

    import estream_htp as htp
    from estream_arena import BankState

    toks = np.random.default_rng(6).integers(0, 64, size=48)
    with estream.load(packed, backend="host-process", G=1, Q=1, B=3) as eng:
        pid = eng.backend.pid
        assert pid is not None

        def kill_once(rec):
            if eng.experts.records and len(eng.experts.records) == 1:
                os.kill(pid, signal.SIGKILL)

        eng.experts.on_group = kill_once
        loader = eng.experts.loader  # the dead executor's source is closed, a new one started
        with pytest.raises(htp.ExecutorDiedError, match="killed by signal 9"):
            eng.prefill(toks)
        res = loader._res
        assert all(res.bank_state(b) != BankState.IN_USE for b in range(3))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_prefill_command_takes_the_backend(packed, tmp_path):
    import json
    import subprocess
    import sys

    out = {}
    for backend in ("host", "host-process"):
        npy = tmp_path / f"{backend}.npy"
        r = subprocess.run(
            [sys.executable, "-m", "estream_cli.main", "prefill", str(packed),
             "--tokens", "5,9,2,7,1,3", "-G", "2", "-Q", "1", "-B", "2",
             "--backend", backend, "--all-logits", str(npy), "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["metrics"]["backend"] == backend
        out[backend] = np.load(npy)
    np.testing.assert_array_equal(out["host"], out["host-process"])
    r = subprocess.run(
        [sys.executable, "-m", "estream_cli.main", "prefill", str(packed), "--tokens", "1",
         "--backend", "dsp"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "--backend" in r.stderr


def test_no_bank_is_released_before_its_ops_fence(packed):
    """Residency across the boundary: every bank goes back to the loader only after the
    completion fence of the op that reads it (one op may read the banks of several groups that
    were Ready together: every bank acquired since the previous op), and at most B-1 banks
    wait on fences."""
    toks = np.random.default_rng(8).integers(0, 64, size=57)
    with estream.load(packed, backend="host-process", G=1, Q=2, B=4) as eng:
        src = eng.experts
        loader, graph = src.loader, src.graph
        acquire, submit, release = loader.acquire, graph.submit, loader.release
        pending: list = []  # bank acquired, its fence not yet known
        fence_of: dict = {}
        held: set = set()
        seen = {"released": 0, "max_held": 0}

        def acq(group, timeout=None):
            bank = acquire(group, timeout=timeout)
            pending.append(bank.index)
            return bank

        def sub(*a, **k):
            f = submit(*a, **k)
            assert pending, "an op submitted without a bank"
            for b in pending:  # the banks this op reads
                fence_of[b] = f
                held.add(b)
            pending.clear()
            seen["max_held"] = max(seen["max_held"], len(held))
            return f

        def rel(bank):
            f = fence_of.pop(bank.index)
            assert f.done, "bank released while its op may still read it"
            held.discard(bank.index)
            seen["released"] += 1
            return release(bank)

        loader.acquire, graph.submit, loader.release = acq, sub, rel
        eng.prefill(toks)
    assert seen["released"] > 0 and not held and not fence_of
    assert seen["max_held"] <= 3
