"""Instructions per 32x32 tile of the arm64 strip kernels and per key block of the attention
tasks, by kind, counted on the compiled code.

    python tools/neon_instr_mix.py [--exe NEON_SELFTEST] [--json OUT]

Cross-compiles ``tools/neon_selftest.c`` with the library's C sources (aarch64-linux-gnu-gcc,
the package's own compiler flags, static) unless given one, and runs its ``strip`` mode (one
Q8-activation GEMM of one 32-row tile strip, one thread) under qemu-aarch64 with QEMU's
execution log (``-d in_asm,exec,nochain``) restricted to one kernel: every translated
block is listed once with its instructions, every execution of a block is logged, so the
instructions the kernel executed are counted exactly for that run. Each instruction is
classified by its disassembly (aarch64-linux-gnu-objdump): ``sdot`` (the int8 dot products,
``udot``/``usdot``/``sudot`` included), ``mmla`` (the i8mm matrix products), ``bf16`` (the
BFloat16 multiply-adds ``bfmlalb``/``bfmlalt``, ``bfdot``, ``bfmmla``, and ``bfcvt*``),
``load``, ``store``, ``fp`` (vector and scalar float arithmetic), ``convert`` (int <-> float,
half <-> single), ``int_vector`` (the other vector integer work: nibble masks and shifts, the
``8·sum`` correction, bit selects and masks), ``branch`` and ``scalar`` (address and loop
arithmetic).

The NEON level has two tables (htp_neon.c): SDOT kernels, traced on QEMU's ``cortex-a76``
(dot product, no FEAT_I8MM), and the same kernels taking tokens in pairs through SMMLA, traced on
its ``max`` CPU (FEAT_I8MM; the library picks that table there). Two strip lengths (kb = 1, 2
tiles) give the cost of one tile; three token counts (nt = 1, 2, 4) its cost at each, measured
directly. The kernels take 2 tokens a pass (decoding the tile's weights once a pass), so the
per-token cost is the steady state's, half the difference between 4 and 2 tokens, and the
per-tile setup what remains at 2 tokens (work done once a strip call, such as the row scales
of the portable kernel); as ``tools/hexagon_packets.py`` does for the HVX kernel's packets. A
32x32 tile and one token is 1024 multiply-accumulates: 64 ``sdot`` (16 each) or 32 ``smmla``
(32 each; the odd token of a count takes the SDOT body). The counts are executed
instructions, not cycles: they say what the kernel asks of a core, not how fast one runs it.

The attention tasks (the table's ``attention_task`` and ``attention_bf16_task``, and the
portable task for comparison) are traced the same way on the self-test's ``attention-task``
mode: one head, one query block of 64 causal queries after NKB - 1 blocks of 64 context keys,
dk = dv = 64, one thread; the task and the local functions it calls are counted (not the
driver's once-per-call re-lay or bf16 packing of K and V). NKB = 1 and 2 give the task with its
causal diagonal block alone and the cost of one more, fully visible, key block: 64 x 64 x
(dk + dv) = 524288 multiply-accumulates, 131072 4-lane FMLA or BFMLALB / BFMLALT at least."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
CC = "aarch64-linux-gnu-gcc"
OBJDUMP = "aarch64-linux-gnu-objdump"
NM = "aarch64-linux-gnu-nm"
QEMU_NAMES = ("qemu-aarch64", "qemu-aarch64-static")
KINDS = ("sdot", "mmla", "bf16", "load", "store", "fp", "convert", "int_vector", "branch", "scalar")
ATTN_DK = 64  # the attention workload's head dims (dk = dv)
TOKENS = (1, 2, 4, 8)  # the token counts of the strip traces
# the QEMU CPU each table is traced on: the library picks the SMMLA table where FEAT_I8MM is
CPU = {"neon": "cortex-a76", "neon_i8mm": "max", "portable": "max"}

# the strip entries of an htp_isa table and the tile format each multiplies
STRIP_FORMATS = {
    "q4q8_strip": "q4_0",
    "q8q8_strip": "q8_0",
    "q4kq8_strip": "q4_k",
    "q6kq8_strip": "q6_k",
    "q5kq8_strip": "q5_k",
    "mxq8_strip": "mxfp4",
}


def _initializer(csrc: Path, table: str, source: str) -> str:
    """The initializer of an htp_isa table: written out, or a one-parameter macro's body (as
    htp_neon.c's HTP_NEON_TABLE(SUF)) with the argument pasted in."""
    text = (csrc / source).read_text()
    body = re.search(rf"const htp_isa htp_isa_{table} = \{{(.*?)\}};", text, re.S)
    if body is not None:
        return body.group(1)
    use = re.search(rf"const htp_isa htp_isa_{table} = (\w+)\((\w+)\);", text)
    macro = use and re.search(rf"#define {use.group(1)}\((\w+)\)(.*?[^\\])\n", text, re.S)
    if use is None or macro is None:
        raise SystemExit(f"no htp_isa_{table} table in {csrc / source}")
    return macro.group(2).replace(f"##{macro.group(1)}", use.group(2))


