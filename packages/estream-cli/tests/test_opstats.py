"""The per-op table (`EngineOptions(op_stats=True)`, `estream prefill --op-stats`): its times add
up to the pass, its work counts are the hand-computed ones, and counting changes no logit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from estream import load
from estream.opstats import add_peaks, attention_macs, format_table, op_table
from estream_cli.main import main
from estream_layout import pack_model, synth_model
from estream_layout.synth import ARCHES

#: The share of a pass its timed ops must cover on a tiny model (the rest, "untimed", is the
#: Python between the ops; a few % in practice, the best of three passes is checked).
MIN_TIMED_SHARE = 0.8


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Every architecture's estream-synth "tiny" preset, packed."""
    d = tmp_path_factory.mktemp("opstats")
    out = {}
    for arch in ARCHES:
        synth_model(arch, "tiny", d / f"{arch}.gguf", seed=3)
        pack_model(d / f"{arch}.gguf", d / f"{arch}.estream", progress=False)
        out[arch] = d / f"{arch}.estream"
    return out


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("mode", ["stream", "resident"])
def test_op_times_add_up_to_the_pass(tiny_models, arch, mode) -> None:
    """Each architecture, streamed and resident: the rows of the per-op table add up to the
    pass's measured time (``untimed`` closes the gap), the timed ops cover at least
    `MIN_TIMED_SHARE` of it, the per-layer times add up to each row's, and the routed-expert
    phase (compute plus read waits) is exactly the time of its spans."""
    kw = {"G": 2, "Q": 2, "B": 2} if mode == "stream" else {}
    with load(tiny_models[arch], mode=mode, op_stats=True, n_threads=2, **kw) as eng:
        toks = np.random.default_rng(1).integers(0, eng.hp.n_vocab, size=128)
        eng.prefill(toks)  # warm-up
        results = [eng.prefill(toks) for _ in range(3)]
    timed = []
    for res in results:
        t = res.metrics["op_table"]
        ttft = res.metrics["ttft_s"]
        assert t["total_s"] == ttft
        rows = {r["op"]: r for r in t["rows"]}
        assert sum(r["time_s"] for r in t["rows"]) == pytest.approx(ttft, rel=1e-9)
        assert sum(r["share"] for r in t["rows"]) == pytest.approx(1.0, rel=1e-9)
        for op, per_layer in t["per_layer_s"].items():
            assert len(per_layer) == eng.hp.n_layers + 1
            assert sum(per_layer) == pytest.approx(rows[op]["time_s"], rel=1e-9, abs=1e-12)
        phase = res.metrics["op_time_s"]["experts"]
        assert rows["experts"]["time_s"] + rows["expert_wait"]["time_s"] == pytest.approx(phase)
        for op in ("attention", "experts", "router", "norm", "output_head"):
            assert rows[op]["time_s"] > 0, op
        timed.append(1.0 - rows["untimed"]["share"])
    assert max(timed) >= MIN_TIMED_SHARE, timed


