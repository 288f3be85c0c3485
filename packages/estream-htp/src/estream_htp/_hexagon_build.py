"""Building the Hexagon executor: the library's C sources, tools/htp_executor_main.c and the
freestanding runtime in csrc/hexagon/, compiled with clang for ``hexagon-unknown-linux-musl``
(v67, HVX 128-byte) and linked statically with lld. The result is a Linux user-mode Hexagon
program that ``qemu-hexagon-static -cpu v67`` runs (the ``hexagon`` backend's executor).

Kept free of imports from the package so that setup.py can load it by path.

* ``ESTREAM_HTP_HEXAGON_CLANG`` / ``ESTREAM_HTP_HEXAGON_LLD`` / ``ESTREAM_HTP_QEMU_HEXAGON``
  override the tool names (default ``clang-19``, ``ld.lld-19``, ``qemu-hexagon-static``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CFLAGS",
    "RUNTIME",
    "SOURCES",
    "build_executor",
    "build_program",
    "missing_tools",
    "source_digest",
    "tool",
]

# the same translation units as the host library, plus the HVX table, the runtime and main()
SOURCES = [
    "htp_pool.c",
    "htp_core.c",
    "htp_attention.c",
    "htp_expert.c",
    "htp_hvx.c",
    "htp_backend.c",
    "htp_remote.c",
    "htp_protocol.c",
    "htp_executor.c",
    "hexagon/hx_runtime.c",
    "hexagon/hx_math.c",
]
MAIN = "tools/htp_executor_main.c"

CFLAGS = [
    "--target=hexagon-unknown-linux-musl",
    "-mv67",
    "-mhvx",
    "-mhvx-length=128b",
    "-O2",
    "-std=gnu11",
    "-ffreestanding",
    "-nostdlibinc",
    "-fno-strict-aliasing",
    # no fused multiply-adds: the host's portable build has none either, so float results of
    # the same source agree bit for bit
    "-ffp-contract=off",
    # clang-19's post-register-allocation RDF optimization on Hexagon miscompiles: in the
    # expert op's route loop it left the loop counter in a caller-saved register (r8) across
    # the indirect call to the row quantizer, which clobbered it, and the loop never ended.
    # Off for the whole program, so no other function can carry the same fault.
    "-mllvm",
    "-rdf-opt=false",
    "-Wall",
    "-Wno-unused-function",
]
_DEFAULTS = {
    "clang": ("ESTREAM_HTP_HEXAGON_CLANG", "clang-19"),
    "lld": ("ESTREAM_HTP_HEXAGON_LLD", "ld.lld-19"),
    "qemu": ("ESTREAM_HTP_QEMU_HEXAGON", "qemu-hexagon-static"),
}


def tool(name: str, env: Mapping[str, str] | None = None) -> str:
    """The command name of ``clang``, ``lld`` or ``qemu`` (environment overrides)."""
    var, default = _DEFAULTS[name]
    return (env if env is not None else os.environ).get(var) or default


def missing_tools(names: tuple[str, ...] = ("clang", "lld", "qemu")) -> list[str]:
    """The tools among ``names`` that are not on PATH (by command name)."""
    return [tool(n) for n in names if shutil.which(tool(n)) is None]


def _files(pkg: Path) -> list[Path]:
    csrc = pkg / "csrc"
    headers = sorted(csrc.glob("*.h")) + sorted((csrc / "hexagon" / "include").rglob("*.h"))
    return [*(csrc / s for s in SOURCES), pkg / MAIN, *headers]


@functools.lru_cache(maxsize=4)
def _compiler_id(clang: str) -> str:
    try:
        return subprocess.run(
            [clang, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "no compiler"


def source_digest(pkg: Path, extra: list[str] | None = None) -> str:
    """A hash of every input of the build (sources, headers, flags, the compiler's version)."""
    h = hashlib.sha256()
    h.update(_compiler_id(tool("clang")).encode())
    for f in _files(pkg):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    h.update(" ".join(CFLAGS + (extra or [])).encode())
    return h.hexdigest()[:16]


RUNTIME = ["hexagon/hx_runtime.c", "hexagon/hx_math.c"]


def build_executor(pkg: Path, out: Path, *, extra_cflags: list[str] | None = None) -> Path:
    """Compile and link the executor from the package tree ``pkg`` (the directory holding
    csrc/ and tools/) into ``out``, written under a temporary name and renamed into place."""
    return build_program(
        pkg, [pkg / "csrc" / s for s in SOURCES] + [pkg / MAIN], out, extra_cflags=extra_cflags
    )


def build_program(
    pkg: Path, sources: list[Path], out: Path, *, extra_cflags: list[str] | None = None
) -> Path:
    """Compile ``sources`` (with the runtime among them, or a program of the runtime alone:
    pass ``RUNTIME`` files) for Hexagon and link them statically into ``out``."""
    miss = missing_tools(("clang", "lld"))
    if miss:
        raise FileNotFoundError(
            "building the Hexagon executor needs " + " and ".join(miss) + " (Debian: apt-get "
            "install clang-19 lld-19)"
        )
    csrc = pkg / "csrc"
    flags = [
        *CFLAGS,
        "-isystem",
        str(csrc / "hexagon" / "include"),
        "-I",
        str(csrc),
        *(extra_cflags or []),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="htp-hexagon-") as tmp:
        objs = []
        for src in sources:
            obj = Path(tmp) / (src.stem + ".o")
            # the runtime must not turn its own loops back into memcpy/memset calls
            no_builtin = ["-fno-builtin"] if src.parent.name == "hexagon" else []
            subprocess.run(
                [tool("clang"), *flags, *no_builtin, "-c", str(src), "-o", str(obj)],
                check=True,
                capture_output=True,
                text=True,
            )
            objs.append(str(obj))
        part = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            subprocess.run(
                [tool("lld"), "-static", "--gc-sections", "-o", str(part), *objs],
                check=True,
                capture_output=True,
                text=True,
            )
            part.chmod(0o755)
            part.replace(out)
        finally:
            part.unlink(missing_ok=True)
    return out