def _table(csrc: Path, table: str, source: str) -> dict[str, str]:
    """entry -> function of the strip entries an htp_isa table's initializer names."""
    return {
        e: f
        for e, f in re.findall(r"\.(\w+_strip)\s*=\s*(\w+)", _initializer(csrc, table, source))
        if e in STRIP_FORMATS
    }


def kernels(csrc: Path | None = None) -> list[tuple[str, str, str, str]]:
    """(label, kernel symbol, tile format, table) of the strip kernel the neon and neon_i8mm
    tables run for every tile format (their own, or the portable one where they name none: the
    driver falls back), then the portable Q4_0 kernel for comparison; read from the tables'
    initializers (htp_neon.c, htp_core.c), so a new kernel is traced without editing this
    list."""
    csrc = csrc or PKG / "csrc"
    portable = _table(csrc, "portable", "htp_core.c")
    out = []
    for table in ("neon", "neon_i8mm"):
        own = _table(csrc, table, "htp_neon.c")
        out += [(f"{table}_{STRIP_FORMATS[e]}", own.get(e, f), STRIP_FORMATS[e], table)
                for e, f in portable.items()]  # fmt: skip
    return [*out, ("portable_q4_0", portable["q4q8_strip"], "q4_0", "portable")]


def attention_tasks(csrc: Path | None = None) -> list[tuple[str, str, str, str]]:
    """(label, task symbol, products, table) of the attention tasks the neon table runs, fp32
    and (FEAT_BF16) bf16 products, then the portable task with either; read from the tables'
    initializers (htp_neon.c, htp_core.c)."""
    csrc = csrc or PKG / "csrc"

    def entries(table: str, source: str) -> dict[str, str]:
        init = _initializer(csrc, table, source)
        return dict(re.findall(r"\.(attention_\w*task)\s*=\s*(\w+)", init))

    neon, portable = entries("neon", "htp_neon.c"), entries("portable", "htp_core.c")
    ptask = portable["attention_task"]
    return [
        ("attention_neon_f32", neon.get("attention_task", ptask), "f32", "neon"),
        ("attention_neon_bf16", neon.get("attention_bf16_task") or ptask, "bf16", "neon"),
        ("attention_portable_f32", ptask, "f32", "portable"),
        ("attention_portable_bf16", ptask, "bf16", "portable"),
    ]


def qemu() -> str | None:
    """The qemu-aarch64 user-mode emulator (Debian's qemu-user or qemu-user-static name)."""
    return next((p for p in map(shutil.which, QEMU_NAMES) if p), None)


def missing_tools() -> list[str]:
    """The cross tools not on PATH (qemu named by its qemu-user name)."""
    miss = [t for t in (CC, OBJDUMP, NM) if shutil.which(t) is None]
    return miss + ([] if qemu() else [QEMU_NAMES[0]])


