"""Property: whatever string any option of the main `estream` subcommands is given, the command
either runs (exit 0) or ends with exactly one plain error line (`estream…: error: …`, no Python
class name, not an internal error) and a non-zero exit — never a traceback.

Every option is found by walking the command's own parser, so an option added later is fuzzed
too. Runs in-process through `estream_cli.main.main` on the tiny preset, packed once for the
module; the number of examples follows the Hypothesis profile (a fraction of it: each example
may load the model). Options that name output files are left out (the output writer has its own
tests). `bench` runs each prefill as a separate process and may drop the page cache: here its
runs and cache drops are stand-ins, so what is tested is its option parsing and checks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estream_cli.main import build_parser, main
from estream_layout import pack_model, synth_model

OUTPUT_DESTS = {"all_logits", "trace", "plot", "output", "details"}

PYTHON_IN_MESSAGE = re.compile(r"\b[A-Z][a-z]+(?:[A-Z][a-z]*)*(?:Error|Exception|Type)\b|\w=True")

EXAMPLES = max(8, settings.default.max_examples // 4)

# Values that have broken option parsers before: empty items, non-ASCII digits, huge and
# negative numbers, NaN, stdin, endless or unreadable files, undecodable argv bytes.
TRICKY = [
    "",
    " ",
    "0",
    "-1",
    "1",
    "2",
    "1,,2",
    ",",
    "１",
    "٣",
    "1_0",
    "1e9",
    "nan",
    "inf",
    "99999999999999999999",
    "4097",
    "1,2,3",
    "8",
    "9",
    "-",
    "/dev/zero",
    "/dev/null",
    "/",
    "1GiB",
    "0B",
    "1KiB",
    "x" * 300,
    "\udcff",
    "a\udce9b",
    "\x00",
    "line\nbreak",
    "stream",
    "resident",
    "naive",
    "layer",
    "host",
    "host-process",
    "hexagon",
    "backend",
    "q8",
    "f32",
    "bf16",
    "early",
    "ondemand",
    "auto",
    "sequence",
    "mean",
]

# Characters of argv: printable text, digits and separators, and the lone surrogates by which
# undecodable bytes reach Python.
_CHARS = st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from("0123456789,-. "),
    st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
)
VALUES = st.one_of(st.sampled_from(TRICKY), st.text(_CHARS, max_size=24))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny preset's pack and small valid inputs for the commands that read files."""
    d = tmp_path_factory.mktemp("fuzz")
    src = d / "m.gguf"
    synth_model("olmoe", "tiny", src, seed=2, progress=False)
    pack_model(src, d / "m.estream", progress=False)
    (d / "docs.txt").write_text("first document\nsecond one\n")
    (d / "passages.txt").write_text("the cat sat on the mat\na dog ran in the park\n")
    (d / "text.txt").write_text("some words of text " * 40)
    (d / "choice.jsonl").write_text(
        json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n"
    )
    return d


def _base(command: str, d) -> list[str]:
    """A valid, quick invocation of ``command`` (what the fuzzed option is added to)."""
    m = str(d / "m.estream")
    return {
        "prefill": ["prefill", m, "--tokens", "1,2,3"],
        "profile": [
            "profile", m, "--tokens", "8", "--candidates", "1,2", "--queue-depths", "1",
            "--bw-rounds", "1",
        ],
        "config": ["config", m, "--budget", "1GiB"],
        "classify": ["classify", m, "--prompt", "x", "--labels", "a,b"],
        "score": ["score", m, "--context", "x", "--choice", "a"],
        "rerank": ["rerank", m, "--query", "q", "--docs-file", str(d / "docs.txt")],
        "embed": ["embed", m, "--prompt", "x"],
        "tokenize": ["tokenize", m, "hello"],
        "detokenize": ["detokenize", m, "1,2"],
        "eval perplexity": ["eval", "perplexity", m, "--text-file", str(d / "text.txt")],
        "eval choice": ["eval", "choice", m, "--input", str(d / "choice.jsonl")],
        "eval cloze": ["eval", "cloze", m, "--text-file", str(d / "passages.txt")],
        "bench": ["bench", m, "--lengths", "4", "--modes", "stream"],
    }[command]  # fmt: skip


COMMANDS = [
    "prefill",
    "profile",
    "config",
    "classify",
    "score",
    "rerank",
    "embed",
    "tokenize",
    "detokenize",
    "eval perplexity",
    "eval choice",
    "eval cloze",
    "bench",
]

_FAKE_RUN = {
    "ttft_s": 0.01,
    "peak_memory_bytes": 1,
    "bytes_read": 1,
    "io_compute_overlap": 0.5,
    "bubble_rate": 0.1,
}


