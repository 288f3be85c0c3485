"""`Ops`: projections sharing an input in one kernel op, and the per-op spans a prefill reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

import estream_htp as htp
from estream.engine import load
from estream.models.ops import Ops
from estream.packed import DenseTensor
from estream_cli.main import main
from estream_layout import pack_model, synth_model


def _dense(rng: np.random.Generator, fmt: str, n: int, k: int) -> DenseTensor:
    w = rng.standard_normal((n, k)).astype(np.float32)
    data = {
        "q4_0-t32r4": htp.pack_q4_0_t32r4,
        "q8_0-t32r4": htp.pack_q8_0_t32r4,
        "f32": lambda a: a.view(np.uint8).reshape(-1),
    }[fmt](w)
    return DenseTensor(f"w{n}", fmt, (n, k), data)


@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize(
    "fmts",
    [
        ("q4_0-t32r4", "q4_0-t32r4", "q4_0-t32r4"),
        ("q8_0-t32r4", "q8_0-t32r4"),
        ("q4_0-t32r4", "f32", "q4_0-t32r4"),  # the f32 one alone, the other two shared
        ("q4_0-t32r4", "q8_0-t32r4"),  # formats differ: one op each
    ],
)
def test_matmuls_equal_one_matmul_each_and_share_one_span(act: str, fmts) -> None:
    rng = np.random.default_rng(len(fmts))
    k, t = 96, 21
    ws = [_dense(rng, f, n, k) for f, n in zip(fmts, (64, 40, 33), strict=False)]
    x = rng.standard_normal((t, k)).astype(np.float32)
    with htp.Backend("host", n_threads=2, act=act) as be:
        ops = Ops(None, None, backend=be)  # type: ignore[arg-type]  # no spec/experts needed
        alone = [ops.matmul(x, w, "one") for w in ws]
        ops.op_spans.clear()
        got = ops.matmuls(x, ws, "shared")
    for a, g, w in zip(alone, got, ws, strict=True):
        assert g.shape == (t, w.shape[0])
        assert np.array_equal(a, g)
    tiled = [w.fmt for w in ws if w.fmt != "f32"]
    one_op = len(tiled) >= 2 and len(set(tiled)) == 1
    expected = 1 + (len(ws) - len(tiled)) if one_op else len(ws)
    assert [s[0] for s in ops.op_spans] == ["shared"] * expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=2)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def test_prefill_reports_time_by_op_and_traces_every_call(tiny, tmp_path, capsys) -> None:
    toks = np.random.default_rng(0).integers(0, 100, size=23)
    with load(tiny, G=2, Q=2, B=2) as eng:
        res = eng.prefill(toks)
        n_layers = eng.hp.n_layers
    op = res.metrics["op_time_s"]
    for name in ("attn_qkv", "attention", "attn_out", "experts", "router", "norm", "rope"):
        assert op[name] > 0, name
    assert not {"attn_q", "attn_k", "attn_v"} & set(op)  # q/k/v are one op
    assert sum(op.values()) <= res.metrics["ttft_s"] * 1.001
    trace = tmp_path / "t.json"
    ids = ",".join(str(int(t)) for t in toks)
    assert main(["prefill", str(tiny), "--tokens", ids, "--trace", str(trace), "-G", "2"]) == 0
    capsys.readouterr()
    events = json.loads(trace.read_text())["traceEvents"]
    qkv = [e for e in events if e.get("name", "").startswith("attn_qkv")]
    assert len(qkv) == n_layers  # one shared projection op per layer