def _run_parallel(cmds: list[list[str]]) -> None:
    """Run the commands, one per core at a time; RuntimeError with the first failure's output."""
    pending, running, failed = list(cmds), [], []
    while pending or running:
        while pending and len(running) < (os.cpu_count() or 1):
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
        cmd, proc = running.pop(0)
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed.append(f"{' '.join(cmd)}\n{err}")
    if failed:
        raise RuntimeError(f"{CC} failed:\n{failed[0]}")


def build_selftest(exe: Path, csrc: Path | None = None, reuse: Path | None = None) -> Path:
    """Cross-compile neon_selftest.c with the C sources of ``csrc`` (default: the package's)
    into ``exe`` (static) with the flags the package is built with, one compiler per core.
    ``reuse``: an executable this function built from the package's own sources; its object
    files are reused for every source of ``csrc`` identical to the package's (headers too)."""
    spec = importlib.util.spec_from_file_location(
        "_htp_buildcfg", PKG / "src/estream_htp/_buildcfg.py"
    )
    assert spec and spec.loader
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)  # the tree's flags, whatever estream_htp is installed
    own = PKG / "csrc"
    csrc = csrc or own
    objdir = exe.with_name(exe.name + ".objs")
    objdir.mkdir(parents=True, exist_ok=True)

    def same(p: Path, orig: Path) -> bool:
        return orig.is_file() and p.read_bytes() == orig.read_bytes()

    headers_same = sorted(h.name for h in csrc.glob("*.h")) == sorted(
        h.name for h in own.glob("*.h")
    ) and all(same(h, own / h.name) for h in csrc.glob("*.h"))
    objs, cmds = [], []
    for src in [*sorted(csrc.glob("*.c")), PKG / "tools" / "neon_selftest.c"]:
        old = reuse.with_name(reuse.name + ".objs") / f"{src.name}.o" if reuse else None
        orig = own / src.name if src.parent == csrc else src
        if old is not None and old.is_file() and headers_same and same(src, orig):
            objs.append(str(old))
            continue
        obj = objdir / f"{src.name}.o"
        objs.append(str(obj))
        cmds.append([CC, *cfg.BASE_CFLAGS, f"-I{csrc}", "-c", str(src), "-o", str(obj)])
    _run_parallel(cmds)
    _run_parallel([[CC, "-static", "-pthread", *objs, "-lm", "-o", str(exe)]])
    return exe


