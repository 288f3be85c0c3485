"""The engine with its expert ops on the ``hexagon`` backend: the library compiled for Hexagon
(v67 + HVX) runs as the executor process under qemu-hexagon-static and maps the very memfds the
host's loader fills (stream mode: the arena's planes; resident mode: the shared expert pool) —
no copy of an expert crosses the process boundary. With ``dense_ops="backend"`` (the default on
this backend) every op of the forward pass runs there too ("full accelerator": GEMMs, the
router's f32 matmul, norms, RoPE, attention — continuing segments included —, convolution,
SwiGLU, router top-k, embedding rows, residual adds, gates, head assembly copies, zeroing), the
dense weights registered once as shared buffers and every activation allocated in an activation
pool registered with the backend: operands travel by reference, nothing is staged
(`test_every_op_of_the_pass_runs_in_the_dsp`). The trace's "dsp queue" track holds the
executor's start and completion of each op.

Logits match ``--backend host`` within 1e-5 relative (the host's expert op runs its best SIMD
level, the Hexagon one HVX; the int32 dot products are the same, fp32 accumulation orders of
different kernels differ by roundings). ``nox -s tests`` runs one architecture in stream mode;
``ESTREAM_HEXAGON_FULL=1`` (``nox -s hexagon``) runs every architecture in both modes."""

from __future__ import annotations

import os

import numpy as np
import pytest

import estream
from estream_htp import _hexagon
from estream_htp import testing as T
from estream_layout import pack_model, synth_model

_TOOLS = _hexagon.missing_tools()  # qemu, and the compiler when the executor must be built
_REQUIRED = os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() == "1"
pytestmark = pytest.mark.skipif(
    bool(_TOOLS) and not _REQUIRED,
    reason=f"hexagon backend: {', '.join(_TOOLS)} not installed "
    "(apt-get install clang-19 lld-19 qemu-user-static)",
)
FULL = os.environ.get("ESTREAM_HEXAGON_FULL", "").strip() == "1"
ALL_ARCHS = ["olmoe", "qwen3moe", "mixtral", "deepseek2", "lfm2moe", "smallthinker", "gpt-oss"]
ARCHS = ALL_ARCHS if FULL else ["olmoe"]
MODES = (
    [
        {"mode": "resident"},
        {"mode": "stream", "G": 2, "Q": 2, "B": 4},
        {"mode": "stream", "G": 2, "Q": 2, "B": 3, "pin": 48 << 10},
        {"mode": "stream", "G": 1, "Q": 1, "B": 2, "dense_ops": "host"},
    ]
    if FULL
    else [{"mode": "stream", "G": 2, "Q": 2, "B": 3, "pin": 48 << 10}]  # streamed and pinned
)


# seconds a test may take before the run is ended (estream_htp.testing.end_run_after)
HANG_S = 900


