"""The arm64 kernel tables (NEON with the dot-product extension, and its SMMLA form for
FEAT_I8MM CPUs), cross-compiled and run under qemu-aarch64: tools/neon_selftest.c checks it against float64 references and the portable table,
tools/neon_instr_mix.py counts its instructions per tile.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user (or qemu-user-static); skipped, naming the
missing tools, where they are not installed, unless ESTREAM_HTP_REQUIRE_ARM64=1 (set by nox where
it installed them), which turns a missing tool into a failure. Nothing here runs on arm64
hardware."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "neon_instr_mix", PKG / "tools" / "neon_instr_mix.py"
)
assert _spec and _spec.loader
mix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mix)

MISSING = mix.missing_tools()
REQUIRED = os.environ.get("ESTREAM_HTP_REQUIRE_ARM64", "").strip() == "1"
pytestmark = pytest.mark.skipif(
    bool(MISSING) and not REQUIRED,
    reason=f"arm64 cross tests: {', '.join(MISSING)} not installed "
    "(apt-get install gcc-aarch64-linux-gnu qemu-user)",
)


#: the tile formats of the GEMM checks
FORMATS = (
    "q4_0",
    "q8_0",
    "q4_k",
    "q5_k",
    "q6_k",
    "mxfp4",
    "iq4_nl",
    "q4_1",
    "q5_0",
    "q5_1",
    "iq4_xs",
)


def _qemu(exe: Path, cpu: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [mix.qemu() or "qemu-aarch64", "-cpu", cpu, str(exe), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _require_tools() -> None:
    if MISSING:  # only reached when required
        pytest.fail(f"ESTREAM_HTP_REQUIRE_ARM64=1 but {', '.join(MISSING)} not installed")


@pytest.fixture(scope="module")
def selftest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_tools()
    return mix.build_selftest(tmp_path_factory.mktemp("arm64") / "neon_selftest")


def test_neon_kernels_match_references_under_qemu(selftest: Path) -> None:
    """On a CPU with the dot-product extension every check of the self-test passes (GEMM of
    every tile format (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS) and
    activation format within the fp32 rounding bound of float64; every format's int8 GEMM
    giving the portable table's bits on 5 awkward shapes; F16 / BF16 dense tiles in fp32
    under either act, NEON giving the portable bits, the values read exactly; exact-integer GEMMs
    bit-identical to the int64 dot product and to the portable table, GEMM from Q8 rows and
    with a shared input, the expert op (SwiGLU, ReGLU and SwiGLU-OAI, with and without
    biases), quantization, attention with fp32, bf16 and bf16-pv products (MLA's head dims with
    a sliding window and sinks among them) bit-identical to the portable table, SwiGLU, fp32 matmul), and
    each kind of check ran. QEMU's `max` CPU has FEAT_BF16, so the bf16 attention ran the native
    BFMLALT / BFMLALB task, and FEAT_I8MM, so the int8 GEMMs ran the SMMLA kernels (the library
    agreeing with HWCAP2_I8MM)."""
    r = _qemu(selftest, "max")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "OK"
    assert lines[0] == "bf16 attention products: native (FEAT_BF16: BFMLALT / BFMLALB)"
    assert lines[1] == "int8 products: SMMLA on token pairs (FEAT_I8MM)"
    _assert_attention_bits(lines)
    for fmt in FORMATS:
        for act in ("f32", "q8"):
            assert any(re.match(rf"gemm {fmt} act={act} n=\d+ k=\d+ t=\d+: ok$", s) for s in lines)
            assert any(s.startswith(f"expert {fmt} act={act} neon ") for s in lines)
        assert any(s.startswith(f"gemm {fmt} exact integer sums") for s in lines)
        assert any(s.startswith(f"gemm {fmt} from Q8 rows and shared input") for s in lines)
    _assert_gemm_bits(lines)
    for fmt in ("f16", "bf16"):  # dense tiles: every shape, fp32 under either act, exact values
        assert sum(bool(re.match(rf"gemm {fmt} n=\d+ k=\d+ t=\d+: ok$", s)) for s in lines) == 8
    assert any(s.startswith("quantize") for s in lines)
    for op in ("swiglu n", "swiglu_oai n", "matmul_f32"):
        assert any(s.startswith(op) and "vs float64" in s for s in lines), op
    for glu in (0, 1, 2):  # SwiGLU, ReGLU, SwiGLU-OAI with biases on the NEON table
        for act in ("f32", "q8"):
            assert any(
                s.startswith(f"expert q4_0 act={act} neon ") and f"glu={glu} bias=1" in s
                for s in lines
            ), (glu, act)


ATTENTION_SHAPES = 8  # tools/neon_selftest.c check_attention (7 drawn, 1 built)


def _assert_gemm_bits(lines: list[str]) -> None:
    """Every format's NEON kernel (lq_part_neon, kn_part_neon) gave the portable table's bits on
    the 5 shapes of the check."""
    for fmt in FORMATS:
        ok = [s for s in lines if re.match(rf"gemm {fmt} neon = portable bits .*: ok$", s)]
        assert len(ok) == 5, fmt


def test_without_i8mm_the_sdot_kernels_give_the_same_bits(selftest: Path) -> None:
    """On a core with the dot product but without FEAT_I8MM (Cortex-A76) the library takes the
    SDOT kernels, and every check passes with them too: the portable bits for every format (the
    integer sums are exact either way), and no SMMLA reached where it would fault."""
    r = _qemu(selftest, "cortex-a76")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "OK"
    assert lines[1] == "int8 products: SDOT (no FEAT_I8MM)"
    _assert_gemm_bits(lines)
    for fmt in FORMATS:
        assert any(s.startswith(f"gemm {fmt} exact integer sums") for s in lines), fmt


def _assert_attention_bits(lines: list[str]) -> None:
    """Every attention shape ran with each of the three products and gave the portable table's
    bits."""
    for products in ("f32", "bf16", "bf16-pv"):
        got = [s for s in lines if s.startswith(f"attention products={products} ")]
        assert len(got) == ATTENTION_SHAPES, (products, got)
        assert all(": bit-identical to portable; vs float64" in s for s in got), got
        assert any("dk=192 dv=128" in s and "window=29 sinks=1" in s for s in got)
        assert any("dk=40 dv=24" in s for s in got)  # not multiples of 16: the generic body
        assert any("v~2^-125" in s for s in got)  # sums below FLT_MIN (bf16: flushed)
        assert any("a sum rounding up to FLT_MIN" in s for s in got)


def test_without_bf16_attention_falls_back_to_the_emulation(selftest: Path) -> None:
    """On a core with the dot-product extension but without FEAT_BF16 (Cortex-A76) the library
    says so and bf16 attention takes the portable emulation: still the portable bits on every
    shape (as are the fp32 products of the NEON task)."""
    r = _qemu(selftest, "cortex-a76", "attention")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "bf16 attention products: emulated (no FEAT_BF16)"
    assert lines[-1] == "OK"
    _assert_attention_bits(lines)


@pytest.mark.parametrize(
    ("what", "old", "new", "products"),
    [
        # the even pair element's product first instead of the odd one's (vdpbf16ps's order)
        ("order", "vbfmlaltq_f32", "vbfmlalbq_f32", "bf16"),
        # no flush of the BFMLAL results below FLT_MIN
        ("flush", "return ftz_f4(vbfmlalbq_f32(acc, a, b));", "return vbfmlalbq_f32(acc, a, b);",
         "bf16"),
        # the row sum's last two steps pairwise in lane order instead of the 16-lane tree's
        ("tree", "return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);", "return vaddvq_f32(x);",
         "f32"),
    ],
)  # fmt: skip
def test_attention_bit_checks_fail_on_a_changed_kernel(
    selftest: Path, tmp_path: Path, what: str, old: str, new: str, products: str
) -> None:
    """The attention checks are able to fail: each change to htp_attn_neon.c below stays within
    the float64 tolerance but not the portable table's bits, and the self-test reports it (the
    bf16 ones only because QEMU's `max` CPU runs the native task)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(PKG / "csrc", csrc)
    src = (csrc / "htp_attn_neon.c").read_text()
    if what == "order":  # swap the two instructions
        broken = src.replace(old, "@@").replace(new, old).replace("@@", new)
    else:
        broken = src.replace(old, new)
    assert broken != src, f"htp_attn_neon.c has no {old!r}"
    (csrc / "htp_attn_neon.c").write_text(broken)
    r = _qemu(mix.build_selftest(tmp_path / "broken", csrc, reuse=selftest), "max", "attention")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr
    assert r.stdout.splitlines()[-1] == "FAILED"
    assert re.search(
        rf"^attention products={products} .*: NOT the bits of portable; vs float64", r.stdout, re.M
    ), r.stdout


