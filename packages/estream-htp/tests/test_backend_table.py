"""A C backend is a table of functions: the host execution context and the remote executor each
implement it, and only the constructor (`htp_backend_init`) compares a backend's kind; every
other function of csrc/htp_backend.c calls the table."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KIND_TEST = re.compile(r"\bkind\s*[!=]=|[!=]=\s*HTP_BACKEND_(HOST|REMOTE)\b")
FUNCTION = re.compile(r"^[A-Za-z_][\w\s\*]*?\b(\w+)\(")


def kind_tests(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every comparison with a backend kind in C ``source``
    (a function starts at a line that opens a definition in column 0)."""
    found = []
    function = ""
    for n, line in enumerate(source.splitlines(), 1):
        m = FUNCTION.match(line)
        if m and not line.rstrip().endswith(";"):
            function = m.group(1)
        if KIND_TEST.search(line) and not line.lstrip().startswith(("/*", "*")):
            found.append((function, n))
    return found


def test_the_checker_finds_kind_tests_and_their_function() -> None:
    """Both spellings of a kind test are found and attributed to the function they are in."""
    src = (
        "static int f(htp_backend *b) {\n"
        "    if (b->kind == HTP_BACKEND_REMOTE) return 1;\n"
        "    return 0;\n"
        "}\n"
        "htp_status g(void) {\n"
        "    return x != HTP_BACKEND_HOST;\n"
        "}\n"
        "uint32_t h(const htp_backend *b) { return b->kind; }\n"
    )
    assert kind_tests(src) == [("f", 2), ("g", 6)]


def test_only_the_constructor_tests_the_kind() -> None:
    """In htp_backend.c every kind comparison is inside `htp_backend_init`, and the backend
    dispatches through its table (`b->vt->`) everywhere else."""
    src = (CSRC / "htp_backend.c").read_text()
    found = kind_tests(src)
    assert found, "the constructor picks the table by kind"
    assert {f for f, _ in found} == {"htp_backend_init"}, found
    assert src.count("b->vt->") >= 8
