"""Builds the cffi extension (build_ffi.py) and, when clang-19 and ld.lld-19 are installed, the
Hexagon executor shipped as package data (estream_htp/hexagon/htp_executor)."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _hexagon_build():
    spec = importlib.util.spec_from_file_location(
        "_htp_hexagon_build", HERE / "src/estream_htp/_hexagon_build.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithHexagon(build_py):
    def run(self):
        super().run()
        hb = _hexagon_build()
        if hb.missing_tools(("clang", "lld")):
            print(
                "estream-htp: "
                + ", ".join(hb.missing_tools(("clang", "lld")))
                + " not found: no Hexagon executor in this build",
                file=sys.stderr,
            )
            return
        out = Path(self.build_lib) / "estream_htp" / "hexagon" / "htp_executor"
        hb.build_executor(HERE, out)


setup(cffi_modules=["build_ffi.py:ffibuilder"], cmdclass={"build_py": BuildPyWithHexagon})
