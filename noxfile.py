"""Developer sessions for the EStream monorepo.

`nox -s tests` runs every package's tests, each package installed on its own (built, not
editable) in its own virtualenv, then the cross-package `integration/` tests. `nox -s demo` is
the main job. Benchmarks are `bench_*` sessions and are never part of the default run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PKG = ROOT / "packages"
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Lower packages: each stands alone (no estream dependency).
LOWER = ["layout", "arena", "sched", "htp"]
ALL = [*LOWER, "cli"]


def pkg(name: str, extra: str | None = None) -> str:
    path = str(PKG / f"estream-{name}")
    return f"{path}[{extra}]" if extra else path


def _clean_htp_build() -> None:
    """setuptools reuses up-to-date objects in the in-tree build/ whatever the flags: a
    sanitizer build must never leak into a normal one (or the reverse)."""
    shutil.rmtree(PKG / "estream-htp" / "build", ignore_errors=True)


def _pytest(session: nox.Session, where: Path, *extra: str) -> None:
    args = session.posargs or []
    session.run(
        "python",
        "-m",
        "pytest",
        str(where),
        "-q",
        "-p",
        "no:cacheprovider",
        *extra,
        *args,
        env={"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")},
    )


def _package_session(session: nox.Session, name: str) -> None:
    # Install (build) this package alone, plus its test extra; reinstall so edits are seen.
    if name == "htp":
        _clean_htp_build()
    session.install("--force-reinstall", "--no-deps", pkg(name))
    session.install(pkg(name, "test"))
    _pytest(session, PKG / f"estream-{name}" / "tests")


@nox.session
def layout(session: nox.Session) -> None:
    """estream-layout alone: GGUF reading, tile formats, packing, synthetic models."""
    _package_session(session, "layout")


@nox.session
def arena(session: nox.Session) -> None:
    """estream-arena alone: arena, residency protocol, loader."""
    _package_session(session, "arena")


@nox.session
def sched(session: nox.Session) -> None:
    """estream-sched alone: max-plus model, simulator, configurator."""
    _package_session(session, "sched")


@nox.session
def htp(session: nox.Session) -> None:
    """estream-htp alone: the C kernels (host backend) against float64 references."""
    _package_session(session, "htp")


def _install_all(session: nox.Session, *extras: str) -> None:
    _clean_htp_build()
    session.install("--force-reinstall", "--no-deps", *[pkg(n) for n in ALL])
    session.install(*[pkg(n) for n in LOWER], pkg("cli", ",".join(extras) if extras else None))


@nox.session
def cli(session: nox.Session) -> None:
    """estream-cli with its four siblings: engine, command, tasks, tokenizer."""
    _install_all(session, "test")
    _pytest(session, PKG / "estream-cli" / "tests")


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package contracts and end-to-end correctness against float64 references."""
    _install_all(session, "test")
    _pytest(session, ROOT / "integration")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: every package on its own, then integration/."""
    for name in [*ALL, "integration"]:
        session.notify(name)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job, end to end, on a small synthetic model."""
    _install_all(session)
    session.run("estream", "demo", *session.posargs)


@nox.session
def sanitize(session: nox.Session) -> None:
    """estream-htp built with -fsanitize=address,undefined, running the op tests."""
    session.env["ESTREAM_HTP_SANITIZE"] = "1"
    _clean_htp_build()
    try:
        session.install("--force-reinstall", "--no-deps", "--no-cache-dir", pkg("htp"))
        session.install(pkg("htp", "test"))
    finally:
        _clean_htp_build()
    script = PKG / "estream-htp" / "tools" / "run_sanitized.py"
    session.run("python", str(script), *session.posargs)


def _bench(session: nox.Session, script: Path, *, all_pkgs: bool = False, name: str = "") -> None:
    if all_pkgs:
        _install_all(session, "bench")
    else:
        if name == "htp":
            _clean_htp_build()
        session.install("--force-reinstall", "--no-deps", pkg(name))
        session.install(pkg(name, "bench"))
    (ROOT / "bench-results").mkdir(exist_ok=True)
    session.run("python", str(script), *session.posargs)


@nox.session
def bench_layout(session: nox.Session) -> None:
    """Packing throughput and peak RSS on the olmoe-1b-7b preset."""
    _bench(session, PKG / "estream-layout" / "bench" / "bench_layout.py", name="layout")


@nox.session
def bench_kernels(session: nox.Session) -> None:
    """Kernel GFLOP/s vs numpy/BLAS float32 on OLMoE-1B-7B shapes."""
    _bench(session, PKG / "estream-htp" / "bench" / "bench_kernels.py", name="htp")


@nox.session
def bench_arena(session: nox.Session) -> None:
    """Loader bandwidth over G x Q on a cold file vs raw O_DIRECT bandwidth."""
    _bench(session, PKG / "estream-arena" / "bench" / "bench_arena.py", name="arena")


@nox.session
def bench_sched(session: nox.Session) -> None:
    """Configurator selection time on stored profiles."""
    _bench(session, PKG / "estream-sched" / "bench" / "bench_sched.py", name="sched")


@nox.session
def bench_tokenizer(session: nox.Session) -> None:
    """Tokenization speed (tokens/s) next to HF tokenizers and llama.cpp when installed."""
    _bench(session, PKG / "estream-cli" / "bench" / "bench_tokenizer.py", all_pkgs=True)


@nox.session
def bench_engine(session: nox.Session) -> None:
    """End-to-end prefill: stream vs resident (vs llama.cpp when available)."""
    _bench(session, ROOT / "integration" / "bench" / "bench_engine.py", all_pkgs=True)


@nox.session
def bench_scale(session: nox.Session) -> None:
    """Qwen3-30B-A3B and Mixtral-8x7B shapes streamed within 2/4 GiB (≈ 80 GB of disk, hours)."""
    _bench(session, ROOT / "integration" / "bench" / "bench_scale.py", all_pkgs=True)


@nox.session
def parity(session: nox.Session) -> None:
    """Engine vs llama.cpp (llama-cpp-python) logits on the same synthetic GGUF."""
    _bench(session, ROOT / "integration" / "bench" / "parity.py", all_pkgs=True)