def _subparser(command: str) -> argparse.ArgumentParser:
    p = build_parser()
    for word in command.split():
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[word]
    return p


def _options(command: str) -> tuple[list[argparse.Action], list[argparse.Action]]:
    """(options taking a value, flags) of ``command``, outputs left out."""
    valued, flags = [], []
    for a in _subparser(command)._actions:
        if isinstance(a, argparse._HelpAction) or a.dest in OUTPUT_DESTS:
            continue
        if a.nargs == 0:
            flags.append(a)
        elif a.option_strings:
            valued.append(a)
    return valued, flags


def _valid(action: argparse.Action) -> st.SearchStrategy[str]:
    """Values ``action`` takes: its choices, small counts, or (for text and paths) the tricky
    values again."""
    if action.choices:
        return st.sampled_from([str(c) for c in action.choices])
    if action.type is not None and action.type is not str:
        return st.sampled_from(["1", "2", "3", "4", "1,2", "8"])
    return st.sampled_from(TRICKY)


def _with(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option`` set to ``value`` (replacing the base's own setting of it)."""
    out = list(argv)
    if option in out:
        i = out.index(option)
        del out[i : i + 2]
    if value.startswith("-"):
        # so that argparse does not read the value as an option
        return [*out, f"{option}={value}" if option.startswith("--") else f"{option}{value}"]
    return [*out, option, value]


def _one_error(
    rc: int, out: str, err: str, *, quiet: bool = False, given: tuple[str, ...] = ()
) -> None:
    """A run (exit 0, something on standard output unless ``quiet``) or one plain error line
    (``given``: the values passed, which the line may quote — they are not its own words)."""
    assert "Traceback" not in err, err
    if rc == 0:
        assert out or quiet, err
        return
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(errors) == 1, err
    line = errors[0]
    assert re.match(r"estream[\w -]*: error: \S", line), err
    assert err.rstrip("\n").endswith(line), err  # nothing after the error line
    assert "internal error" not in line, line
    own = line
    for value in sorted(given, key=len, reverse=True):
        if value:
            own = own.replace(value, "").replace(repr(value), "")
    assert not PYTHON_IN_MESSAGE.search(own), line


@pytest.mark.parametrize("command", COMMANDS)
def test_any_option_value_gives_a_run_or_one_clear_error(files, command, monkeypatch):
    """Any string for any option (or the model argument) of ``command``, with any of its flags:
    exit 0, or one `estream…: error:` line without class names and a non-zero exit."""
    valued, flags = _options(command)
    names = [a.option_strings[0] for a in valued] + ["MODEL"]
    # every option also gets values it takes, so that runs happen, not only errors
    values = {
        a.option_strings[0]: st.booleans().flatmap(lambda ok, a=a: _valid(a) if ok else VALUES)
        for a in valued
    }
    values["MODEL"] = VALUES
    base = _base(command, files)
    model_at = base.index(str(files / "m.estream"))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        choice=st.lists(
            st.sampled_from(names).flatmap(lambda n: st.tuples(st.just(n), values[n])),
            min_size=1,
            max_size=2,
            unique_by=lambda t: t[0],
        ),
        with_flags=st.lists(st.sampled_from([f.option_strings[0] for f in flags] or ["-h"])),
    )
    def check(choice, with_flags):
        argv = list(base)
        for name, value in choice:
            if name == "MODEL":
                argv[model_at] = value or "."
            else:
                argv = _with(argv, name, value)
        argv += [f for f in dict.fromkeys(with_flags) if f not in ("-h", "--help")]
        out_buf, err_buf = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                rc = exc.code if isinstance(exc.code, int) else 1
        _one_error(
            rc,
            out_buf.getvalue(),
            err_buf.getvalue(),
            quiet=command == "profile",
            given=tuple(v for _, v in choice),
        )

    if command == "bench":
        from estream_cli import bench

        monkeypatch.setattr(bench, "run_one", lambda *a, **k: dict(_FAKE_RUN))
        monkeypatch.setattr(bench, "drop_page_cache", lambda paths: "fadvise")
    cwd = os.getcwd()
    stdin = sys.stdin
    os.chdir(files)  # a relative path among the values lands here
    sys.stdin = io.TextIOWrapper(io.BytesIO(b""))  # `-` reads an empty standard input
    try:
        check()
    finally:
        os.chdir(cwd)
        sys.stdin = stdin


def test_the_property_catches_a_traceback(files, monkeypatch):
    """The check itself: an option whose value crashes the command is reported."""
    import estream_cli.main as cli

    def crash(args):
        raise ValueError(f"invalid literal for int() with base 10: {args.budget!r}")

    monkeypatch.setattr(cli, "cmd_config", crash)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(_base("config", files))
    with pytest.raises(AssertionError):
        _one_error(rc, "", err.getvalue())
