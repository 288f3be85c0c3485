"""The host side of the protocol with the Hexagon executor: empty-op round trips (C call and
Python ``htp.nop``) for ``host``, ``host-process`` and ``hexagon`` in interleaved rounds (all
three see the same machine load), and the time to start each backend. One thread on each side.
Writes ``bench-results/bench_hexagon.json``. Kernel times under emulation say nothing about a
DSP and are not measured here (see tools/hexagon_packets.py for the HVX kernel's packets)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import estream_htp as htp
from estream_htp._ffi import ffi, lib

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("host", "host-process", "hexagon")


def main() -> None:
    out: dict = {"load_average_start": os.getloadavg()}
    start = {}
    for kind in KINDS:  # warm: the hexagon executor may be built on first use
        htp.Backend(kind, n_threads=1).close()
    backends = {}
    for kind in KINDS:
        t0 = time.perf_counter()
        backends[kind] = htp.Backend(kind, n_threads=1)
        htp.nop(backend=backends[kind])
        start[kind] = time.perf_counter() - t0
    d = ffi.new("htp_op_desc *")
    lat: dict[str, list[float]] = {f"{w}_{k}": [] for w in ("c", "py") for k in KINDS}
    try:
        for _ in range(10):
            for kind, be in backends.items():
                for _ in range(200):
                    t0 = time.perf_counter()
                    lib.htp_op_run(be._b, d)
                    lat[f"c_{kind}"].append(time.perf_counter() - t0)
                for _ in range(200):
                    t0 = time.perf_counter()
                    htp.nop(backend=be)
                    lat[f"py_{kind}"].append(time.perf_counter() - t0)
    finally:
        for be in backends.values():
            be.close()
    print(f"{'empty op round trip, us':34s} {'median':>8s} {'p10':>8s} {'p90':>8s}")
    for key, v in lat.items():
        a = np.array(v) * 1e6
        out[key] = {"median_us": float(np.median(a)), "p10_us": float(np.percentile(a, 10)),
                    "p90_us": float(np.percentile(a, 90))}  # fmt: skip
        print(
            f"{key:34s} {out[key]['median_us']:8.1f} {out[key]['p10_us']:8.1f} {out[key]['p90_us']:8.1f}"
        )
    out["start_s"] = start
    for kind, s in start.items():
        print(f"start {kind:28s} {s * 1e3:8.1f} ms")
    out["load_average_end"] = os.getloadavg()
    print(f"load average {out['load_average_start'][0]:.1f} -> {out['load_average_end'][0]:.1f}")
    path = ROOT / "bench-results" / "bench_hexagon.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