@pytest.fixture(autouse=True)
def _hang_guard(request):
    """A test still running after `HANG_S` seconds ends the run, naming the test, with every
    thread's traceback, and kills the executors: a hung Hexagon program fails the suite in
    bounded time."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    cancel = T.end_run_after(HANG_S, request.node.nodeid, capman.global_and_fixture_disabled)
    yield
    cancel()


@pytest.fixture(scope="module", params=ARCHS)
def packed(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"hexagon-{arch}")
    synth_model(arch, "tiny", d / f"{arch}.gguf", seed=11)
    pack_model(d / f"{arch}.gguf", d / f"{arch}.estream", progress=False)
    return d / f"{arch}.estream"


def _mapped_memfds(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if "/memfd:" in line}


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_prefill_on_hexagon_matches_host(packed, kw, monkeypatch):
    import estream_htp._core as core

    toks = np.random.default_rng(4).integers(0, 64, size=37)
    kw = dict(kw)
    dense = kw.pop("dense_ops", "backend")
    # fp32 attention on both sides: the default, auto, resolves by the backend running the dense
    # ops (bf16 where this CPU has it natively, fp32 on the DSP)
    kw["attention"] = "f32"
    with estream.load(packed, backend="host", **kw) as eng:
        ref = eng.prefill(toks, all_logits=True).logits
    with estream.load(packed, backend="hexagon", dense_ops=dense, **kw) as eng:
        assert eng.backend.kind == "hexagon" and eng.backend.simd == "hvx"
        host_ops = []
        be = core._be

        def spy(backend):  # an op given no backend would run on this process's default one
            if backend is None:
                host_ops.append(1)
            return be(backend)

        monkeypatch.setattr(core, "_be", spy)
        pid = eng.backend.pid
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"qemu-hexagon" in f.read().split(b"\0")[0]
        res = eng.prefill(toks, all_logits=True)
        monkeypatch.undo()
        assert res.metrics["backend"] == "hexagon" and res.metrics["dense_ops"] == dense
        assert (len(host_ops) == 0) == (dense == "backend"), len(host_ops)
        maps = _mapped_memfds(pid)
        if eng.config is not None:  # the executor maps the arena's own planes
            eng.experts.loader.check_valid()
            assert eng.experts.loader._res.n_available == eng.config.B
            arena = eng.experts.arena
            ours = {os.readlink(f"/proc/self/fd/{arena.fd(j)}") for j in range(3)}
            assert ours and ours <= maps, (ours, maps)
        else:  # the resident pool lives in shared memory the executor maps
            assert any("estream-htp-shared" in m for m in maps)
    got = res.logits
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.fixture(scope="module", params=ALL_ARCHS)
def any_arch(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"hexagon-all-{arch}")
    synth_model(arch, "tiny", d / f"{arch}.gguf", seed=13)
    pack_model(d / f"{arch}.gguf", d / f"{arch}.estream", progress=False)
    return d / f"{arch}.estream"


# every kernel entry point the forward pass and the expert sources call
_OPS = [
    "gemm", "gemm_shared", "matmul_f32", "rms_norm", "rms_norm_heads", "rope", "attention",
    "swiglu", "router_topk", "conv1d_causal", "get_rows", "add", "mul", "copy_rows", "fill",
    "quantize_q8",
]  # fmt: skip


def _operands(args, kwargs):
    for a in (*args, *kwargs.values()):
        for x in a if isinstance(a, tuple) else (a,):
            if isinstance(x, np.ndarray):
                yield x
            elif type(x).__name__ == "Q8Rows":  # a layer input quantized once for its groups
                yield x.data


@pytest.mark.parametrize("mode", ["resident", "stream"])
def test_every_op_of_the_pass_runs_in_the_dsp(any_arch, mode, monkeypatch):
    """Full accelerator: during a hexagon prefill every kernel call gets operands that all lie
    in memory registered with the executor (activations in the pool, weights shared, route
    arrays in shared buffers) — an activation computed with numpy on the host would be a
    private array and fail here —, no byte is staged, no op runs on the host's default
    backend, and the executor reports a start and completion for every op submitted."""
    import estream_htp as htp
    import estream_htp._core as core

    kw = {"mode": "resident"} if mode == "resident" else {"mode": "stream", "G": 2, "Q": 2, "B": 3}
    toks = np.random.default_rng(2).integers(0, 64, size=29)
    with estream.load(any_arch, backend="hexagon", **kw) as eng:
        be = eng.backend
        eng.prefill(toks[:3])  # weights are shared on first use
        outside: list[str] = []
        calls: list[str] = []
        host_ops: list[str] = []

        def check(name, args, kwargs):
            calls.append(name)
            for x in _operands(args, kwargs):
                if not x.size:
                    continue
                addr = x.__array_interface__["data"][0]
                if be._resolve(addr, x.itemsize) is None:
                    outside.append(f"{name}: {x.shape} {x.dtype}")

        for name in _OPS:
            fn = getattr(htp, name)

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                if kwargs.get("backend") is None:
                    host_ops.append(_name)
                check(_name, args, kwargs)
                return _fn(*args, **kwargs)

            monkeypatch.setattr(htp, name, wrapped)
        for meth in ("run", "submit"):
            orig = getattr(core.ExpertGraph, meth)

            def gwrapped(self, *args, _orig=orig, _name=meth, **kwargs):
                check(f"ExpertGraph.{_name}", args, kwargs)
                return _orig(self, *args, **kwargs)

            monkeypatch.setattr(core.ExpertGraph, meth, gwrapped)
        res = eng.prefill(toks, all_logits=True)
        monkeypatch.undo()
        st = be.stats()
    assert not outside, outside
    assert not host_ops, host_ops
    m = res.metrics
    assert st["staged_bytes"] == 0 and m["backend_staged_bytes"] == 0
    assert st["ops_submitted"] == st["ops_completed"] == m["backend_ops_submitted"]
    # every kernel call is one descriptor (the expert ops: one per call or routed group)
    assert st["ops_submitted"] >= len(calls) > 0
    assert np.isfinite(res.logits).all()


@pytest.mark.parametrize("mode", ["resident", "stream"])
def test_branches_and_batches_on_hexagon_match_host(any_arch, mode):
    kw = {"mode": "resident"} if mode == "resident" else {"mode": "stream", "G": 2, "Q": 2, "B": 3}
    kw["attention"] = "f32"  # (as above: the same attention on both backends)
    rng = np.random.default_rng(6)
    prefix = rng.integers(0, 64, 9)
    branches = [rng.integers(0, 64, n) for n in (1, 5, 3)]
    plain = [rng.integers(0, 64, n) for n in (7, 2)]
    reqs = [plain[0], estream.BranchRequest(prefix, branches), plain[1]]
    got = {}
    for backend in ("host", "hexagon"):
        with estream.load(any_arch, backend=backend, **kw) as eng:
            br = eng.prefill_branches(prefix, branches)
            batch = eng.prefill_batch(reqs, all_logits=True)
            got[backend] = (
                [br.prefix_logits, *br.branch_logits]
                + [r.logits if hasattr(r, "logits") else r.prefix_logits for r in batch]
                + list(batch[1].branch_logits)
            )
    for a, b in zip(got["host"], got["hexagon"], strict=True):
        assert np.isfinite(b).all()
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)


@pytest.mark.parametrize("kind", ["hexagon", "host-process"])
def test_trace_has_the_dsp_queue_beside_the_reads(packed, kind, tmp_path, capsys):
    """``estream prefill --trace``: one "dsp queue" event per op submitted (its name, started
    and completed by the executor, submitted by the host before), beside the loader's reads."""
    import json

    from estream_cli.main import main

    trace = tmp_path / "t.json"
    rc = main([
        "prefill", str(packed), "--tokens", "3,1,4,1,5,9,2,6", "--backend", kind,
        "--dense-ops", "backend", "-G", "2", "-Q", "2", "-B", "3", "--trace", str(trace), "--json",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    m = json.loads(out)["metrics"]
    doc = json.loads(trace.read_text())
    tids = {
        e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e.get("name") == "thread_name"
    }
    evs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    dsp = sorted((e for e in evs if e["tid"] == tids["dsp queue"]), key=lambda e: e["args"]["seq"])
    wait = [e for e in evs if e["tid"] == tids["dsp queue (waiting)"]]
    assert len(dsp) == len(wait) == m["backend_ops_submitted"] > 0
    names = [e["name"] for e in dsp]
    assert {"gemm", "attention", "add", "router_topk", "fill", "get_rows"} <= set(names)
    assert any(n.startswith("ExpertGraph") for n in names)
    for e in dsp:
        sub_us = e["args"]["submitted_s"] * 1e6
        assert sub_us <= e["ts"] + 1e-3 and e["dur"] >= 0  # submitted <= started <= completed
    starts = [e["ts"] for e in dsp]
    assert starts == sorted(starts)  # one queue, run in order
    assert any(e["name"].startswith("read L") for e in evs)  # the loader's reads beside it
