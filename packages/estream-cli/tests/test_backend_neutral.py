"""The engine asks its backend for memory and capabilities and never branches on which kind of
backend it is: no source file of the estream-cli distribution compares a backend's ``kind``,
and the `estream` library compares no value against a backend's name. (Reporting the kind, as
the metrics do, is not a comparison.)"""

from __future__ import annotations

import ast
from pathlib import Path

import estream
import estream_cli
import estream_htp as htp

SOURCES = sorted(
    [*Path(estream.__file__).parent.rglob("*.py"), *Path(estream_cli.__file__).parent.rglob("*.py")]
)


def kind_branches(source: str, names: frozenset[str] = frozenset()) -> list[int]:
    """Lines of the comparisons in ``source`` that read a ``kind`` (an attribute or a name) or
    compare with one of ``names``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            if (
                (isinstance(operand, ast.Attribute) and operand.attr == "kind")
                or (isinstance(operand, ast.Name) and operand.id == "kind")
                or (isinstance(operand, ast.Constant) and operand.value in names)
            ):
                lines.append(node.lineno)
                break
    return lines


def test_the_checker_finds_kind_branches() -> None:
    """The checker sees every spelling of a kind test (==, !=, in, not in, a bare name, a
    backend name compared as a string) and passes reporting code and keyword arguments."""
    found = kind_branches(
        "if be.kind == 'host': pass\n"
        "x = self.backend.kind != 'host'\n"
        "y = graph.backend.kind in ('host',)\n"
        "z = kind not in BACKENDS\n"
        "w = 'hexagon' == name\n"
        "m = {'backend': be.kind}\n"
        "i = np.argsort(a, kind='stable')\n",
        frozenset(htp.BACKENDS),
    )
    assert found == [1, 2, 3, 4, 5]


def test_no_source_branches_on_the_backend_kind() -> None:
    """No file of `estream` or `estream_cli` compares a ``kind``; `estream` (the engine
    library) compares nothing with a backend's name either."""
    assert len(SOURCES) > 20  # the walk found the packages
    lib = Path(estream.__file__).parent
    bad = []
    for path in SOURCES:
        names = frozenset(htp.BACKENDS) if lib in path.parents else frozenset()
        bad += [f"{path.name}:{line}" for line in kind_branches(path.read_text(), names)]
    assert not bad, f"backend kind branches: {bad}"
