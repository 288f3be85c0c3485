"""The cffi declarations agree with csrc/htp.h (they are generated from it by build_ffi.py: these
tests catch a generator that drops or mangles something), and the ABI's sizes are as asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from estream_htp import _core

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "htp.h"
ffi, lib = _core.ffi, _core.lib


def _header() -> str:
    if not HEADER.exists():  # pragma: no cover - tests run from the source tree
        pytest.skip("csrc/htp.h is not next to the tests")
    return re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)


def test_every_function_in_the_header_is_bound() -> None:
    names = re.findall(r"^\s*[\w ]+?\**\s*\b(htp_\w+)\s*\(", _header(), flags=re.M)
    assert len(names) >= 15
    for name in names:
        assert hasattr(lib, name), f"{name} is declared in htp.h but not in the bindings"


def test_every_enum_constant_and_define_matches() -> None:
    text = _header()
    consts = dict(re.findall(r"\b(HTP_[A-Z0-9_]+)\s*=\s*(\d+)", text))
    consts.update(re.findall(r"#define\s+(HTP_[A-Z0-9_]+)\s+(\d+)", text))
    assert len(consts) > 40
    for name, value in consts.items():
        assert getattr(lib, name) == int(value), name


def test_static_asserted_sizes_match_the_bindings() -> None:
    sizes = re.findall(r"_Static_assert\(sizeof\((\w+)\) == (\d+)", _header())
    assert {n for n, _ in sizes} >= {"htp_op_desc", "htp_buffer_desc", "htp_backend_desc"}
    for name, size in sizes:
        assert ffi.sizeof(name) == int(size), name


def test_struct_fields_match_the_header() -> None:
    text = _header()
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\}", text, flags=re.S):
        declared = re.findall(r"(\w+)(?:\[\w+\])?\s*[;,]", body)
        fields = [f for f, _ in ffi.typeof(name).fields]
        assert fields == declared, name
    assert ffi.offsetof("htp_op_desc", "p") == 16 + 16 * lib.HTP_MAX_REFS
