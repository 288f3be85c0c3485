"""Chrome trace-event JSON: structure that Perfetto / chrome://tracing accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estream_sched import (
    TraceEvent,
    chrome_trace,
    pipeline_schedule,
    schedule_events,
    simulate_layers,
    write_chrome_trace,
)


def check_trace(doc: dict) -> None:
    assert set(doc) == {"traceEvents", "displayTimeUnit"}
    assert doc["displayTimeUnit"] in ("ms", "ns")
    names: dict[tuple[int, int], str] = {}
    procs: dict[int, str] = {}
    for ev in doc["traceEvents"]:
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int)
        assert isinstance(ev["tid"], int)
        if ev["ph"] == "M":
            if ev["name"] == "thread_name":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            elif ev["name"] == "process_name":
                procs[ev["pid"]] = ev["args"]["name"]
            else:
                assert ev["name"] == "thread_sort_index"
        else:
            assert ev["ph"] == "X"
            assert isinstance(ev["ts"], float) and isinstance(ev["dur"], float)
            assert ev["dur"] >= 0 and ev["ts"] >= 0
            assert isinstance(ev["cat"], str)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            assert (ev["pid"], ev["tid"]) in names and ev["pid"] in procs
    json.loads(json.dumps(doc))  # plain JSON values only


def test_schedule_trace(tmp_path: Path) -> None:
    s = pipeline_schedule([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0, 2, 2)
    evs = schedule_events(s, q=2, layer=3)
    doc = chrome_trace(evs)
    check_trace(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 1 + 2 * 3
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"exec", "read[0]", "read[1]"}
    read1 = next(e for e in xs if e["name"] == "L3 read g1")
    assert read1["ts"] == 0.0 and read1["dur"] == 2e6
    path = tmp_path / "t.json"
    write_chrome_trace(path, evs)
    check_trace(json.loads(path.read_text()))


def test_measured_events_as_mappings_and_multiple_processes() -> None:
    evs = [
        {"name": "read", "track": "io", "start_s": 0.0, "end_s": 0.002, "process": "measured"},
        TraceEvent("attn", "npu", 0.0, 0.001, "non-expert", "measured", {"layer": 0}),
        TraceEvent("attn", "npu", 0.0, 0.001, process="predicted"),
    ]
    doc = chrome_trace(evs)
    check_trace(doc)
    pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert len(pids) == 2


def test_request_trace_from_simulator() -> None:
    layer = ([1.0, 2.0], [1.0, 0.5], 0.25)
    res = simulate_layers([layer, layer], 2, 3)
    evs = [e for i, s in enumerate(res.layers) for e in schedule_events(s, q=2, layer=i)]
    check_trace(chrome_trace(evs))


def test_bad_event() -> None:
    with pytest.raises(ValueError, match="ends"):
        TraceEvent("x", "t", 2.0, 1.0)
    with pytest.raises(ValueError, match="single-candidate"):
        schedule_events(pipeline_schedule([[1.0]], [[1.0]], 0.0, 1, 1))


def test_plot_frontier_writes_png_or_names_the_extra(tmp_path: Path) -> None:
    import estream_sched as es

    p = es.synthetic_profile(es.SyntheticSpec(n_experts=16, n_layers=2, groups=(1, 2, 4)))
    choices = [es.configure(p, m) for m in (900 * 2**20, 1000 * 2**20)]
    out = tmp_path / "f.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"estream-sched\[plot\]"):
            es.plot_frontier(choices[0].table, out, chosen=choices)
        return
    es.plot_frontier(choices[0].table, out, chosen=choices[0], budget=950 * 2**20)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