def test_work_counts_are_the_hand_computed_ones(tiny_models) -> None:
    """OLMoE "tiny" (2 layers, d 64, 4 heads of 16, 4 KV heads, 8 experts of width 64, top-2,
    vocabulary 301), one 40-token prompt: the multiply-adds of every op kind, counted by hand
    from those numbers, times 2; q8 GEMMs and experts in int8, attention and router in fp32."""
    T, L, d, H, Hkv, hd, E, k, f, V = 40, 2, 64, 4, 4, 16, 8, 2, 64, 301
    want = {
        "attn_qkv": L * T * d * (H * hd + 2 * Hkv * hd),
        "attn_out": L * T * (H * hd) * d,
        "attention": L * H * (hd + hd) * (T * (T + 1) // 2),
        "router": L * T * d * E,
        "experts": L * T * k * 3 * d * f,
        "output_head": 1 * V * d,  # the last position's logits only
    }
    with load(tiny_models["olmoe"], mode="resident", op_stats=True, attention="f32") as eng:
        res = eng.prefill(np.arange(T) % eng.hp.n_vocab)
    rows = {r["op"]: r for r in res.metrics["op_table"]["rows"]}
    for op, macs in want.items():
        assert rows[op]["gop"] * 1e9 == pytest.approx(2 * macs, rel=1e-9), op
    precision = {op: rows[op]["precision"] for op in want}
    assert precision == {
        "attn_qkv": "int8", "attn_out": "int8", "output_head": "int8", "experts": "int8",
        "attention": "fp32", "router": "fp32",
    }  # fmt: skip
    for op in ("norm", "rope", "expert_wait", "untimed"):
        assert rows[op]["gop"] is None and rows[op]["gops"] is None, op
    for op in want:
        assert rows[op]["gops"] == pytest.approx(rows[op]["gop"] / rows[op]["time_s"])


def test_work_counts_of_a_hybrid_model_are_the_hand_computed_ones(tiny_models) -> None:
    """LFM2-MoE "tiny" (4 layers, d 64: short convolutions of 3 taps in layers 0 and 2,
    attention of 4 heads of 16 with 2 KV heads in 1 and 3; a dense SwiGLU of width 96 in
    layer 0, 8 experts of width 64, top-2, in 1-3), one 40-token prompt: every op kind's
    multiply-adds by hand, times 2."""
    T, d, H, Hkv, hd, ff, E, k, f, V, taps = 40, 64, 4, 2, 16, 96, 8, 2, 64, 301, 3
    want = {
        "conv_in": 2 * T * d * 3 * d,
        "conv_out": 2 * T * d * d,
        "short_conv": 2 * T * d * taps,
        "attn_qkv": 2 * T * d * (H * hd + 2 * Hkv * hd),
        "attention": 2 * H * (hd + hd) * (T * (T + 1) // 2),
        "attn_out": 2 * T * (H * hd) * d,
        "ffn": 1 * T * 3 * d * ff,
        "router": 3 * T * d * E,
        "experts": 3 * T * k * 3 * d * f,
        "output_head": V * d,
    }
    with load(tiny_models["lfm2moe"], mode="resident", op_stats=True) as eng:
        res = eng.prefill(np.arange(T) % eng.hp.n_vocab)
    rows = {r["op"]: r for r in res.metrics["op_table"]["rows"]}
    for op, macs in want.items():
        assert rows[op]["gop"] * 1e9 == pytest.approx(2 * macs, rel=1e-9), op


def _brute_attention_keys(segments, window):
    keys = 0
    for ctx, n in segments:
        for i in range(n):
            seen = ctx + i + 1
            keys += min(seen, window) if window > 0 else seen
    return keys


@pytest.mark.parametrize(
    "segments,window",
    [([(0, 1)], 0), ([(0, 37)], 0), ([(0, 37)], 5), ([(0, 10), (10, 7), (25, 3)], 0),
     ([(0, 10), (10, 7), (25, 3)], 12), ([(30, 4)], 8), ([(3, 9)], 40)],
)  # fmt: skip
def test_attention_work_counts_each_visible_key(segments, window) -> None:
    """`attention_macs` is the number of (query, visible key) pairs, counted one by one (a
    query of a segment with ``ctx`` rows of context sees ``ctx + i + 1`` keys, at most
    ``window``), times ``n_head · (d_k + d_v)``."""
    got = attention_macs(segments, 3, 24, 16, window)
    assert got == _brute_attention_keys(segments, window) * 3 * (24 + 16)


def test_branch_pass_counts_attention_over_the_prefix(tiny_models) -> None:
    """A prefix with two branches: each branch's queries also see the prefix rows, so the
    attention work is the prefix's causal count plus each branch's ``n · P + n (n + 1) / 2``."""
    P, n1, n2 = 20, 6, 9
    with load(tiny_models["olmoe"], mode="resident", op_stats=True) as eng:
        res = eng.prefill_branches(np.arange(P), [np.arange(n1), np.arange(n2)])
        L, H, hd = eng.hp.n_layers, eng.hp.n_head, eng.hp.head_dim_k
    rows = {r["op"]: r for r in res.metrics["op_table"]["rows"]}
    pairs = P * (P + 1) // 2 + sum(n * P + n * (n + 1) // 2 for n in (n1, n2))
    assert rows["attention"]["gop"] * 1e9 == pytest.approx(2 * L * H * (hd + hd) * pairs, rel=1e-9)


@pytest.mark.parametrize("arch", ["olmoe", "deepseek2", "lfm2moe", "gpt-oss"])
def test_counting_work_changes_no_logit(tiny_models, arch) -> None:
    """The same prompt with the per-op table off and on: bit-identical logits (all
    positions); off, the metrics have no ``op_table``."""
    toks = np.random.default_rng(5).integers(0, 300, size=33)
    out = {}
    for on in (False, True):
        with load(tiny_models[arch], G=2, Q=2, B=2, op_stats=on) as eng:
            res = eng.prefill(toks, all_logits=True)
        out[on] = res
    assert "op_table" not in out[False].metrics and "op_table" in out[True].metrics
    assert np.array_equal(out[False].logits, out[True].logits)


def _table():
    spans = [("attention", 0, 0.0, 0.25), ("experts", 0, 0.25, 0.75), ("norm", -1, 0.75, 0.8)]
    work = [("attention", 0, "fp32", 5 * 10**8), ("experts", 0, "int8", 4 * 10**9)]

    class Rec:
        layer, t_wait, t_start = 0, 0.3, 0.35

    return op_table(total_s=1.0, n_layers=1, op_spans=spans, op_work=work, records=[Rec()])


def test_table_splits_expert_waits_and_shares_peaks() -> None:
    """A hand-made pass: the expert phase's read wait (50 ms) is its own row, the rest is
    expert compute; rates are work over time and ``add_peaks`` divides each by the peak of
    its precision; ``untimed`` is the 200 ms no op covers."""
    t = add_peaks(_table(), {"int8": 20.0, "fp32": 8.0, "bf16": None})
    rows = {r["op"]: r for r in t["rows"]}
    assert rows["expert_wait"]["time_s"] == pytest.approx(0.05)
    assert rows["experts"]["time_s"] == pytest.approx(0.45)
    assert rows["experts"]["gops"] == pytest.approx(4 / 0.45)
    assert rows["experts"]["pct_of_peak"] == pytest.approx(100 * 4 / 0.45 / 20)
    assert rows["attention"]["pct_of_peak"] == pytest.approx(100 * 2 / 8)
    assert rows["norm"]["pct_of_peak"] is None
    assert rows["untimed"]["time_s"] == pytest.approx(0.2)
    assert t["per_layer_s"]["norm"] == [0.0, pytest.approx(0.05)]
    text = "\n".join(format_table(t))
    assert "of peak" in text and "44.4%" in text and "25.0%" in text


def test_an_op_of_two_precisions_reads_each_against_its_peak() -> None:
    """bf16-pv attention counts its scores in fp32 and its weighted sum in bf16: the row is
    "bf16+fp32" with its work per precision, and its share of peak is the time that work
    takes at each peak over the time it took; without one of the peaks there is no share."""
    spans = [("attention", 0, 0.0, 0.5), ("attention", 1, 0.5, 1.0)]
    work = [("attention", 0, "fp32", 2 * 10**9), ("attention", 0, "bf16", 3 * 10**9),
            ("attention", 1, "fp32", 2 * 10**9), ("attention", 1, "bf16", 3 * 10**9)]  # fmt: skip
    table = op_table(total_s=1.0, n_layers=2, op_spans=spans, op_work=work)
    row = add_peaks(table, {"fp32": 8.0, "bf16": 20.0, "int8": 40.0})["rows"][0]
    assert row["precision"] == "bf16+fp32" and row["gop"] == pytest.approx(10.0)
    assert row["gop_by_precision"] == {"bf16": pytest.approx(6.0), "fp32": pytest.approx(4.0)}
    assert row["pct_of_peak"] == pytest.approx(100 * (4 / 8 + 6 / 20) / 1.0)
    assert add_peaks(table, {"fp32": 8.0, "bf16": None})["rows"][0]["pct_of_peak"] is None
    one = op_table(total_s=1.0, n_layers=1, op_spans=spans[:1], op_work=work[:1])
    assert "gop_by_precision" not in one["rows"][0]


def test_prefill_op_stats_prints_the_table(tiny_models, capsys, tmp_path) -> None:
    """``estream prefill --op-stats`` prints a row per op kind and each rate's share of the
    CPU's measured peak for its precision; with ``--json`` the table is ``metrics.op_table``
    (with the peaks it was read against); a ``--trace`` file carries it in its metadata; on
    the host-process backend, whose CPU the command cannot time, the table has no peaks."""
    m = str(tiny_models["olmoe"])
    assert main(["prefill", m, "--tokens", "1,2,3,4,5", "--op-stats", "-G", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-op table" in out and "of peak" in out
    for op in ("attn_qkv", "attention", "experts", "expert_wait", "untimed", "total"):
        assert any(line.split()[:1] == [op] for line in out.splitlines()), op
    assert main(["prefill", m, "--tokens", "1,2,3", "--op-stats", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["metrics"]["op_table"]
    assert {r["op"] for r in table["rows"]} >= {"attention", "experts"}
    peaks = table["peaks_gops"]
    assert peaks["int8"] > 0 and peaks["fp32"] > 0
    read = 0
    for r in table["rows"]:
        peak = peaks.get(r["precision"]) if r["precision"] else None
        if peak and r["gops"] is not None:
            assert r["pct_of_peak"] == pytest.approx(100 * r["gops"] / peak), r["op"]
            read += 1
        else:
            assert r["pct_of_peak"] is None, r["op"]
    assert read >= 3  # experts, attention, the q/k/v GEMMs at least
    args = ["prefill", m, "--tokens", "1,2,3", "--op-stats", "--json", "--backend", "host-process"]
    assert main(args) == 0
    assert "peaks_gops" not in json.loads(capsys.readouterr().out)["metrics"]["op_table"]
    trace = tmp_path / "t.json"
    assert main(["prefill", m, "--tokens", "1,2,3", "--trace", str(trace)]) == 0
    capsys.readouterr()
    meta = json.loads(trace.read_text())["otherData"]
    assert meta["op_table"]["total_s"] == meta["ttft_s"]
    assert main(["prefill", m, "--tokens", "1,2,3", "--json"]) == 0
    assert "op_table" not in json.loads(capsys.readouterr().out)["metrics"]


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_f16_bf16_dense_matrices_are_counted_as_fp32_products(tmp_path, dtype) -> None:
    """OLMoE "tiny" with F16 / BF16 dense matrices (packed as f16-t32r4 / bf16-t32r4) under
    int8 activations: their GEMMs (q/k/v, output projection, output head) are fp32 products,
    the Q4_0 experts stay int8; the logits are finite."""
    src = synth_model("olmoe", "tiny", tmp_path / "m.gguf", dense_type=dtype, output_type=dtype)
    dst = tmp_path / "m.estream"
    pack_model(src, dst, progress=False)
    with load(dst, mode="resident", act="q8", op_stats=True) as eng:
        res = eng.prefill(np.arange(40) % eng.hp.n_vocab, all_logits=True)
    assert np.isfinite(res.logits).all()
    rows = {r["op"]: r for r in res.metrics["op_table"]["rows"]}
    precision = {op: rows[op]["precision"] for op in ("attn_qkv", "attn_out", "output_head")}
    assert precision == {"attn_qkv": "fp32", "attn_out": "fp32", "output_head": "fp32"}
    assert rows["experts"]["precision"] == "int8"
