"""cffi build script (API / out-of-line mode): compiles csrc/ into ``estream_htp._ffi``."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"

_spec = importlib.util.spec_from_file_location(
    "_htp_buildcfg", HERE / "src/estream_htp/_buildcfg.py"
)
assert _spec and _spec.loader
_cfg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cfg)


def cdef_from_header(text: str) -> str:
    """The cffi declarations of ``htp.h``, generated so they cannot drift from the header.

    Comments, preprocessor lines (except integer ``#define``s), ``extern "C"`` braces and
    static assertions are dropped; struct layouts and enum values are checked by the compiler
    when it builds the extension (API mode)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#define"):
            parts = s.split()
            if len(parts) == 3 and parts[2].isdigit():
                out.append(s)
        elif s.startswith(("#", "_Static_assert", "static_assert", 'extern "C"')) or s == "}":
            continue
        else:
            out.append(line)
    return "\n".join(out)


CDEF = cdef_from_header((CSRC / "htp.h").read_text())

SOURCES = [
    "htp_pool.c",
    "htp_core.c",
    "htp_attention.c",
    "htp_expert.c",
    "htp_x86.c",
    "htp_attn_avx512.c",
    "htp_attn_avx2.c",
    "htp_amx.c",
    "htp_neon.c",
    "htp_attn_neon.c",
    "htp_backend.c",
    "htp_remote.c",
    "htp_protocol.c",
    "htp_executor.c",
]

cflags, ldflags = _cfg.compile_flags(os.environ)

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "estream_htp._ffi",
    '#include "htp.h"',
    # setuptools wants paths relative to setup.py (the build runs from there)
    sources=[os.path.relpath(CSRC / s) for s in SOURCES],
    include_dirs=[os.path.relpath(CSRC)],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
