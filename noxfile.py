"""Developer sessions for the EStream monorepo.

`nox -s tests` runs every package's tests, each package installed on its own (built, not
editable) in its own virtualenv, then the cross-package `integration/` tests. `nox -s demo` is
the main job. Benchmarks are `bench_*` sessions and are never part of the default run; each
records its run in benchmarks/results/, and `nox -s bench_report` renders the newest of each
into docs/benchmarks.md.
"""

from __future__ import annotations

import email.parser
import os
import re
import shlex
import shutil
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import nox
from packaging.requirements import Requirement

ROOT = Path(__file__).parent
PKG = ROOT / "packages"
sys.path.insert(0, str(ROOT))  # benchmarks/: the results recorder and report (stdlib only)

from benchmarks import record as bench_record  # noqa: E402
from benchmarks import report as bench_report_module  # noqa: E402

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


# The hexagon backend's toolchain (compiler, linker, user-mode emulator) and its Debian packages.
HEXAGON_TOOLS = {
    "clang-19": ("clang-19",),
    "ld.lld-19": ("lld-19",),
    "qemu-hexagon-static": ("qemu-user-static",),
    "llvm-objdump-19": ("llvm-19",),
}
# The arm64 kernels' cross toolchain (tests/test_cross_arm64.py, tools/neon_instr_mix.py): the
# compiler with its static C library, binutils, and qemu-aarch64 (qemu-user-static's name for it
# is accepted as well: the hexagon backend installs that package anyway).
ARM64_TOOLS = {
    "aarch64-linux-gnu-gcc": ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"),
    "aarch64-linux-gnu-objdump": ("binutils-aarch64-linux-gnu",),
    "aarch64-linux-gnu-nm": ("binutils-aarch64-linux-gnu",),
    "qemu-aarch64": ("qemu-user-static",),
}
TOOL_ALIASES = {"qemu-aarch64": ("qemu-aarch64-static",)}


def _have(tool: str) -> bool:
    return any(shutil.which(t) for t in (tool, *TOOL_ALIASES.get(tool, ())))


def _apt_tools(
    session: nox.Session, what: str, tools: dict[str, tuple[str, ...]], var: str
) -> None:
    """Make the tests of `what` runnable: install the missing Debian packages when this runs as
    root with apt-get (CI), and then *require* them (`var`=1: a missing tool fails the tests
    instead of skipping them). Elsewhere the tests skip, naming the tool."""
    missing = [t for t in tools if not _have(t)]
    debs = sorted({d for t in missing for d in tools[t]})
    can_install = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")
    if missing and can_install:
        session.log(f"installing {' '.join(debs)} for {what} ({', '.join(missing)})")
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        try:
            session.run("apt-get", "install", "-y", "-q", *debs, external=True, env=env)
        except nox.command.CommandFailed:  # stale package lists
            session.run("apt-get", "update", "-q", external=True, env=env)
            session.run("apt-get", "install", "-y", "-q", *debs, external=True, env=env)
        missing = [t for t in tools if not _have(t)]
        if missing:
            session.error(f"apt-get installed {' '.join(debs)} but {', '.join(missing)} is missing")
    if can_install or not missing:
        session.env[var] = "1"
    else:
        session.warn(
            f"{what} tests will be skipped: {', '.join(missing)} not installed and no "
            f"root/apt-get to install {' '.join(debs)}"
        )


def _hexagon_toolchain(session: nox.Session) -> None:
    _apt_tools(session, "the hexagon backend", HEXAGON_TOOLS, "ESTREAM_HTP_REQUIRE_HEXAGON")


def _arm64_toolchain(session: nox.Session) -> None:
    _apt_tools(session, "the arm64 (NEON) kernels", ARM64_TOOLS, "ESTREAM_HTP_REQUIRE_ARM64")


def _package_session(session: nox.Session, name: str) -> None:
    # Install (build) this package alone, plus its test extra; reinstall so edits are seen.
    if name == "htp":
        _clean_htp_build()
        _hexagon_toolchain(session)  # before the build: setup.py compiles the executor
        _arm64_toolchain(session)  # cross-compiles and emulates the arm64 kernels
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


def _install_all(session: nox.Session, *extras: str, hexagon: bool = False) -> None:
    _clean_htp_build()
    if hexagon:  # before the build: setup.py compiles the Hexagon executor when it can
        _hexagon_toolchain(session)
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
    _install_all(session, "test", hexagon=True)
    _pytest(session, ROOT / "integration")


