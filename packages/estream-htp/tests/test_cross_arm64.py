"""The arm64 kernel table (NEON with the dot-product extension), cross-compiled and run under
qemu-aarch64: tools/neon_selftest.c checks it against float64 references and the portable table,
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
    activation format within the fp32 rounding bound of float64; IQ4_NL, Q4_1, Q5_0, Q5_1 and IQ4_XS
    int8 GEMMs giving the portable table's bits on 5 awkward shapes each; F16 / BF16 dense tiles in fp32
    under either act, NEON giving the portable bits, the values read exactly; exact-integer GEMMs
    bit-identical to the int64 dot product and to the portable table, GEMM from Q8 rows and
    with a shared input, the expert op (SwiGLU, ReGLU and SwiGLU-OAI, with and without
    biases), quantization, attention (MLA's head dims with a sliding window and sinks among
    them), SwiGLU, fp32 matmul), and each kind of check ran."""
    r = _qemu(selftest, "max")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "OK"
    for fmt in (
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
    ):
        for act in ("f32", "q8"):
            assert any(re.match(rf"gemm {fmt} act={act} n=\d+ k=\d+ t=\d+: ok$", s) for s in lines)
            assert any(s.startswith(f"expert {fmt} act={act} neon ") for s in lines)
        assert any(s.startswith(f"gemm {fmt} exact integer sums") for s in lines)
        assert any(s.startswith(f"gemm {fmt} from Q8 rows and shared input") for s in lines)
    for fmt in ("iq4_nl", "q4_1", "q5_0", "q5_1", "iq4_xs"):  # the NEON kernel lq_half_neon
        ok = [s for s in lines if re.match(rf"gemm {fmt} neon = portable bits .*: ok$", s)]
        assert len(ok) == 5, fmt
    for fmt in ("f16", "bf16"):  # dense tiles: every shape, fp32 under either act, exact values
        assert sum(bool(re.match(rf"gemm {fmt} n=\d+ k=\d+ t=\d+: ok$", s)) for s in lines) == 8
    assert any(s.startswith("quantize") for s in lines)
    for op in ("attention", "swiglu", "matmul_f32"):
        assert any(s.startswith(op) and "vs float64" in s for s in lines), op
    assert any("dk=192 dv=128" in s and "window=29 sinks=1" in s for s in lines)
    for glu in (0, 1, 2):  # SwiGLU, ReGLU, SwiGLU-OAI with biases on the NEON table
        for act in ("f32", "q8"):
            assert any(
                s.startswith(f"expert q4_0 act={act} neon ") and f"glu={glu} bias=1" in s
                for s in lines
            ), (glu, act)


def test_without_dotprod_the_library_reports_portable(selftest: Path) -> None:
    """On a core without the dot-product extension (Cortex-A53) the best level is the
    portable one, so the NEON table is never dispatched where SDOT would fault."""
    r = _qemu(selftest, "cortex-a53")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "NEON dot-product level not available (best = 0)" in r.stdout


def test_selftest_fails_when_a_dot_product_is_off_by_one(selftest: Path, tmp_path: Path) -> None:
    """The self-test is able to fail: with every int8 dot-product (and matrix-product) call of
    the NEON kernels adding 1 to its accumulator, it reports mismatches and exits 1."""
    csrc = tmp_path / "csrc"
    shutil.copytree(PKG / "csrc", csrc)
    src = (csrc / "htp_neon.c").read_text()
    broken, n = re.subn(
        r"\b(v\w*(?:dot|mmla)q\w*_s32)\(([^,()]+),", r"\1(vaddq_s32(\2, vdupq_n_s32(1)),", src
    )
    assert n >= 1, "htp_neon.c has no int8 dot-product call to break"
    (csrc / "htp_neon.c").write_text(broken)
    r = _qemu(
        mix.build_selftest(tmp_path / "broken", csrc, reuse=selftest), "max", "--first-failure"
    )
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr
    assert r.stdout.splitlines()[-1] == "FAILED"
    assert re.search(r"^gemm q4_0 act=q8 neon .*float64 reference", r.stdout, re.M)


def test_instruction_mix_per_tile(selftest: Path, tmp_path: Path) -> None:
    """tools/neon_instr_mix.py counts what the kernels execute: the NEON Q4_0 kernel issues
    exactly 1024 / 16 = 64 SDOT per 32x32 tile and token (one SDOT is 16 int8 MACs) and none in
    its per-tile setup, the portable kernels none at all, and fewer instructions per tile-token
    than the portable kernel; every tile format's kernel is counted, and every count is
    non-negative where measured directly."""
    out = tmp_path / "mix.json"
    r = subprocess.run(
        [sys.executable, str(PKG / "tools" / "neon_instr_mix.py"), "--exe", str(selftest),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    labels = [label for label in res if label != "executable"]
    assert {"neon_q4_0", "neon_q8_0", "neon_q4_k", "neon_q6_k", "portable_q4_0"} <= set(labels)
    neon, port = res["neon_q4_0"], res["portable_q4_0"]
    assert neon["per_tile_per_token"]["sdot"] == 1024 // 16
    assert neon["per_tile_setup"]["sdot"] == 0
    assert neon["per_tile"]["2"]["sdot"] == 2 * 1024 // 16
    for label in labels:
        if res[label]["function"].endswith("_portable"):
            assert all(v["sdot"] == 0 for v in res[label]["measured"].values()), label
    assert neon["per_tile_per_token"]["total"] < port["per_tile_per_token"]["total"]
    for label in labels:
        for counts in (*res[label]["measured"].values(), *res[label]["per_tile"].values()):
            assert all(v >= 0 for v in counts.values()), label
            assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
        m = res[label]["measured"]
        assert m["kb=2,nt=1"]["total"] > m["kb=1,nt=1"]["total"] > 0, label
