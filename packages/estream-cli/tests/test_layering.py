"""The estream-cli distribution's two import packages: the `estream` library and the `estream_cli`
command. The command imports the library, never the reverse, and embedding the engine loads no
part of the command."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import estream
import estream_cli

LIB = Path(estream.__file__).parent
CLI = Path(estream_cli.__file__).parent


def package_of(path: Path) -> str:
    """The dotted package a source file under `src/` belongs to."""
    parts = path.relative_to(LIB.parent).parts
    return ".".join(parts[:-1])


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of the modules a source text imports (at any depth, so lazy imports inside
    functions count), relative imports resolved against `package`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                names.add(".".join([*base, node.module] if node.module else base))
            else:
                names.add(node.module or "")
    return names


def file_imports(path: Path) -> set[str]:
    return imported_modules(path.read_text(), package_of(path))


def test_import_scan_sees_an_import_of_the_command() -> None:
    """The scan below notices a library module importing the command, absolute or relative, at
    top level or inside a function, and resolves relative imports to the right package."""
    lazy = "def f():\n    from estream_cli.main import main\n    return main\n"
    assert "estream_cli.main" in imported_modules(lazy, "estream.models")
    assert "estream_cli" in imported_modules("import estream_cli\n", "estream")
    assert "estream_cli.options" in imported_modules("from ..options import x\n", "estream_cli.a")
    olmoe = file_imports(LIB / "models" / "olmoe.py")
    assert {"estream.packed", "estream.models.ops"} <= olmoe


def test_library_never_imports_the_command() -> None:
    """No module under `estream/` imports `estream_cli` (or anything under it)."""
    offenders = {
        str(path.relative_to(LIB.parent)): sorted(
            name
            for name in file_imports(path)
            if name == "estream_cli" or name.startswith("estream_cli.")
        )
        for path in sorted(LIB.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 20  # the scan covered the library, not an empty directory


def test_command_modules_use_the_library_by_absolute_name() -> None:
    """Every module of the command reaches the library as `estream...`; none holds a relative
    import of a module that is not part of the command."""
    own = {p.stem for p in CLI.glob("*.py")}
    for path in sorted(CLI.glob("*.py")):
        for name in file_imports(path):
            if name.startswith("estream_cli."):
                assert name.split(".")[1] in own, (path.name, name)


def test_import_estream_loads_no_command_module() -> None:
    """`import estream` (and loading a model's forward passes, the tokenizer, tasks and
    evaluation) leaves `estream_cli` and `argparse` out of `sys.modules`, in a fresh process."""
    code = (
        "import json, sys\n"
        "import estream, estream.models, estream.tokenizer, estream.tasks, estream.evaluation\n"
        "import estream.profiling, estream.config\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m == 'argparse' or m.split('.')[0] == 'estream_cli')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    # The same probe does see the command once it is imported.
    code_cli = code.replace(
        "import estream.profiling", "import estream_cli.main, estream.profiling"
    )
    out = subprocess.run(
        [sys.executable, "-c", code_cli], capture_output=True, text=True, check=True
    )
    assert "estream_cli.main" in json.loads(out.stdout)
    assert "argparse" in json.loads(out.stdout)


def test_public_api_names() -> None:
    """`estream` exports the engine's public names, each defined in the library itself."""
    for name in estream.__all__:
        obj = getattr(estream, name)
        module = getattr(obj, "__module__", "estream.engine")
        assert module.startswith("estream."), (name, module)
    assert callable(estream.load)
    assert issubclass(estream.PackError, estream.EStreamError)
