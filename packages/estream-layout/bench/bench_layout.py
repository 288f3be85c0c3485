"""Packing throughput and peak RSS on the `olmoe-1b-7b` preset (run by `nox -s bench_layout`).

1. synthesize the OLMoE-1B-7B-shaped GGUF (~3.9 GB) into a scratch directory on the repo's disk
   (never a tmpfs: the point is real files);
2. baselines, each in a child process: writing as many bytes as the experts from memory, the way
   pack writes them (32 MiB O_DIRECT writes, fsync: the disk's rate, which bounds any packer),
   and `shutil.copyfile` of the source (buffered, not fsync'ed);
3. conversion alone: pread + tile + crc32 of every expert, nothing written (the CPU path);
4. pack it with `pack_model` in a child process; throughput = expert bytes / wall time, peak RSS
   from the child's `ru_maxrss` (`RUSAGE_CHILDREN`);
5. verify the pack (all record checksums) in a child process.

Prints a table, writes bench-results/bench_layout.json, deletes the big files. Every step starts
after `os.sync()` (nobody pays for another step's write-back); the source was just written, so it
may still be in the page cache (this VM reclaims cold pages on its own; caches are not dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench-results"

CHILD = r"""
import json, os, resource, sys, time, shutil, zlib
import numpy as np
what, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
out = {}
if what == "copy":
    shutil.copyfile(src, dst)
elif what == "write":  # as many bytes as the experts, from memory, the way pack writes them
    import mmap
    from estream_layout import ModelSpec
    n = ModelSpec.from_gguf(src).expert_bytes
    buf = np.frombuffer(mmap.mmap(-1, 32 << 20), dtype=np.uint8)  # page-aligned
    buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(dst, flags | os.O_DIRECT, 0o644)
        out["o_direct"] = True
    except OSError:
        fd = os.open(dst, flags, 0o644)
        out["o_direct"] = False
    t0 = time.perf_counter()
    left = n
    while left > 0:
        k = min(left, buf.size)
        left -= os.write(fd, memoryview(buf[:k]))
    os.fsync(fd)
    os.close(fd)
    out["bytes"] = n
elif what == "convert":  # pread + tile + crc32 of every expert, nothing written: the CPU path
    from estream_layout import EXPERT_PROJECTIONS, ModelSpec, TensorReader, pack_tiles, tile_nbytes
    spec = ModelSpec.from_gguf(src)
    n = 0
    with TensorReader(src) as rd:
        for layer in spec.moe_layers:
            infos = [spec.expert_tensor(layer, j) for j in EXPERT_PROJECTIONS]
            bufs = [np.empty((i.shape[1], i.row_bytes), np.uint8) for i in infos]
            outs = [np.empty(tile_nbytes(i.shape[1], i.shape[2]), np.uint8) for i in infos]
            for e in range(spec.n_experts):
                for i, b, o in zip(infos, bufs, outs):
                    pack_tiles(rd.expert(i, e, out=b), out=o)
                    zlib.crc32(o)
                    n += b.nbytes
    out["bytes"] = n
elif what == "pack":
    from estream_layout import pack_model
    m = pack_model(src, dst, progress=False)
    out["experts_bytes"] = m.experts_bytes
elif what == "verify":
    from estream_layout import verify_pack
    r = verify_pack(src)
    out["ok"] = r.ok
    out["checked_bytes"] = r.checked_bytes
