"""The engine with its expert ops on the ``hexagon`` backend: the library compiled for Hexagon
(v67 + HVX) runs as the executor process under qemu-hexagon-static and maps the very memfds the
host's loader fills (stream mode: the arena's planes; resident mode: the shared expert pool) —
no copy of an expert crosses the process boundary. With ``dense_ops="backend"`` (the default on
this backend) every matrix product and kernel op of the forward pass runs there too (GEMMs, the
router's f32 matmul, norms, RoPE, attention, convolution, SwiGLU, router top-k, embedding rows),
the dense weights registered once as shared buffers; element-wise numpy glue (residual adds,
gates) stays on the host.

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
from estream_layout import pack_model, synth_model

_TOOLS = _hexagon.missing_tools()  # qemu, and the compiler when the executor must be built
_REQUIRED = os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() == "1"
pytestmark = pytest.mark.skipif(
    bool(_TOOLS) and not _REQUIRED,
    reason=f"hexagon backend: {', '.join(_TOOLS)} not installed "
    "(apt-get install clang-19 lld-19 qemu-user-static)",
)
FULL = os.environ.get("ESTREAM_HEXAGON_FULL", "").strip() == "1"
ARCHS = ["olmoe", "qwen3moe", "mixtral", "deepseek2", "lfm2moe"] if FULL else ["olmoe"]
MODES = (
    [
        {"mode": "resident"},
        {"mode": "stream", "G": 2, "Q": 2, "B": 4},
        {"mode": "stream", "G": 1, "Q": 1, "B": 2, "dense_ops": "host"},
    ]
    if FULL
    else [{"mode": "stream", "G": 2, "Q": 2, "B": 3}]
)


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