def _symbols(exe: Path) -> dict[str, tuple[int, int, str]]:
    """name -> (address, size, nm type) of every sized symbol."""
    out = subprocess.run([NM, "-S", str(exe)], check=True, capture_output=True, text=True).stdout
    syms: dict[str, tuple[int, int, str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            syms.setdefault(parts[3], (int(parts[0], 16), int(parts[1], 16), parts[2]))
    return syms


def _symbol_range(exe: Path, func: str) -> tuple[int, int]:
    syms = _symbols(exe)
    if func not in syms:
        raise SystemExit(f"{func} not found in {exe}")
    return syms[func][:2]


def call_tree(exe: Path, func: str) -> list[tuple[int, int]]:
    """(address, size) of func and of every local function (nm type t: a static function of
    the sources the compiler did not inline) it calls, directly or not; C library calls are not
    followed."""
    syms = _symbols(exe)
    if func not in syms:
        raise SystemExit(f"{func} not found in {exe}")
    todo, seen = [func], {func}
    while todo:
        lo, size, _ = syms[todo.pop()]
        out = subprocess.run(
            [OBJDUMP, "-d", "--no-show-raw-insn", f"--start-address={lo:#x}",
             f"--stop-address={lo + size:#x}", str(exe)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        for callee in re.findall(r"\sbl\s+[0-9a-f]+ <([\w.]+)>", out):
            if callee not in seen and callee in syms and syms[callee][2] == "t":
                seen.add(callee)
                todo.append(callee)
    return sorted(syms[f][:2] for f in seen)


def kind_of(mnemonic: str, operands: str) -> str:
    """The class of one aarch64 instruction, from objdump's mnemonic and operands."""
    m = mnemonic.split(".")[0]
    vector = re.search(r"\bv\d+\.", operands) is not None or re.search(r"\bq\d+\b", operands)
    if m in ("sdot", "udot", "usdot", "sudot"):
        return "sdot"
    if m in ("smmla", "ummla", "usmmla"):
        return "mmla"
    if m in ("bfmlalb", "bfmlalt", "bfdot", "bfmmla") or m.startswith("bfcvt"):
        return "bf16"
    if m.startswith("ld"):
        return "load"
    if m.startswith("st"):
        return "store"
    if m in ("b", "bl", "br", "blr", "ret", "cbz", "cbnz", "tbz", "tbnz") or mnemonic.startswith(
        "b."
    ):
        return "branch"
    if m in ("scvtf", "ucvtf", "fcvtl", "fcvtl2", "fcvtn", "fcvtn2", "fcvt") or m.startswith(
        ("fcvtz", "fcvta", "fcvtm", "fcvtp")
    ):
        return "convert"
    if m.startswith("f"):
        return "fp"
    return "int_vector" if vector else "scalar"


def disassemble(exe: Path, lo: int, size: int) -> dict[int, str]:
    """address -> kind for every instruction of [lo, lo + size)."""
    out = subprocess.run(
        [OBJDUMP, "-d", "--no-show-raw-insn", f"--start-address={lo:#x}",
         f"--stop-address={lo + size:#x}", str(exe)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    kinds: dict[int, str] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*([^/]*)", line)
        if m and lo <= int(m.group(1), 16) < lo + size:
            kinds[int(m.group(1), 16)] = kind_of(m.group(2), m.group(3))
    return kinds


def count_kinds(log: str, kinds: dict[int, str]) -> Counter[str]:
    """Instructions executed by kind, from a QEMU in_asm + exec (nochain) log."""
    tb_addrs: dict[int, list[int]] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("IN:"):
            body = []
            for ln in lines[i + 1 :]:
                if not ln.startswith("0x"):
                    break
                body.append(int(ln.split(":")[0], 16))
            if body:
                tb_addrs[body[0]] = body
    runs: Counter[int] = Counter()
    for m in re.finditer(r"^Trace \d+: \S+ \[[0-9a-f]+/([0-9a-f]+)/", log, re.M):
        runs[int(m.group(1), 16)] += 1
    total: Counter[str] = Counter()
    for pc, n in runs.items():
        for a in tb_addrs[pc]:
            total[kinds[a]] += n
    return total


def _traced(exe: Path, ranges: list[tuple[int, int]], kinds: dict[int, str],
            args: list[str], cpu: str = "max") -> Counter[str]:  # fmt: skip
    """Instructions executed in the address ranges by the self-test run with args on QEMU's
    CPU model cpu."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "qemu.log"
        cmd = [qemu() or QEMU_NAMES[0], "-cpu", cpu, "-d", "in_asm,exec,nochain", "-D",
               str(log), "-dfilter", ",".join(f"{lo:#x}+{size:#x}" for lo, size in ranges),
               str(exe), *args]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        return count_kinds(log.read_text(), kinds)


def measure(exe: Path, lo: int, size: int, kinds: dict[int, str], fmt: str, kb: int, nt: int,
            table: str) -> Counter[str]:  # fmt: skip
    level = "portable" if table == "portable" else "neon"
    return _traced(exe, [(lo, size)], kinds, ["strip", fmt, str(kb), str(nt), level], CPU[table])


def _with_total(c: dict[str, float]) -> dict[str, float]:
    out = {k: c.get(k, 0) for k in KINDS}
    out["total"] = sum(out.values())
    return out


def tile_mix(exe: Path, func: str, fmt: str, table: str) -> dict[str, object]:
    lo, size = _symbol_range(exe, func)
    kinds = disassemble(exe, lo, size)
    m = {
        (kb, nt): measure(exe, lo, size, kinds, fmt, kb, nt, table)
        for kb in (1, 2)
        for nt in TOKENS
    }
    tile = {nt: {k: m[(2, nt)][k] - m[(1, nt)][k] for k in KINDS} for nt in TOKENS}
    per_token = {k: (tile[8][k] - tile[4][k]) / 4 for k in KINDS}
    setup = {k: tile[4][k] - 4 * per_token[k] for k in KINDS}
    res = {
        "function": func,
        "format": fmt,
        "table": table,
        "cpu": CPU[table],
        "measured": {f"kb={kb},nt={nt}": _with_total(v) for (kb, nt), v in m.items()},
        "per_tile": {str(nt): _with_total(v) for nt, v in tile.items()},
        "per_tile_setup": _with_total(setup),
        "per_tile_per_token": _with_total(per_token),
    }
    st, pt = res["per_tile_setup"], res["per_tile_per_token"]
    print(f"{func} ({table} table, {fmt}, qemu -cpu {CPU[table]}): instructions executed (QEMU "
          "exec log), one 32-row strip")  # fmt: skip
    print(f"  {'kind':<11}" + "".join(f" {f'tile, {n} tok':>11}" for n in TOKENS)
          + f" {'setup':>7} {'per tok':>7}")  # fmt: skip
    for k in (*KINDS, "total"):
        cols = "".join(f" {res['per_tile'][str(n)][k]:>11.0f}" for n in TOKENS)
        print(f"  {k:<11}{cols} {st[k]:>7.0f} {pt[k]:>7.0f}")
    return res


def attention_mix(
    exe: Path, func: str, products: str, simd: str, dk: int = ATTN_DK
) -> dict[str, object]:
    """One attention task's instructions by kind: with its causal diagonal key block alone
    (NKB = 1), with one context block before it (NKB = 2), and their difference, one fully
    visible key block of 64 queries x 64 keys."""
    ranges = call_tree(exe, func)
    kinds: dict[int, str] = {}
    for lo, size in ranges:
        kinds.update(disassemble(exe, lo, size))
    m = {nkb: _traced(exe, ranges, kinds, ["attention-task", products, str(dk), str(nkb), simd])
         for nkb in (1, 2)}  # fmt: skip
    block = {k: m[2][k] - m[1][k] for k in KINDS}
    res = {
        "function": func,
        "products": products,
        "table": simd,
        "dk": dk,
        "dv": dk,
        "queries": 64,
        "measured": {f"nkb={n}": _with_total(v) for n, v in m.items()},
        "per_key_block": _with_total(block),
    }
    d1, pb = res["measured"]["nkb=1"], res["per_key_block"]
    print(f"{func} ({simd} table, {products} products, dk = dv = {dk}): instructions executed "
          "(QEMU exec log), one (head, query block) task of 64 queries")  # fmt: skip
    print(f"  {'kind':<11} {'diagonal block':>14} {'+1 key block':>13}")
    for k in (*KINDS, "total"):
        print(f"  {k:<11} {d1[k]:>14.0f} {pb[k]:>13.0f}")
    return res


def main(argv: list[str]) -> int:
    args = argv[1:]
    opts = dict(zip(args[::2], args[1::2], strict=False))
    if len(args) % 2 or set(opts) - {"--exe", "--json"}:
        print("usage: neon_instr_mix.py [--exe NEON_SELFTEST] [--json OUT]", file=sys.stderr)
        return 2
    miss = missing_tools()
    if miss:
        print(f"neon_instr_mix: {', '.join(miss)} not installed "
              "(apt-get install gcc-aarch64-linux-gnu qemu-user)", file=sys.stderr)  # fmt: skip
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        exe = (
            Path(opts["--exe"]) if "--exe" in opts else build_selftest(Path(tmp) / "neon_selftest")
        )
        if not exe.is_file():
            print(f"neon_instr_mix: {exe}: no such file", file=sys.stderr)
            return 1
        res: dict[str, object] = {"executable": str(exe) if "--exe" in opts else "built"}
        for label, func, fmt, simd in kernels():
            res[label] = tile_mix(exe, func, fmt, simd)
        for label, func, products, simd in attention_tasks():
            res[label] = attention_mix(exe, func, products, simd)
    if "--json" in opts:
        out = Path(opts["--json"])
        tmp_out = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp_out.write_text(json.dumps(res, indent=2) + "\n")
        tmp_out.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
