"""Run the estream-htp op tests against a library built with -fsanitize=address,undefined.

`nox -s sanitize` installs the package with ESTREAM_HTP_SANITIZE=1 and runs this script. It
checks that the installed extension really is instrumented, preloads libasan (Python itself is
not instrumented), runs pytest on the package's tests, and fails on any sanitizer report.
Extra arguments are passed to pytest.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
REPORT_MARKERS = (
    "ERROR: AddressSanitizer",
    "runtime error:",
    "ERROR: LeakSanitizer",
    "SUMMARY: UndefinedBehaviorSanitizer",
)


def _extension_path() -> Path:
    # find the top-level package without importing it (importing would load the
    # instrumented extension before libasan is preloaded)
    spec = importlib.util.find_spec("estream_htp")
    if spec is None or spec.origin is None:
        sys.exit("estream_htp is not installed")
    found = sorted(Path(spec.origin).parent.glob("_ffi*.so"))
    if not found:
        sys.exit("estream_htp._ffi extension is missing (was cffi in build-system.requires?)")
    return found[0]


def main() -> int:
    ext = _extension_path()
    if b"__asan_init" not in ext.read_bytes() or b"__ubsan_handle" not in ext.read_bytes():
        print(
            f"{ext} is not built with -fsanitize=address,undefined (set ESTREAM_HTP_SANITIZE=1 when installing)"
        )
        return 2
    cc = os.environ.get("CC", "gcc")
    libasan = subprocess.run(
        [cc, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(libasan):
        print(f"could not locate libasan.so via {cc} -print-file-name (got {libasan!r})")
        return 2
    env = dict(os.environ)
    env["LD_PRELOAD"] = libasan
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(TESTS),
        "-q",
        "-p",
        "no:cacheprovider",
        *sys.argv[1:],
    ]
    print("running:", " ".join(cmd), f"(LD_PRELOAD={libasan})", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    found = [m for m in REPORT_MARKERS if m in proc.stdout or m in proc.stderr]
    if found:
        print(f"sanitizer reported: {found}")
        return 1
    if proc.returncode != 0:
        print(f"pytest failed with exit code {proc.returncode}")
        return proc.returncode
    print("sanitized op tests: clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
