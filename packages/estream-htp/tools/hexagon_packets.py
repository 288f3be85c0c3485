"""Packets per 32x32 tile of the HVX x int8 kernels of every weight format (and of the portable
kernels they replace), counted on the compiled code.

    python tools/hexagon_packets.py [--json OUT]

Runs GEMMs of one 32-row tile strip (the inner loop of both the expert op and the dense GEMM)
on the ``hexagon`` backend with QEMU's execution log (``-d in_asm,exec,nochain``) restricted to
``htp_hvx_q4q8_strip``: every translated block is listed once with its VLIW packets, and every
execution of a block is logged, so the packets the kernel issued are counted exactly for that
run. A packet issues in one cycle at best (VLIW: up to four instructions), so the counts bound
the cycles from below on a real core (no stalls, no memory latency). Two strip lengths
(kb = 1, 2 tiles; the K-quants and IQ4_XS 8, 16: one and two 256-value super-blocks) and two token counts
(nt = 1, 8) separate the per-tile setup (nibble split of the four 128-byte groups, the 32 f16
row scales) from the per-token work (eight ``vrmpy``, the ``8·sum`` correction, and the 32
rows' fp32 scale-and-accumulate in scalar float)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

import estream_htp as htp
from estream_htp import _hexagon
from estream_htp import testing as T

FUNC = "htp_hvx_q4q8_strip"
#: the tile formats of 256-value super-blocks (K a multiple of 256)
SUPER_BLOCKS = ("q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "iq4_xs-t32r4")
#: format -> (HVX kernel, portable kernel) of the other formats, counted after Q4_0 and Q8_0
KERNELS = {
    "q4_k-t32r4": ("htp_hvx_q4kq8_strip", "htp_q4kq8_strip_portable"),
    "q5_k-t32r4": ("htp_hvx_q5kq8_strip", "htp_q5kq8_strip_portable"),
    "q6_k-t32r4": ("htp_hvx_q6kq8_strip", "htp_q6kq8_strip_portable"),
    "iq4_nl-t32r4": ("nlq8_strip_hvx", "htp_nlq8_strip_portable"),
    "iq4_xs-t32r4": ("xsq8_strip_hvx", "htp_xsq8_strip_portable"),
    "q4_1-t32r4": ("affq8_strip_hvx", "htp_affq8_strip_portable"),
    "q5_0-t32r4": ("affq8_strip_hvx", "htp_affq8_strip_portable"),
    "q5_1-t32r4": ("affq8_strip_hvx", "htp_affq8_strip_portable"),
    "mxfp4-t32r4": ("mxq8_strip_hvx", "htp_mxq8_strip_portable"),
}


def _symbol_range(exe: Path, func: str) -> tuple[int, int]:
    out = subprocess.run(
        ["llvm-nm-19", "-S", str(exe)], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3] == func:
            return int(parts[0], 16), int(parts[1], 16)
    raise SystemExit(f"{func} not found in {exe}")


def count_packets(log: str) -> int:
    """Packets executed, from a QEMU in_asm + exec (nochain) log."""
    tb_packets: dict[int, int] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("IN:"):
            body = []
            for ln in lines[i + 1 :]:
                if not ln.startswith("0x"):
                    break
                body.append(ln)
            if body:
                tb_packets[int(body[0].split(":")[0], 16)] = sum("{" in ln for ln in body)
    runs: Counter[int] = Counter()
    for m in re.finditer(r"^Trace \d+: \S+ \[[0-9a-f]+/([0-9a-f]+)/", log, re.M):
        runs[int(m.group(1), 16)] += 1
    return sum(tb_packets[pc] * n for pc, n in runs.items())


def measure(
    exe: Path, lo: int, size: int, kb: int, nt: int, simd: str = "hvx", fmt: str = "q4_0-t32r4"
) -> int:
    # the same weights for every token count (a tile's setup can depend on its values: the f16
    # scales' general conversion when one is subnormal), the activations drawn apart
    rng = np.random.default_rng(kb * 100)
    k = 32 * kb
    x = np.random.default_rng(kb * 100 + nt).standard_normal((nt, k)).astype(np.float32)
    if fmt in ("q4_0-t32r4", "q8_0-t32r4"):
        wf = rng.standard_normal((32, k)).astype(np.float32)
        w = htp.pack_q4_0_t32r4(wf) if fmt == "q4_0-t32r4" else htp.pack_q8_0_t32r4(wf)
    else:  # valid random blocks of the format, re-laid as tiles: the first strip of a gate
        gate = T.random_experts(rng, 1, k, 256, (fmt, fmt, fmt))[0][0]
        w = np.ascontiguousarray(gate.reshape(-1)[: T.matrix_nbytes(fmt, 32, k)])
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "qemu.log"
        cmd = ["qemu-hexagon-static", "-d", "in_asm,exec,nochain", "-D", str(log),
               "-dfilter", f"{lo:#x}+{size:#x}", "-cpu", _hexagon.QEMU_CPU, str(exe)]  # fmt: skip
        with htp.Backend("hexagon", executor=cmd, simd=simd) as b:
            htp.gemm(x, w, 32, fmt, act="q8", backend=b)
        return count_packets(log.read_text())


def tile_costs(exe: Path, func: str, simd: str, fmt: str = "q4_0-t32r4") -> dict[str, object]:
    lo, size = _symbol_range(exe, func)
    k1, k2 = (8, 16) if fmt in SUPER_BLOCKS else (1, 2)
    m = {(kb, nt): measure(exe, lo, size, kb, nt, simd, fmt) for kb in (k1, k2) for nt in (1, 8)}
    # one more tile (the mean of k2 - k1 more)
    tile1, tile8 = ((m[(k2, nt)] - m[(k1, nt)]) / (k2 - k1) for nt in (1, 8))
    per_token = (tile8 - tile1) / 7
    setup = tile1 - per_token
    print(f"{func} ({simd}, {fmt}): packets executed (QEMU exec log), one 32-row strip")
    for (kb, nt), v in m.items():
        print(f"  kb={kb} tiles, nt={nt} tokens: {v}")
    print(f"  per 32x32 tile: {setup:.0f} setup + {per_token:.0f} per token")
    for nt in (1, 8, 64):
        print(f"  nt={nt:2d}: {setup + nt * per_token:.0f} packets per tile "
              f"({(setup + nt * per_token) / nt:.0f} per tile-token; 1024 MACs each)")  # fmt: skip
    return {
        "measured": {f"kb={kb},nt={nt}": v for (kb, nt), v in m.items()},
        "per_tile_setup": setup,
        "per_tile_per_token": per_token,
        "per_tile": {str(nt): setup + nt * per_token for nt in (1, 8, 64)},
    }


def main(argv: list[str]) -> int:
    exe = _hexagon.executor_path()
    res = {
        "executor": str(exe),
        "hvx": tile_costs(exe, FUNC, "hvx"),
        "portable": tile_costs(exe, "q4q8_strip_portable", "portable"),
        "hvx_q8_0": tile_costs(exe, "htp_hvx_q8q8_strip", "hvx", "q8_0-t32r4"),
        "portable_q8_0": tile_costs(exe, "htp_q8q8_strip_portable", "portable", "q8_0-t32r4"),
    }
    for fmt, (hvx, portable) in KERNELS.items():
        f = fmt.removesuffix("-t32r4")
        res[f"hvx_{f}"] = tile_costs(exe, hvx, "hvx", fmt)
        res[f"portable_{f}"] = tile_costs(exe, portable, "portable", fmt)
    if len(argv) > 2 and argv[1] == "--json":
        Path(argv[2]).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