def test_without_dotprod_the_library_reports_portable(selftest: Path) -> None:
    """On a core without the dot-product extension (Cortex-A53) the best level is the
    portable one, so the NEON table is never dispatched where SDOT would fault."""
    r = _qemu(selftest, "cortex-a53")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "NEON dot-product level not available (best = 0)" in r.stdout


@pytest.mark.parametrize(("what", "call", "cpu"), [
    ("dot product", r"v\w*dotq\w*_s32", "cortex-a76"),
    ("matrix product", r"(?<!int32x4_t )neon_smmla", "max"),
])  # fmt: skip
def test_selftest_fails_when_a_product_is_off_by_one(
    selftest: Path, tmp_path: Path, what: str, call: str, cpu: str
) -> None:
    """The self-test is able to fail: with every int8 dot-product (SDOT, run on a core without
    FEAT_I8MM) or matrix-product (SMMLA, on one with it) call of the NEON kernels adding 1 to its
    accumulator, it reports mismatches and exits 1."""
    csrc = tmp_path / "csrc"
    shutil.copytree(PKG / "csrc", csrc)
    src = (csrc / "htp_neon.c").read_text()
    broken, n = re.subn(rf"\b({call})\(([^,()]+),", r"\1(vaddq_s32(\2, vdupq_n_s32(1)),", src)
    assert n >= 1, f"htp_neon.c has no int8 {what} call to break"
    (csrc / "htp_neon.c").write_text(broken)
    r = _qemu(mix.build_selftest(tmp_path / "broken", csrc, reuse=selftest), cpu, "--first-failure")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr
    assert r.stdout.splitlines()[-1] == "FAILED"
    assert re.search(r"^gemm q4_0 act=q8 neon .*float64 reference", r.stdout, re.M)


