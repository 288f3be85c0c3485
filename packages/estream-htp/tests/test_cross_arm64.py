"""The arm64 (NEON dot-product) kernels, cross-compiled and run under qemu-aarch64.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user; skipped (with the reason) where they are
not installed. Nothing here runs on arm64 hardware."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]
CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")


@pytest.mark.skipif(not (CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64")
def test_neon_kernels_match_portable_under_qemu(tmp_path: Path) -> None:
    exe = tmp_path / "neon_selftest"
    csrc = PKG / "csrc"
    sources = sorted(str(p) for p in csrc.glob("*.c"))
    subprocess.run(
        [CC, "-O2", "-std=gnu11", "-pthread", "-static", f"-I{csrc}", *sources,
         str(PKG / "tools" / "neon_selftest.c"), "-lm", "-o", str(exe)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    r = subprocess.run([QEMU, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")
    # without the dot-product extension the library must fall back to portable kernels
    r = subprocess.run(
        [QEMU, "-cpu", "cortex-a53", str(exe)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "not available" in r.stdout
