"""Loader bandwidth over G x Q on a cold file, next to ``dd iflag=direct`` and raw sequential
O_DIRECT bandwidth of the same file measured in the same run.

    nox -s bench_arena                      # 2 GB file, G in {1,2,4,8,16}, Q in {1,2,4,8}
    nox -s bench_arena -- --size-gb 0.5     # quicker

Records have OLMoE-1B-7B size: gate/up/down 1,179,648 B each (2048x1024 q4_0-t32r4 tiles), so a
record is 3,538,944 B. The page cache is dropped before every measurement (root: drop_caches;
otherwise posix_fadvise(DONTNEED) on the file, reported). The disk's reference is
``dd if=FILE of=/dev/null iflag=direct bs=…`` at several block sizes (``--dd-blocks``; the best
median is "dd"), and this script's own single-stream ``preadv`` loop ("raw"); every loader
point is reported as a ratio to both. Writes bench-results/bench_arena.json with every point,
the best Q per G, and Q0 (the smallest Q reaching 95% of the peak grouped-read bandwidth, per G
and for all G) for the configurator.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from estream_arena import Arena, GroupLoader, GroupRequest, RecordLayout

PROJ = 1_179_648  # 2048 x 1024 q4_0-t32r4 = (64 * 32 tiles) * 576 B
LAYOUT = RecordLayout.contiguous(PROJ, PROJ, PROJ)
ROOT = Path(__file__).resolve().parents[3]


def fs_type(path: Path) -> str:
    try:
        out = subprocess.run(
            ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_file(path: Path, n_records: int) -> None:
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, LAYOUT.record_bytes * 4, dtype=np.uint8)
    with open(path, "wb") as f:
        for i in range(0, n_records, 4):
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # no two records alike
            n = min(4, n_records - i)
            f.write(memoryview(block)[: n * LAYOUT.record_bytes])
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def raw_direct(path: Path, block: int, threads: int = 1) -> float:
    """Sequential O_DIRECT reads of the whole file in ``block``-byte preadv calls; bytes/s.
    With threads > 1, thread t reads blocks t, t+threads, ... (``threads`` requests in flight)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    n_blocks = -(-size // block)

    def run(t: int) -> None:
        buf = bufs[t]
        for b in range(t, n_blocks, threads):
            os.preadv(fd, [buf], b * block)

    try:
        t0 = time.perf_counter()
        if threads == 1:
            run(0)
        else:
            ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    return size / dt


_DD_COPIED = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.MULTILINE)


def dd_direct(path: Path, block: str) -> float:
    """``dd if=path of=/dev/null iflag=direct bs=block``; bytes/s from dd's own byte count and
    elapsed time (its last line), so process start-up is not counted."""
    cmd = ["dd", f"if={path}", "of=/dev/null", "iflag=direct", f"bs={block}"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"), check=False
    )
    m = _DD_COPIED.search(out.stderr)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    nbytes, seconds = int(m.group(1)), float(m.group(2))
    if nbytes != os.path.getsize(path):
        raise RuntimeError(f"dd read {nbytes} of {os.path.getsize(path)} bytes: {out.stderr}")
    return nbytes / seconds


