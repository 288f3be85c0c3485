"""An engine under concurrent and interrupted use: many threads sharing one engine get the
results they would get alone on every backend (passes are serialized by the engine's lock),
`close` racing a pass ends in a correct result or `EngineClosedError`, a KeyboardInterrupt
raised from a signal handler in the middle of a pass leaves the engine working, and an
executor process that dies is replaced (a bounded number of times in a row) without leaking a
process, a file descriptor or a thread."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading

import numpy as np
import pytest

import estream
import estream_htp as htp
from estream_cli.main import main
from estream_htp import _hexagon
from estream_layout import pack_model, synth_model

STREAM = {"mode": "stream", "G": 1, "Q": 1, "B": 3}
N_THREADS = 6
_HEXAGON_MISSING = _hexagon.missing_tools()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("threads")
    synth_model("olmoe", "tiny", d / "olmoe.gguf", seed=11)
    pack_model(d / "olmoe.gguf", d / "olmoe.estream", progress=False)
    return d / "olmoe.estream"


def _prompts(n: int, size: int = 30) -> list[np.ndarray]:
    return [np.random.default_rng(100 + i).integers(0, 64, size=size) for i in range(n)]


def _backends() -> list:
    hexagon = pytest.param(
        "hexagon",
        marks=pytest.mark.skipif(
            bool(_HEXAGON_MISSING), reason=f"hexagon: {', '.join(_HEXAGON_MISSING)} missing"
        ),
    )
    return ["host", "host-process", hexagon]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", _backends())
def test_threads_sharing_an_engine_get_their_single_threaded_results(packed, backend):
    """Six threads each run prefill twice on one engine: no error, and every result is
    bit-identical to the same prompt's result run with no other thread."""
    prompts = _prompts(N_THREADS)
    with estream.load(packed, backend=backend, **STREAM) as eng:
        alone = [eng.prefill(p).logits for p in prompts]
        got: dict[int, list[np.ndarray]] = {i: [] for i in range(N_THREADS)}
        errors: list[BaseException] = []
        start = threading.Barrier(N_THREADS)

        def work(i: int) -> None:
            try:
                start.wait()
                for _ in range(2):
                    got[i].append(eng.prefill(prompts[i]).logits)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors[:3]
        for i in range(N_THREADS):
            assert len(got[i]) == 2
            for lg in got[i]:
                np.testing.assert_array_equal(lg, alone[i])


@pytest.mark.parametrize("backend", ["host", "host-process"])
def test_close_racing_prefills_gives_a_result_or_a_clear_error(packed, backend):
    """While threads prefill, another thread closes the engine: each prefill either returns
    its single-threaded logits or raises EngineClosedError; nothing else happens, and the
    executor (if any) is gone afterwards."""
    prompts = _prompts(4)
    eng = estream.load(packed, backend=backend, **STREAM)
    alone = [eng.prefill(p).logits for p in prompts]
    pid = eng.backend.pid
    outcomes: list[object] = []
    start = threading.Barrier(len(prompts) + 1)

    def work(i: int) -> None:
        start.wait()
        for _ in range(3):
            try:
                lg = eng.prefill(prompts[i]).logits
                outcomes.append(bool(np.array_equal(lg, alone[i])))
            except BaseException as e:
                outcomes.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    eng.close()
    for t in threads:
        t.join(timeout=600)
    assert len(outcomes) == 3 * len(prompts)
    for o in outcomes:
        assert o is True or isinstance(o, estream.EngineClosedError), o
    assert any(isinstance(o, estream.EngineClosedError) for o in outcomes)
    with pytest.raises(estream.EngineClosedError, match="closed"):
        eng.prefill(prompts[0])
    if pid is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("backend", ["host", "host-process"])
def test_keyboard_interrupt_mid_prefill_leaves_the_engine_working(packed, backend):
    """A KeyboardInterrupt raised by a SIGALRM handler at many points of a pass: after each,
    the next prefill on the same engine returns the uninterrupted logits."""
    toks = _prompts(1, size=60)[0]
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        with estream.load(packed, backend=backend, **STREAM) as eng:
            want = eng.prefill(toks).logits
            interrupted = 0
            for delay in np.linspace(0.0005, 0.04, 24):
                try:  # armed and disarmed inside the try: a late alarm is still caught here
                    signal.setitimer(signal.ITIMER_REAL, float(delay))
                    eng.prefill(toks)
                    signal.setitimer(signal.ITIMER_REAL, 0)
                except KeyboardInterrupt:
                    interrupted += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                np.testing.assert_array_equal(eng.prefill(toks).logits, want)
            assert interrupted > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _kill_executor_in_pass(eng, passes: set[int]) -> list[int]:
    """Make the engine's executor die (SIGKILL) as each pass numbered in `passes` (0, 1, ...
    counting every pass begun, failed ones too) routes its first group; the killed pids."""
    killed: list[int] = []
    begun = [0]
    orig = eng._begin_pass

    def begin(layout):
        out = orig(layout)
        n = begun[0]
        begun[0] += 1
        if n in passes:
            eng.experts.on_group = lambda rec: (
                None if killed and killed[-1] == eng.backend.pid else _kill(eng, killed)
            )
        else:
            eng.experts.on_group = None
        return out

    eng._begin_pass = begin
    return killed