def test_instruction_mix_per_tile(selftest: Path, tmp_path: Path) -> None:
    """tools/neon_instr_mix.py counts what the kernels execute: the NEON table has its own
    kernel for each format counted (Q4_0, Q8_0, Q4_K, Q6_K, Q5_K, MXFP4), each issues exactly
    1024 / 16 = 64 SDOT per 32x32 tile and token (one SDOT is 16 int8 MACs) and none in its
    per-tile setup, and fewer instructions per tile-token than the portable Q4_0 kernel, which
    issues none. The i8mm table's kernels (traced where the library picks them: QEMU's max CPU)
    execute 1024 / 32 = 32 SMMLA per tile and token (32 MACs each) and no SDOT for an even token
    count, while a single token takes the 64 SDOT of the dot-product form. Every count is
    non-negative where measured directly. The attention tasks are counted per fully visible
    key block of 64 queries x 64 keys (dk = dv = 64): the bf16 task issues exactly
    64 * 64 * (dk + dv) / 4 BFMLALB / BFMLALT (4 MACs each), the fp32 task at least as many
    float instructions (its FMLA) and no bf16 ones, the portable task none, and each NEON task
    fewer instructions than the portable task with the same products."""
    out = tmp_path / "mix.json"
    r = subprocess.run(
        [sys.executable, str(PKG / "tools" / "neon_instr_mix.py"), "--exe", str(selftest),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    labels = [label for label in res if label != "executable" and "per_tile" in res[label]]
    neon_fmts = ("q4_0", "q8_0", "q4_k", "q6_k", "q5_k", "mxfp4")
    assert {*(f"neon_{f}" for f in neon_fmts), "portable_q4_0"} <= set(labels)
    port = res["portable_q4_0"]
    for fmt in neon_fmts:
        neon = res[f"neon_{fmt}"]
        assert neon["function"].endswith("_neon"), (fmt, neon["function"])
        assert neon["per_tile_per_token"]["sdot"] == 1024 // 16, fmt
        assert neon["per_tile_setup"]["sdot"] == 0, fmt
        assert neon["per_tile"]["2"]["sdot"] == 2 * 1024 // 16, fmt
        assert neon["per_tile_per_token"]["total"] < port["per_tile_per_token"]["total"], fmt
        assert neon["per_tile_per_token"]["mmla"] == 0 and neon["cpu"] == "cortex-a76", fmt
        mm = res[f"neon_i8mm_{fmt}"]
        assert mm["function"].endswith("_i8mm") and mm["cpu"] == "max", (fmt, mm["function"])
        assert (mm["per_tile_per_token"]["mmla"], mm["per_tile_per_token"]["sdot"]) == (32, 0)
        assert (mm["per_tile_setup"]["mmla"], mm["per_tile_setup"]["sdot"]) == (0, 0), fmt
        for nt in (2, 4, 8):
            assert (mm["per_tile"][str(nt)]["mmla"], mm["per_tile"][str(nt)]["sdot"]) == (
                nt * 1024 // 32, 0), (fmt, nt)  # fmt: skip
        assert (mm["per_tile"]["1"]["mmla"], mm["per_tile"]["1"]["sdot"]) == (0, 1024 // 16)
        assert mm["per_tile_per_token"]["total"] < port["per_tile_per_token"]["total"], fmt
    for label in labels:
        if res[label]["function"].endswith("_portable"):
            assert all(v["sdot"] == 0 for v in res[label]["measured"].values()), label
    for label in labels:
        for counts in (*res[label]["measured"].values(), *res[label]["per_tile"].values()):
            assert all(v >= 0 for v in counts.values()), label
            assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
        m = res[label]["measured"]
        assert m["kb=2,nt=1"]["total"] > m["kb=1,nt=1"]["total"] > 0, label
    att = {label: res[label] for label in res if label.startswith("attention_")}
    assert set(att) == {f"attention_{t}_{p}" for t in ("neon", "portable") for p in ("f32", "bf16")}
    assert att["attention_neon_f32"]["function"] == "htp_attn_task_neon"
    assert att["attention_neon_bf16"]["function"] == "htp_attn_bf16_task_neon"
    dk = att["attention_neon_bf16"]["dk"]
    macs_per_4 = 64 * 64 * (dk + att["attention_neon_bf16"]["dv"]) // 4
    assert att["attention_neon_bf16"]["per_key_block"]["bf16"] == macs_per_4
    assert att["attention_neon_f32"]["per_key_block"]["bf16"] == 0
    assert att["attention_neon_f32"]["per_key_block"]["fp"] >= macs_per_4
    for p in ("f32", "bf16"):
        neon_t, port_t = att[f"attention_neon_{p}"], att[f"attention_portable_{p}"]
        assert all(v["bf16"] == 0 for v in port_t["measured"].values()), p
        assert neon_t["per_key_block"]["total"] < port_t["per_key_block"]["total"], p
    for label, a in att.items():
        for counts in a["measured"].values():
            assert all(v >= 0 for v in counts.values()), label
            assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
        m = a["measured"]
        assert m["nkb=2"]["total"] > m["nkb=1"]["total"] > 0, label