def loader_bandwidth(
    path: Path, n_records: int, G: int, Q: int, B: int, merge: int = 0, shared: bool = False
) -> dict:
    rb = LAYOUT.record_bytes
    reqs = [
        GroupRequest(k, k * G * rb, min(G, n_records - k * G)) for k in range(-(-n_records // G))
    ]
    with Arena(LAYOUT, B, G, shared=shared) as arena:
        for j in range(3):  # fault the pages in now, not inside the timed reads
            arena.plane_view(j)[:] = 0
        with GroupLoader(arena, path, Q, direct=True, merge_bytes=merge) as ld:
            ld.begin_layer(0)
            t0 = time.perf_counter()
            ld.submit(reqs)
            for r in reqs:
                ld.release(ld.acquire(r.group, timeout=600))
            dt = time.perf_counter() - t0
            ld.end_layer()
            st = ld.stats
        arena_bytes = arena.total_bytes
        huge = arena.huge_page_bytes
    busy = sum(e.t_end - e.t_start for e in st.events)
    return dict(
        G=G,
        Q=Q,
        B=B,
        merge_bytes=merge,
        bytes=st.bytes_read,
        seconds=dt,
        bytes_per_s=st.bytes_read / dt,
        syscalls=st.n_syscalls,
        mean_read_ms=1e3 * busy / len(st.events),
        arena_bytes=arena_bytes,
        arena="shared" if shared else "private",
        huge_page_bytes=huge,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=ROOT / ".cache")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3, help="passes; medians are reported")
    ap.add_argument("--extra-banks", type=int, default=2, help="B = Q + this")
    ap.add_argument(
        "--merge-mib",
        type=float,
        default=16.0,
        help="also measure the loader merging adjacent groups into reads of up to this many MiB "
        "(the engine's READ_MERGE_BYTES), for the G whose group is smaller; 0: only one group "
        "per read",
    )
    ap.add_argument(
        "--dd-blocks",
        default="1M,4M,16M,64M",
        help="dd bs= values (comma-separated) for the dd iflag=direct reference",
    )
    ap.add_argument(
        "--arena",
        choices=("private", "shared", "both"),
        default="private",
        help="arena planes: private (anonymous, huge pages: the host backend's, default), "
        "shared (memfd: an executor process's), or both, interleaved",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "bench_arena.json")
    args = ap.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    fstype = fs_type(args.dir)
    if fstype in ("tmpfs", "ramfs"):
        print(f"warning: {args.dir} is {fstype}: this measures memory, not a disk", file=sys.stderr)
    n_records = max(16, int(args.size_gb * 1e9 // LAYOUT.record_bytes))
    fd, name = tempfile.mkstemp(prefix="bench-arena-", suffix=".bin", dir=args.dir)
    os.close(fd)
    path = Path(name)
    results: dict = {}
    try:
        t0 = time.perf_counter()
        make_file(path, n_records)
        size = path.stat().st_size
        print(
            f"file {path} ({fstype}): {n_records} records x {LAYOUT.record_bytes} B = "
            f"{size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.1f} s"
        )
        methods = set()
        drop_cache(path)
        raw_direct(path, 16 << 20)  # warm-up pass: settles writeback of the fresh file

        raw_cfgs = [(1 << 20, 1), (4 << 20, 1), (16 << 20, 1), (64 << 20, 1), (16 << 20, 4)]
        raw_runs: dict[tuple[int, int], list[float]] = {c: [] for c in raw_cfgs}
        dd_blocks = [b.strip() for b in args.dd_blocks.split(",") if b.strip()]
        dd_runs: dict[str, list[float]] = {b: [] for b in dd_blocks}
        runs: dict[tuple[int, int, int, bool], list[dict]] = {}
        arenas = {"private": [False], "shared": [True], "both": [False, True]}[args.arena]
        merge = int(args.merge_mib * (1 << 20)) // 4096 * 4096
        merges = {
            G: [0] + ([merge] if merge >= 2 * G * LAYOUT.record_bytes else []) for G in args.groups
        }
        for rep in range(args.repeat):  # interleaved: raw and loader see the same disk mood
            print(f"-- pass {rep + 1}/{args.repeat}")
            for block, threads in raw_cfgs:
                methods.add(drop_cache(path))
                bw = raw_direct(path, block, threads)
                raw_runs[block, threads].append(bw)
                print(f"raw O_DIRECT block {block >> 20:2d} MiB x {threads}: {bw / 1e6:8.1f} MB/s")
            for block in dd_blocks:
                methods.add(drop_cache(path))
                bw = dd_direct(path, block)
                dd_runs[block].append(bw)
                print(f"dd iflag=direct bs={block:<4s}:        {bw / 1e6:8.1f} MB/s")
            for G in args.groups:
                for Q in args.depths:
                    for mg in merges[G]:
                        for sh in arenas:
                            methods.add(drop_cache(path))
                            p = loader_bandwidth(
                                path, n_records, G, Q, Q + args.extra_banks, mg, sh
                            )
                            runs.setdefault((G, Q, mg, sh), []).append(p)
                            print(
                                f"G={G:2d} Q={Q} B={p['B']:2d} merge={mg >> 20:2d} MiB "
                                f"{p['arena']:7s}: {p['bytes_per_s'] / 1e6:8.1f} MB/s, "
                                f"{p['mean_read_ms']:.1f} ms/read, {p['syscalls']} preadv, "
                                f"{p['huge_page_bytes'] >> 20} MiB on huge pages"
                            )
        raw = [
            dict(
                block=b,
                threads=t,
                bytes_per_s=float(np.median(v)),
                runs=v,
            )
            for (b, t), v in raw_runs.items()
        ]
        raw_seq = max(r["bytes_per_s"] for r in raw if r["threads"] == 1)
        raw_par = max(r["bytes_per_s"] for r in raw if r["threads"] > 1)
        dd = [dict(bs=b, bytes_per_s=float(np.median(v)), runs=v) for b, v in dd_runs.items()]
        dd_best = max(dd, key=lambda r: r["bytes_per_s"])
        dd_bw = dd_best["bytes_per_s"]
        points = []
        for rs in runs.values():
            p = dict(rs[0])
            p["runs_bytes_per_s"] = [r["bytes_per_s"] for r in rs]
            p["bytes_per_s"] = float(np.median(p["runs_bytes_per_s"]))
            p["seconds"] = float(np.median([r["seconds"] for r in rs]))
            p["ratio_to_raw"] = p["bytes_per_s"] / raw_seq
            p["ratio_to_raw_parallel"] = p["bytes_per_s"] / raw_par
            p["ratio_to_dd"] = p["bytes_per_s"] / dd_bw
            # per pass: the loader against dd's best block in the same pass
            p["runs_ratio_to_dd"] = [
                r["bytes_per_s"] / max(v[i] for v in dd_runs.values()) for i, r in enumerate(rs)
            ]
            points.append(p)

        q0_per_g: dict[int, int] = {}
        best_per_g: dict[int, dict] = {}
        primary = "shared" if arenas == [True] else "private"
        other = [p for p in points if p["arena"] != primary and not p["merge_bytes"]]
        points = [p for p in points if p["arena"] == primary]  # the summary's arena
        merged = [p for p in points if p["merge_bytes"]]
        points = [p for p in points if not p["merge_bytes"]]  # one group per read
        for G in args.groups:
            row = [p for p in points if p["G"] == G]
            peak = max(p["bytes_per_s"] for p in row)
            q0_per_g[G] = min(p["Q"] for p in row if p["bytes_per_s"] >= 0.95 * peak)
            best_per_g[G] = max(row, key=lambda p: p["bytes_per_s"])
        best = max(points, key=lambda p: p["bytes_per_s"])

        # table
        print()
        print(f"medians of {args.repeat} passes, page cache dropped before each")
        print(f"raw sequential O_DIRECT (best block, 1 stream): {raw_seq / 1e6:.1f} MB/s")
        print(f"raw O_DIRECT, 4 streams of 16 MiB blocks:        {raw_par / 1e6:.1f} MB/s")
        print(
            "dd iflag=direct: "
            + ", ".join(f"bs={r['bs']} {r['bytes_per_s'] / 1e6:.1f}" for r in dd)
            + f" MB/s; best bs={dd_best['bs']}: {dd_bw / 1e6:.1f} MB/s"
        )
        print("loader MB/s (ratio to dd iflag=direct, best bs)")
        print("   G | " + " | ".join(f"      Q={q}     " for q in args.depths) + " | Q0")
        for G in args.groups:
            cells = []
            for Q in args.depths:
                p = next(p for p in points if p["G"] == G and p["Q"] == Q)
                cells.append(f"{p['bytes_per_s'] / 1e6:7.1f} ({p['ratio_to_dd']:.2f})")
            print(f"  {G:2d} | " + " | ".join(cells) + f" | {q0_per_g[G]}")
        if merged:
            print(f"merging adjacent groups into reads of up to {merge >> 20} MiB:")
            for G in sorted({p["G"] for p in merged}):
                cells = []
                for Q in args.depths:
                    p = next(p for p in merged if p["G"] == G and p["Q"] == Q)
                    cells.append(f"{p['bytes_per_s'] / 1e6:7.1f} ({p['ratio_to_dd']:.2f})")
                print(f"  {G:2d} | " + " | ".join(cells))
        if other:
            print("shared (memfd) arena, MB/s (ratio to the private arena's, same passes):")
            for G in args.groups:
                cells = []
                for Q in args.depths:
                    p = next(p for p in other if p["G"] == G and p["Q"] == Q)
                    q = next(q for q in points if q["G"] == G and q["Q"] == Q)
                    cells.append(
                        f"{p['bytes_per_s'] / 1e6:7.1f} ({p['bytes_per_s'] / q['bytes_per_s']:.2f})"
                    )
                print(f"  {G:2d} | " + " | ".join(cells))
        print(f"arena: {primary}")
        print(
            f"best: G={best['G']} Q={best['Q']}: {best['bytes_per_s'] / 1e6:.1f} MB/s = "
            f"{best['ratio_to_dd']:.2f} x dd iflag=direct (target >= 0.90), "
            f"{best['ratio_to_raw']:.2f} x raw sequential, "
            f"{best['ratio_to_raw_parallel']:.2f} x raw 4-stream"
        )
        print("best Q per G: " + ", ".join(f"G={g}: Q={p['Q']}" for g, p in best_per_g.items()))
        print(f"Q0 per G: {q0_per_g}; Q0 for all G = {max(q0_per_g.values())}")
        method = "drop_caches" if methods == {"drop_caches"} else "posix_fadvise(DONTNEED)"
        if method != "drop_caches":
            print("note: /proc/sys/vm/drop_caches was not writable; used posix_fadvise DONTNEED")
        results = dict(
            benchmark="bench_arena",
            host=platform.node(),
            kernel=platform.release(),
            cpus=os.cpu_count(),
            filesystem=fstype,
            file_bytes=size,
            record_bytes=LAYOUT.record_bytes,
            projection_bytes=PROJ,
            n_records=n_records,
            cache_drop=method,
            raw=raw,
            raw_sequential_bytes_per_s=raw_seq,
            raw_parallel_bytes_per_s=raw_par,
            dd=dd,
            dd_best_bs=dd_best["bs"],
            dd_bytes_per_s=dd_bw,
            loadavg=os.getloadavg(),
            repeat=args.repeat,
            points=points,
            merged_points=merged,
            arena=primary,
            other_arena_points=other,
            merge_bytes=merge,
            q0_rule="smallest Q with bandwidth >= 0.95 x max over Q, per G",
            q0_per_g={str(g): q for g, q in q0_per_g.items()},
            q0=max(q0_per_g.values()),
            best_per_g={str(g): p for g, p in best_per_g.items()},
            best=best,
            target_ratio=0.90,
            target_met=best["ratio_to_dd"] >= 0.90,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