@nox.session
def ray(session: nox.Session) -> None:
    """`estream.data` and `--ray` on a local Ray instance (the extra estream-cli[ray]): answers
    equal to the single-process command, a SIGKILLed actor, Parquet in and out."""
    _install_all(session, "test", "ray")
    _pytest(session, PKG / "estream-cli" / "tests_ray")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: every package on its own, then integration/, then the Ray tests
    (a few minutes: a local Ray instance of two actors)."""
    for name in [*ALL, "integration", "ray"]:
        session.notify(name)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


DIST = ROOT / "dist"


def _dist_files(name: str) -> tuple[Path, Path]:
    """The one sdist and the one wheel `python -m build` wrote for a package."""
    out = DIST / f"estream-{name}"
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise RuntimeError(f"{out}: expected one sdist and one wheel, found {sdists + wheels}")
    return sdists[0], wheels[0]


def _check_dists(name: str) -> list[str]:
    """Problems with a package's sdist and wheel: metadata that disagrees with its pyproject,
    sibling requirements without a real range, files that must ship and do not (the htp
    extension, py.typed, estream-layout's vocabularies and their licence), files of another
    package."""
    project = tomllib.loads((PKG / f"estream-{name}" / "pyproject.toml").read_text())["project"]
    sdist, wheel = _dist_files(name)
    module = f"estream_{name}"
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
        meta_name = next(f for f in files if f.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    with tarfile.open(sdist) as tf:
        sfiles = ["/".join(m.split("/")[1:]) for m in tf.getnames()]
    for key, want in (("Name", project["name"]), ("Version", project["version"])):
        if meta[key] != want:
            problems.append(f"{wheel.name}: {key} {meta[key]!r}, pyproject says {want!r}")
    if meta["Requires-Python"] != project["requires-python"]:
        problems.append(f"{wheel.name}: Requires-Python {meta['Requires-Python']!r}")
    if meta["Description-Content-Type"] != "text/markdown" or len(meta.get_payload()) < 500:
        problems.append(f"{wheel.name}: the README is not the long description")
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    siblings = [r for r in requires if r.name.startswith("estream-") and r.marker is None]
    for r in siblings:
        version = tomllib.loads((PKG / r.name / "pyproject.toml").read_text())["project"]["version"]
        if not any(sp.operator in ("<", "<=", "==", "~=") for sp in r.specifier):
            problems.append(f"{wheel.name}: sibling requirement {r} has no upper bound")
        if version not in r.specifier:
            problems.append(f"{wheel.name}: {r} excludes the sibling's version {version}")
    if name != "cli" and siblings:
        problems.append(f"{wheel.name}: a lower package requires {siblings}")
    if name == "cli" and sorted(r.name for r in siblings) != sorted(f"estream-{n}" for n in LOWER):
        problems.append(f"{wheel.name}: requires {siblings}, expected all of {LOWER}")
    expected = [f"{module}/__init__.py", f"{module}/py.typed"]
    if name == "cli":  # the `estream` library ships beside the `estream_cli` command
        expected += ["estream/__init__.py", "estream/py.typed"]
    if name == "htp":
        ext = [f for f in files if re.fullmatch(r"estream_htp/_ffi\..*(so|pyd)", f)]
        if not ext:
            problems.append(f"{wheel.name}: no compiled extension estream_htp/_ffi*.so")
        if wheel.name.endswith("-none-any.whl"):
            problems.append(f"{wheel.name}: tagged pure Python but holds a C extension")
        if not any(f.startswith("csrc/") and f.endswith(".c") for f in sfiles):
            problems.append(f"{sdist.name}: the C sources are missing")
        if any(f.endswith(".so") for f in sfiles):
            problems.append(f"{sdist.name}: holds a compiled .so")
    elif not wheel.name.endswith("-py3-none-any.whl"):
        problems.append(f"{wheel.name}: a pure-Python package with a platform tag")
    if name == "layout":
        data = "estream_layout/data/"
        for vocab in ("mpt", "qwen2", "llama-spm", "deepseek-llm"):
            expected += [f"{data}ggml-vocab-{vocab}.gguf{ext}" for ext in ("", ".inp", ".out")]
        expected += [f"{data}LICENSE-llama.cpp", f"{data}README.md"]
    for f in expected:
        if f not in files:
            problems.append(f"{wheel.name}: {f} missing")
        if f"src/{f}" not in sfiles:
            problems.append(f"{sdist.name}: src/{f} missing")
    tops = {f.split("/")[0] for f in files} - {module, meta_name.split("/")[0]}
    if tops - ({"estream"} if name == "cli" else set()):  # estream-cli also ships `estream`
        problems.append(f"{wheel.name}: unexpected top-level entries {sorted(tops)}")
    return problems


@nox.session
def build(session: nox.Session) -> None:
    """Packages as users install them: an sdist and a wheel per package (the wheel built from
    the sdist, so a file missing from the sdist fails here), metadata checked (twine check +
    pyproject agreement), then estream-layout alone from its wheel in a clean virtualenv
    synthesizes, packs and verifies a model."""
    session.install("build>=1", "twine>=5")
    shutil.rmtree(DIST, ignore_errors=True)
    _clean_htp_build()
    for name in ALL:
        out = DIST / f"estream-{name}"
        session.run("python", "-m", "build", "-q", "--outdir", str(out), pkg(name))
    session.run("twine", "check", "--strict", *[str(f) for n in ALL for f in _dist_files(n)])
    problems = [p for name in ALL for p in _check_dists(name)]
    if problems:
        session.error("distribution problems:\n  " + "\n  ".join(problems))
    session.log("metadata of %d sdists and %d wheels checked", len(ALL), len(ALL))

    # estream-layout alone: a clean virtualenv (not nox's), its wheel and PyPI dependencies only.
    work = Path(session.create_tmp()) / "layout-alone"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    session.run("python", "-m", "venv", str(work / "venv"))
    bin_ = work / "venv" / "bin"
    _, wheel = _dist_files("layout")
    session.run(str(bin_ / "python"), "-m", "pip", "install", "-q", str(wheel), external=True)
    script = PKG / "estream-layout" / "tests" / "standalone_check.py"
    session.run(str(bin_ / "python"), str(script), str(work), external=True)
    shutil.rmtree(work, ignore_errors=True)


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


def _hexagon_session(session: nox.Session) -> None:
    """Every package with the Hexagon executor built (its toolchain installed first), or the
    session's error naming what is missing."""
    _install_all(session, "test", hexagon=True)
    session.install(pkg("htp", "test"))
    if "ESTREAM_HTP_REQUIRE_HEXAGON" not in session.env:
        session.error(
            f"the {session.name} session needs clang-19, ld.lld-19 and qemu-hexagon-static"
        )


@nox.session
def hexagon(session: nox.Session) -> None:
    """The hexagon backend at length under qemu-hexagon: the op tests with more examples and
    every architecture's prefill in resident and stream mode (its benchmarks: `bench_hexagon`)."""
    _hexagon_session(session)
    session.env["ESTREAM_HEXAGON_FULL"] = "1"
    htp_tests = PKG / "estream-htp" / "tests"
    session.run(
        "python", "-m", "pytest", str(htp_tests / "test_hexagon.py"),
        str(htp_tests / "test_backends.py"), str(htp_tests / "test_glue_ops.py"), "-k", "hexagon",
        "-q", "-p", "no:cacheprovider",
        env={"HYPOTHESIS_PROFILE": "dev"},
    )  # fmt: skip
    _pytest(session, ROOT / "integration" / "test_hexagon.py")


@nox.session
def bench_hexagon(session: nox.Session) -> None:
    """The packet count of the HVX tile kernel under qemu-hexagon and the hexagon protocol's
    round trips (both recorded in benchmarks/results/); no test runs first, so the round trips
    are timed on the machine as quiet as it was when the session started."""
    _hexagon_session(session)
    packets = ROOT / "bench-results" / bench_record.BENCHES["hexagon_packets"]
    _recorded(session, "hexagon_packets", PKG / "estream-htp" / "tools" / "hexagon_packets.py",
              "--json", str(packets))  # fmt: skip
    _recorded(session, "bench_hexagon", PKG / "estream-htp" / "bench" / "bench_hexagon.py")


def _arm64_session(session: nox.Session) -> None:
    """The arm64 cross toolchain and emulator installed, or the session's error naming them."""
    _arm64_toolchain(session)
    if "ESTREAM_HTP_REQUIRE_ARM64" not in session.env:
        session.error(f"the {session.name} session needs " + ", ".join(ARM64_TOOLS))


@nox.session
def arm64(session: nox.Session) -> None:
    """The arm64 (NEON) kernels alone, cross-compiled from the tree and run under qemu-aarch64
    (the same tests also run in `nox -s htp`; their instruction mix: `bench_arm64`). Builds
    nothing in-tree."""
    _arm64_session(session)
    session.install("pytest>=8", "hypothesis>=6.100")
    _pytest(session, PKG / "estream-htp" / "tests" / "test_cross_arm64.py")


@nox.session
def bench_arm64(session: nox.Session) -> None:
    """The instructions per 32x32 tile of the arm64 strip kernels and per key block of the
    attention tasks, by kind, under qemu-aarch64 (recorded in benchmarks/results/); no test
    runs first. Builds nothing in-tree."""
    _arm64_session(session)
    mix = ROOT / "bench-results" / bench_record.BENCHES["neon_instr_mix"]
    _recorded(session, "neon_instr_mix", PKG / "estream-htp" / "tools" / "neon_instr_mix.py",
              "--json", str(mix))  # fmt: skip


def _repo_relative(arg: str) -> str:
    return arg[len(str(ROOT)) + 1 :] if arg.startswith(f"{ROOT}/") else arg


def _recorded(session: nox.Session, bench: str, script: Path, *args: str) -> None:
    """Run a benchmark script and record its run (benchmarks/record.py): the machine, its load
    average and steal around the run, the commit, the command and the figures the script wrote
    to bench-results/, as benchmarks/results/<bench>/<UTC time>-<commit>.json."""
    figures = bench_record.BENCHES[bench]
    if any(a == "--out" or a.startswith("--out=") for a in args):
        session.error(
            f"{bench}: the session records bench-results/{figures}, so it takes no --out; "
            f"run {script.relative_to(ROOT)} directly to write elsewhere"
        )
    (ROOT / "bench-results").mkdir(exist_ok=True)
    before = bench_record.sample()
    if session.run("python", str(script), *args) is None:
        return  # --install-only: nothing ran, nothing to record
    after = bench_record.sample()
    typed = ["nox", "-s", session.name, *(["--", *session.posargs] if session.posargs else [])]
    try:
        path = bench_record.record(
            bench, before=before, after=after, command=shlex.join(typed),
            script_command=["python", *map(_repo_relative, [str(script), *args])],
        )  # fmt: skip
    except bench_record.ResultError as exc:
        session.error(str(exc))
    session.log(f"recorded {_repo_relative(str(path))}; `nox -s bench_report` renders it")


def _bench(
    session: nox.Session,
    script: Path,
    *,
    all_pkgs: bool = False,
    name: str = "",
    extras: tuple[str, ...] = (),
) -> None:
    if all_pkgs:
        _install_all(session, "bench", *extras)
    else:
        if name == "htp":
            _clean_htp_build()
        session.install("--force-reinstall", "--no-deps", pkg(name))
        session.install(pkg(name, "bench"))
    _recorded(session, session.name, script, *session.posargs)


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
    """End-to-end prefill: stream vs resident (vs llama.cpp when available). Opt-in baseline:
    `-- --arch qwen3moe --ik-llama-bench PATH` (or $ESTREAM_IK_LLAMA_BENCH) adds an ik_llama.cpp
    llama-bench you built, run on the same GGUF with its fused-MoE/MLA CPU flags, and EStream's
    tokens/s over ik's (see the script's docstring)."""
    _bench(session, ROOT / "integration" / "bench" / "bench_engine.py", all_pkgs=True)


@nox.session
def bench_tasks(session: nox.Session) -> None:
    """Many short requests (MASSIVE..ARC-C lengths): batched vs unbatched stream, resident, llama.cpp."""
    _bench(session, ROOT / "integration" / "bench" / "bench_tasks.py", all_pkgs=True)


@nox.session
def bench_ray(session: nox.Session) -> None:
    """Corpus classify on Ray Data: rows/s on 1 and 2 actors vs the plain JSON Lines command."""
    _bench(session, ROOT / "integration" / "bench" / "bench_ray.py", all_pkgs=True, extras=("ray",))


@nox.session
def bench_vs_llama(session: nox.Session) -> None:
    """Prefill tokens/s vs a llama-bench you built (ik_llama.cpp or llama.cpp) on one GGUF:
    `nox -s bench_vs_llama -- MODEL.gguf --llama-bench PATH` (see the script's docstring)."""
    _bench(session, ROOT / "integration" / "bench" / "vs_llama_bench.py", all_pkgs=True)


@nox.session
def bench_scale(session: nox.Session) -> None:
    """Qwen3-30B-A3B and Mixtral-8x7B shapes streamed within 2/4 GiB (≈ 80 GB of disk, hours)."""
    _bench(session, ROOT / "integration" / "bench" / "bench_scale.py", all_pkgs=True)


@nox.session
def parity(session: nox.Session) -> None:
    """Engine and llama.cpp logits vs a float64 reference; models from estream-synth and from
    llama.cpp's own converter and quantizer (Q4_0, Q4_K_M)."""
    _bench(session, ROOT / "integration" / "bench" / "parity.py", all_pkgs=True)


@nox.session
def eval_parity(session: nox.Session) -> None:
    """`estream eval perplexity` on streamed models vs llama.cpp on the same GGUF and windows."""
    _bench(session, ROOT / "integration" / "bench" / "eval_parity.py", all_pkgs=True)


@nox.session(venv_backend="none")
def bench_report(session: nox.Session) -> None:
    """docs/benchmarks.md from the newest result of each benchmark in benchmarks/results/, and
    README.md's headline table between its bench:headline markers (`-- --check`: only check
    that both are up to date)."""
    if bench_report_module.main(session.posargs) != 0:
        session.error("bench_report failed (see above)")