out["seconds"] = time.perf_counter() - t0
out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(out))
"""


def _fs_type(path: Path) -> str:
    best, fstype = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, fstype = parts[1], parts[2]
    return fstype


def _child(what: str, src: Path, dst: Path) -> dict[str, float]:
    os.sync()  # no step pays for writing back the previous step's dirty pages
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(
        [sys.executable, "-c", CHILD, what, str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise SystemExit(f"{what} failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out["rusage_children_maxrss_kib"] = after if after > before else out["maxrss_kib"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="olmoe-1b-7b")
    ap.add_argument("--arch", default="olmoe")
    ap.add_argument("--keep", action="store_true", help="keep the scratch files")
    args = ap.parse_args()

    RESULTS.mkdir(exist_ok=True)
    scratch_parent = RESULTS
    if _fs_type(scratch_parent.resolve()) == "tmpfs":  # pragma: no cover
        raise SystemExit(f"{scratch_parent} is on tmpfs; run from a repo on a real disk")
    work = Path(tempfile.mkdtemp(prefix="bench-layout-", dir=scratch_parent))
    print(f"scratch: {work} ({_fs_type(work.resolve())})")
    try:
        from estream_layout import ModelSpec, synth_model

        src = work / f"{args.arch}-{args.preset}.gguf"
        t0 = time.perf_counter()
        synth_model(args.arch, args.preset, src, seed=0)
        synth_s = time.perf_counter() - t0
        spec = ModelSpec.from_gguf(src)
        src_bytes = src.stat().st_size
        expert_bytes = spec.expert_bytes

        write = _child("write", src, work / "write.bin")
        (work / "write.bin").unlink()
        copy = _child("copy", src, work / "copy.gguf")
        (work / "copy.gguf").unlink()
        convert = _child("convert", src, work / "unused")
        pack = _child("pack", src, work / "model.estream")
        verify = _child("verify", work / "model.estream", work / "unused")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    mb = 1e6
    write_mbs = write["bytes"] / write["seconds"] / mb
    copy_mbs = src_bytes / copy["seconds"] / mb
    convert_mbs = convert["bytes"] / convert["seconds"] / mb
    pack_mbs = expert_bytes / pack["seconds"] / mb
    verify_mbs = verify["checked_bytes"] / verify["seconds"] / mb
    rss_mib = pack["rusage_children_maxrss_kib"] / 1024
    rows = [
        ("synthesize GGUF", synth_s, src_bytes / synth_s / mb, ""),
        ("write from memory", write["seconds"], write_mbs, "1.00 (baseline: the disk)"),
        ("copy source file", copy["seconds"], copy_mbs, f"{copy_mbs / write_mbs:.2f}"),
        (
            "convert only (no I/O)",
            convert["seconds"],
            convert_mbs,
            f"{convert_mbs / write_mbs:.2f}",
        ),
        ("pack, end to end", pack["seconds"], pack_mbs, f"{pack_mbs / write_mbs:.2f}"),
        ("verify checksums", verify["seconds"], verify_mbs, f"{verify_mbs / write_mbs:.2f}"),
    ]
    print(
        f"\nbench_layout: {args.arch} {args.preset}: source {src_bytes / 2**30:.2f} GiB, "
        f"experts {expert_bytes / 2**30:.2f} GiB ({len(spec.moe_layers)} layers x "
        f"{spec.n_experts} experts), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'step':<24} {'time':>9} {'MB/s':>8}  ratio to writing the same bytes")
    for name, secs, rate, ratio in rows:
        print(f"{name:<24} {secs:>8.2f}s {rate:>8.0f}  {ratio}")
    print(f"peak RSS while packing: {rss_mib:,.0f} MiB (target < 1024 MiB)")
    print(
        f"pack throughput {pack_mbs:.0f} MB/s of expert bytes (target >= 300): "
        f"{'MET' if pack_mbs >= 300 else 'MISSED'}; conversion alone {convert_mbs:.0f} MB/s, "
        f"disk write {write_mbs:.0f} MB/s"
    )
    result = {
        "bench": "bench_layout",
        "arch": args.arch,
        "preset": args.preset,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "source_bytes": src_bytes,
        "expert_bytes": expert_bytes,
        "synth_seconds": synth_s,
        "write_seconds": write["seconds"],
        "write_mb_per_s": write_mbs,
        "copy_seconds": copy["seconds"],
        "copy_mb_per_s": copy_mbs,
        "convert_seconds": convert["seconds"],
        "convert_mb_per_s": convert_mbs,
        "pack_seconds": pack["seconds"],
        "pack_expert_mb_per_s": pack_mbs,
        "pack_vs_write_ratio": pack_mbs / write_mbs,
        "pack_peak_rss_mib": rss_mib,
        "load_average_1min": os.getloadavg()[0],
        "verify_seconds": verify["seconds"],
        "verify_mb_per_s": verify_mbs,
        "verify_ok": verify["ok"],
        "targets": {"pack_expert_mb_per_s": 300, "pack_peak_rss_mib": 1024},
        "met": bool(pack_mbs >= 300 and rss_mib < 1024),
        "page_cache": "source written just before, os.sync() before each step; not dropped",
    }
    out = RESULTS / "bench_layout.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
