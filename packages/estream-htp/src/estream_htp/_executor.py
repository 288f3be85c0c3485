"""The executor process of a host-process backend: ``python -m estream_htp._executor FD``.

Everything happens in C (`htp_executor_serve`): it maps the buffers the host registers (their
file descriptors arrive over the socket FD by SCM_RIGHTS), takes descriptors from the shared
ring, validates and runs them, and exits when the host closes the socket or asks it to."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m estream_htp._executor SOCKET_FD", file=sys.stderr)
        return 2
    from estream_htp._ffi import lib

    return int(lib.htp_executor_serve(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