def _kill(eng, killed: list[int]) -> None:
    killed.append(eng.backend.pid)
    os.kill(eng.backend.pid, signal.SIGKILL)


def test_executor_death_in_a_batch_restarts_it_and_answers_every_request(packed):
    """The executor is killed in the middle of the second pass of a prefill_many: the engine
    starts a new executor, every request gets its single-run logits, the dead executor is
    reaped, and no fd or thread is left over."""
    prompts = _prompts(8, size=20)
    with estream.load(packed, backend="host", **STREAM) as ref:
        want = [ref.prefill(p).logits for p in prompts]
    gc.collect()
    fds, threads = _open_fds(), threading.active_count()
    with estream.load(packed, backend="host-process", **STREAM) as eng:
        first = eng.backend.pid
        killed = _kill_executor_in_pass(eng, {1})
        got = list(eng.prefill_many(prompts, batch_tokens=64, return_exceptions=True))
        assert killed == [first] and eng.backend.pid != first
        for g, w in zip(got, want, strict=True):
            assert not isinstance(g, BaseException), g
            np.testing.assert_array_equal(g.logits, w)
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        second = eng.backend.pid
    del eng, got
    gc.collect()  # what the closed engine's arrays still map goes with them
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    assert _open_fds() == fds
    assert threading.active_count() == threads


def test_executor_restarts_are_bounded(packed):
    """An executor that dies in every pass is restarted twice in a row, then the request
    fails with ExecutorDiedError saying so; a pass that completes resets the count."""
    toks = _prompts(1)[0]
    with estream.load(packed, backend="host-process", **STREAM) as eng:
        eng.prefill(toks)  # a working executor first: the count is of deaths in a row
        killed = _kill_executor_in_pass(eng, {0, 1, 2})
        for _ in range(3):  # the pass that kills, then two restarted executors killed too
            with pytest.raises(htp.ExecutorDiedError, match="killed by signal 9"):
                eng.prefill(toks)
        with pytest.raises(htp.ExecutorDiedError, match="died 3 times in a row"):
            eng.prefill(toks)
        assert len(killed) == 3


def test_restart_count_resets_after_a_completed_pass(packed):
    """Executor deaths separated by completed passes never exhaust the restarts."""
    toks = _prompts(1)[0]
    with estream.load(packed, backend="host-process", **STREAM) as eng:
        want = eng.prefill(toks).logits
        _kill_executor_in_pass(eng, {0, 2, 4, 6})
        for _ in range(4):
            with pytest.raises(htp.ExecutorDiedError):
                eng.prefill(toks)
            np.testing.assert_array_equal(eng.prefill(toks).logits, want)


def test_jsonl_batch_survives_an_executor_death(packed, tmp_path, capsys, monkeypatch):
    """`estream score --input x.jsonl --backend host-process`, one request a pass: the
    executor dies in the third request's pass; that line is an error line naming the
    executor's death, every other line equals the host backend's answer, the exit status is
    non-zero, and the dead executor was replaced (every later line answered)."""
    import estream.engine as engine_mod

    reqs = [{"id": i, "context": f"line {i} says", "choices": ["yes", "no"]} for i in range(6)]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    args = ["score", str(packed), "--input", str(f), "-G", "1", "-Q", "1", "-B", "3"]
    args += ["--batch-tokens", "1"]  # a request longer than that runs alone: one a pass
    assert main([*args, "--backend", "host"]) == 0
    want = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    orig_init = engine_mod.Engine.__init__
    killed: list[list[int]] = []

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        killed.append(_kill_executor_in_pass(self, {2}))

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    rc = main([*args, "--backend", "host-process"])
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc != 0 and len(killed) == 1 and len(killed[0]) == 1
    assert [d["id"] for d in out] == [r["id"] for r in reqs]
    for i, (d, w) in enumerate(zip(out, want, strict=True)):
        if i == 2:
            assert "executor process" in d["error"] and "killed by signal 9" in d["error"]
            continue
        np.testing.assert_allclose(
            [c["logprob"] for c in d["choices"]], [c["logprob"] for c in w["choices"]],
            rtol=1e-6,
        )  # fmt: skip
