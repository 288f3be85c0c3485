"""estream-layout installed alone does its job: run by `nox -s build` with the python of a clean
virtualenv into which only estream-layout's wheel (and its PyPI dependencies) was installed.

Usage: ``python standalone_check.py WORKDIR``. Not a pytest module: it must run *outside* the
repository's environments, so it uses nothing but the installed package and the standard library.
Exits non-zero with the reason on the first failure.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def check(cond: bool, msg: str) -> None:
    if not cond:
        sys.exit(f"estream-layout alone: {msg}")


def run(*argv: str, cwd: Path) -> str:
    exe = Path(sys.executable).parent / argv[0]
    check(exe.is_file(), f"console script {argv[0]} was not installed")
    proc = subprocess.run([str(exe), *argv[1:]], cwd=cwd, capture_output=True, text=True)
    check(proc.returncode == 0, f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    names = sorted(
        d.metadata["Name"]
        for d in metadata.distributions()
        if d.metadata["Name"].startswith("estream")
    )
    check(names == ["estream-layout"], f"expected estream-layout alone, found {names}")
    for other in ("estream_arena", "estream_sched", "estream_htp", "estream_cli", "estream"):
        check(importlib.util.find_spec(other) is None, f"{other} is importable")

    import estream_layout
    from estream_layout.gguf_header import read_header
    from estream_layout.synth import VOCAB_DIR, find_vocab

    check("site-packages" in estream_layout.__file__, f"imported from {estream_layout.__file__}")
    vocab = find_vocab("olmoe")
    check(vocab == VOCAB_DIR / "ggml-vocab-mpt.gguf", f"olmoe's vocabulary is {vocab}")
    check((VOCAB_DIR / "LICENSE-llama.cpp").is_file(), "the vocabularies' licence is missing")

    # The `small` preset copies the family's real vocabulary: the wheel's data files are used.
    run("estream-synth", "--arch", "olmoe", "--preset", "small", "-o", "m.gguf", cwd=work)
    run("estream-pack", "m.gguf", "-o", "m.estream", "--no-progress", cwd=work)
    run("estream-pack", "--verify", "m.estream", "--against", "m.gguf", cwd=work)
    info = json.loads(run("estream-pack", "--inspect", "m.estream", "--json", cwd=work))
    check(bool(info), "--inspect printed nothing")
    for f in ("model.gguf", "dense.bin", "experts.bin", "manifest.json"):
        check((work / "m.estream" / f).is_file(), f"m.estream/{f} missing")
    key = "tokenizer.ggml.tokens"
    want, got = read_header(vocab).kv[key], read_header(work / "m.estream" / "model.gguf").kv[key]
    check(list(got) == list(want), "the packed model does not carry the mpt vocabulary")
    print(f"estream-layout {estream_layout.__version__} alone: synth, pack, verify, inspect ok")


if __name__ == "__main__":
    main()
