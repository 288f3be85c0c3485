"""What the `estream` command accepts: every malformed or pointless option value ends in one
plain error line (no Python class names, no traceback) and a non-zero exit, before the model
loads; counts are written with the right plural; templates render within bounds."""

from __future__ import annotations

import io
import json
import re
import sys
import time

import pytest

from estream_cli.main import main
from estream_layout import pack_model, synth_model
from estream_layout.synth import ARCHES

# A Python class name (SomethingError, NoneType, ...) or keyword syntax (force=True) in a message.
PYTHON_IN_MESSAGE = re.compile(r"\b[A-Z][a-z]+(?:[A-Z][a-z]*)*(?:Error|Exception|Type)\b|\w=True")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    src = d / "m.gguf"
    synth_model("olmoe", "tiny", src, seed=1, progress=False)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return dst


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def refused(rc: int, err: str, *needles: str) -> None:
    """One `estream…: error:` line (after argparse's usage lines), non-zero exit, the needles in
    it, nothing Pythonic."""
    assert rc != 0, err
    lines = err.strip().splitlines()
    assert lines and re.match(r"estream[\w -]*: error: ", lines[-1]), err
    assert not any(ln.startswith("estream") and "error:" in ln for ln in lines[:-1]), err
    assert "Traceback" not in err
    assert not PYTHON_IN_MESSAGE.search(lines[-1]), lines[-1]
    assert "internal error" not in lines[-1], lines[-1]
    for needle in needles:
        assert needle in lines[-1], lines[-1]


# -- integers -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("1,,2", "empty item (item 2)"),
        ("1,", "empty item (item 2)"),
        ("", "is empty"),
        (",", "empty item"),
        ("１", "ASCII digits"),  # full-width one: int() reads it
        ("٣", "ASCII digits"),  # Arabic-Indic three
        ("1_0", "ASCII digits"),  # int() reads 10
        ("0x10", "ASCII digits"),
        ("1.0", "ASCII digits"),
        ("9" * 30, "ASCII digits"),
    ],
)
def test_tokens_outside_ascii_comma_lists_are_refused(model, capsys, value, needle):
    """--tokens takes comma-separated ASCII integers and nothing else."""
    rc, out, err = run(capsys, "prefill", str(model), "--tokens", value)
    refused(rc, err, "--tokens", needle)
    assert rc == 2 and out == ""


def test_detokenize_ids_follow_the_same_rule(model, capsys):
    """The ids argument of detokenize is parsed like --tokens."""
    rc, _, err = run(capsys, "detokenize", str(model), "1,,2")
    refused(rc, err, "empty item")
    rc, _, err = run(capsys, "detokenize", str(model), "１")
    refused(rc, err, "ASCII digits")


@pytest.mark.parametrize("value", ["１", "0", "-3", "1_0", "x", "99999999999999999999999"])
@pytest.mark.parametrize("option", ["--top-k", "-G", "-Q", "-B", "--threads"])
def test_count_options_take_ascii_positive_integers(model, capsys, option, value):
    """Every count option refuses non-ASCII digits, 0, negatives and absurd sizes."""
    rc, _, err = run(capsys, "prefill", str(model), "--tokens", "1", option, value)
    refused(rc, err, option)
    assert rc == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--candidates", "a"], "ASCII digits"),
        (["--candidates", "1,,2"], "empty item"),
        (["--candidates", "0"], ">= 1"),
        (["--candidates", "1,99"], "group size 99 does not fit the model's 8 experts"),
        (["--queue-depths", "２"], "ASCII digits"),
        (["--tokens", "100000"], "100000 tokens does not fit the model context (1..4096"),
    ],
)
def test_profile_values_are_checked_before_profiling(model, capsys, argv, needle):
    """profile's lists and length are refused with one line before any calibration runs."""
    rc, _, err = run(capsys, "profile", str(model), *argv)
    refused(rc, err, needle)
    assert "g=" not in err  # no calibration request ran


def test_config_length_beyond_the_context(model, capsys):
    """config --tokens longer than the model context is refused (no configuration for a
    prompt the model cannot take)."""
    rc, _, err = run(capsys, "config", str(model), "--budget", "1GiB", "--tokens", "4097")
    refused(rc, err, "--tokens 4097 is longer than the model context (4096 tokens)")


def test_profile_default_candidates_fit_the_model(model, capsys, monkeypatch):
    """Without --candidates, profile calibrates the default sizes that fit the model's experts
    (1, 2, 4, 8 of 1..16 for 8 experts); the library does the same."""
    from estream import profiling

    seen = []

    def fake(path, *, candidates=None, **kw):
        seen.append(candidates)
        raise profiling.BadRequestError("stop")

    monkeypatch.setattr(profiling, "profile_model", fake)
    rc, _, err = run(capsys, "profile", str(model), "--tokens", "4")
    assert rc == 2 and "g ∈ {1, 2, 4, 8}" in err and seen == [(1, 2, 4, 8)]
    monkeypatch.undo()
    with pytest.raises(profiling.BadRequestError, match="group size 16 does not fit"):
        profiling.profile_model(model, candidates=(1, 16), n_tokens=4)


def test_group_size_beyond_the_expert_count(model, capsys):
    """-G larger than the experts of a layer is refused, not silently clamped."""
    rc, _, err = run(capsys, "prefill", str(model), "--tokens", "1", "-G", "9")
    refused(rc, err, "a group size of 9 is more than the model's 8 experts per layer")
    import estream
    from estream.errors import BadRequestError

    with pytest.raises(BadRequestError, match="group size of 9"):
        estream.load(model, G=9)


def test_bench_lists(model, capsys):
    """bench's --lengths and --modes are checked before any run starts."""
    rc, _, err = run(capsys, "bench", str(model), "--lengths", "1,,2")
    refused(rc, err, "--lengths", "empty item")
    rc, _, err = run(capsys, "bench", str(model), "--modes", "stream,fast")
    refused(rc, err, "--modes", "'fast'")


def test_bench_checks_every_length_before_the_first_run(model, capsys, monkeypatch):
    """A length beyond the context is refused before any run starts, wherever it is listed."""
    from estream_cli import bench

    runs = []
    monkeypatch.setattr(bench, "run_one", lambda *a, **k: runs.append(a) or {})
    rc, _, err = run(capsys, "bench", str(model), "--lengths", "4,99999", "--modes", "resident")
    refused(rc, err, "--lengths 99999 is longer than the model context (4096 tokens)")
    assert runs == []


def test_demo_preset_and_arch(capsys):
    """demo takes the presets of estream-synth, each with its own family only."""
    rc, _, err = run(capsys, "demo", "--preset", "mixtral-8x7b")
    refused(rc, err, "give --arch mixtral")
    rc, _, err = run(capsys, "demo", "--arch", "gpt2")
    refused(rc, err, "--arch", "invalid choice")


# -- text ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHES:
        out[arch] = d / f"{arch}.gguf"
        synth_model(arch, "tiny", out[arch], seed=0, progress=False)
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_tokenize_refuses_undecodable_text_on_every_architecture(ggufs, capsys, arch):
    """Text that was not UTF-8 on the command line (bytes smuggled in as lone surrogates) is
    refused whatever the model's tokenizer; valid text is tokenized."""
    rc, out, err = run(capsys, "tokenize", str(ggufs[arch]), "ab\udcffc")
    refused(rc, err, "not valid UTF-8", "position 2")
    assert out == ""
    rc, out, err = run(capsys, "tokenize", str(ggufs[arch]), "abc", "--json")
    assert rc == 0, err
    assert json.loads(out)["ids"]


@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "{m}", "--prompt", "\udcc3("],
        ["classify", "{m}", "--prompt", "x\udcff", "--labels", "a,b"],
        ["classify", "{m}", "--prompt", "x", "--labels", "a,\udcff"],
        ["score", "{m}", "--context", "x", "--choice", "\udce9"],
    ],
)
def test_text_options_that_are_not_utf8(model, capsys, argv):
    """Every text option refuses undecodable bytes before the model loads."""
    rc, _, err = run(capsys, *[a.replace("{m}", str(model)) for a in argv])
    refused(rc, err, "not valid UTF-8")


def test_prompt_file_is_read_with_a_limit(model, capsys):
    """A prompt file without end (/dev/zero) is refused after 16 MiB, not read forever."""
    t0 = time.monotonic()
    rc, _, err = run(capsys, "prefill", str(model), "--prompt-file", "/dev/zero")
    refused(rc, err, "/dev/zero is larger than 16.00 MiB")
    assert time.monotonic() - t0 < 30


def test_input_file_is_read_with_a_limit(model, capsys, monkeypatch):
    """A batch input larger than the limit is refused with its size."""
    from estream_cli import task_commands

    monkeypatch.setattr(task_commands, "MAX_INPUT_BYTES", 1000)
    monkeypatch.setattr(task_commands.read_text, "__defaults__", (1000,))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"prompt": "x"}\n' * 100)))
    rc, _, err = run(capsys, "classify", str(model), "--input", "-", "--labels", "a,b")
    refused(rc, err, "<stdin> is larger than")


def test_input_files_that_are_fifos(model, capsys, tmp_path):
    """A FIFO nobody writes to reads as empty (one clear line at once, no wait for a writer);
    a FIFO with a writer is read as any file (what ``<(command)`` gives)."""
    import os
    import threading

    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    for argv in (["prefill", str(model), "--prompt-file", str(fifo)],
                 ["classify", str(model), "--input", str(fifo), "--labels", "a,b"]):  # fmt: skip
        rc, _, err = run(capsys, *argv)
        refused(rc, err, "empty")

    def write() -> None:
        with open(fifo, "w") as f:
            f.write("hello there")

    writer = threading.Thread(target=write)
    writer.start()
    while True:  # the writer waits in open() until a reader opens the FIFO: let it in first
        rc, out, err = run(capsys, "prefill", str(model), "--prompt-file", str(fifo), "--json")
        if rc == 0 or not writer.is_alive():
            break
    writer.join()
    assert rc == 0, err
    assert json.loads(out)["metrics"]["tokens"] > 1


def test_closed_stdin(model, capsys, monkeypatch):
    """`--input -` with standard input closed is one clear line."""
    monkeypatch.setattr(sys, "stdin", None)
    rc, _, err = run(capsys, "classify", str(model), "--input", "-", "--labels", "a,b")
    refused(rc, err, "standard input, which is closed")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"id": NaN, "prompt": "x"}', "NaN is not a JSON number"),
        ('{"id": Infinity, "prompt": "x"}', "Infinity is not a JSON number"),
        ('{"id": -Infinity, "prompt": "x"}', "not a JSON number"),
        ('{"id": 1.5, "prompt": "x"}', "'id' must be a string or an integer"),
        ('{"id": [1], "prompt": "x"}', "'id' must be a string or an integer"),
        ('{"id": true, "prompt": "x"}', "'id' must be a string or an integer"),
        ('{"prompt": "x", "w": NaN}', "NaN is not a JSON number"),
        ("[" * 100000, "nested too deeply"),
    ],
)
def test_jsonl_values_that_are_not_json_or_ids(model, capsys, tmp_path, line, needle):
    """A request line with NaN/Infinity (not JSON) or an id that does not read back as written
    is refused, naming the file and line; the valid lines before it change nothing."""
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "ok", "prompt": "x"}\n' + line + "\n")
    rc, out, err = run(capsys, "classify", str(model), "--input", str(f), "--labels", "a,b")
    refused(rc, err, f"{f}:2", needle)
    assert out == ""


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": "a\\udcffb"}',
        '{"prompt": "x", "labels": ["\\ud800"]}',
        '{"id": "\\udfff", "prompt": "x"}',
    ],
)
def test_jsonl_lone_surrogates_are_not_text(model, capsys, tmp_path, line):
    """A JSON escape spelling a lone surrogate is refused with its line, like undecodable bytes
    on the command line."""
    f = tmp_path / "in.jsonl"
    f.write_text(line + "\n")
    rc, out, err = run(capsys, "classify", str(model), "--input", str(f), "--labels", "a,b")
    refused(rc, err, f"{f}:1", "lone surrogate")
    assert out == ""


@pytest.mark.parametrize(
    ("command", "line", "needle"),
    [
        (
            ["classify", "--labels", "a,b"],
            '{"prompt": 3}',
            "'prompt' must be a string, not an integer",
        ),
        (
            ["classify", "--labels", "a,b"],
            '{"prompt": [1]}',
            "'prompt' must be a string, not a list",
        ),
        (["eval", "choice"], '{"context": "a", "choices": ["x", null], "gold": 0}', "is null"),
        (["eval", "choice"], '{"context": "a", "choices": ["x", "y"], "gold": null}', "got null"),
        (["eval", "choice"], "[1, 2]", "expected a JSON object, got a list"),
    ],
)
def test_wrong_json_types_are_named_in_json_words(model, capsys, tmp_path, command, line, needle):
    """A field of the wrong type is named as JSON names it (null, a list), not as Python does
    (NoneType, list)."""
    f = tmp_path / "in.jsonl"
    f.write_text(line + "\n")
    words = command[:2] if command[0] == "eval" else command[:1]
    extra = command[len(words) :]
    rc, _, err = run(capsys, *words, str(model), "--input", str(f), *extra)
    refused(rc, err, f"{f}:1", needle)


def test_jsonl_ids_that_are_kept(tmp_path):
    """Strings, integers and null are ids that JSON carries unchanged."""
    from estream_cli.task_commands import read_jsonl

    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "a"}\n{"id": 10000000000000000000001}\n{"id": null}\n{}\n')
    assert [o.get("id") for _, o in read_jsonl(str(f))] == ["a", 10**22 + 1, None, None]


def test_docs_file_nan_id(model, capsys, tmp_path):
    """A document object with a NaN id is refused like a request line."""
    f = tmp_path / "docs.txt"
    f.write_text('plain text\n{"id": NaN, "text": "x"}\n')
    rc, _, err = run(capsys, "rerank", str(model), "--query", "q", "--docs-file", str(f))
    refused(rc, err, f"{f}:2", "NaN")


# -- options that would do nothing ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--mode", "resident", "--budget", "1GiB"], "--budget does nothing with --mode resident"),
        (["--mode", "resident", "-G", "2"], "-G does nothing with --mode resident"),
        (["--mode", "resident", "-Q", "2"], "-Q does nothing with --mode resident"),
        (["--mode", "resident", "-B", "4"], "-B does nothing with --mode resident"),
        (["--mode", "resident", "--schedule", "ondemand"], "--schedule does nothing"),
        (["--mode", "naive", "-G", "2"], "-G does nothing with --mode naive"),
        (["--mode", "layer", "--budget", "1GiB"], "--budget does nothing with --mode layer"),
        (["--mode", "resident", "--pin", "1MiB"], "--pin does nothing with --mode resident"),
        (["--pin", "auto"], "--pin auto pins what --budget leaves"),
        (["--pin", "lots"], "cannot read memory size 'lots'"),
        (["--budget", "1GiB", "-G", "2"], "give either --budget or -G 2"),
        (["--dense-ops", "backend"], "--dense-ops backend does nothing with --backend host"),
        (["--backend", "hexagon", "--threads", "2"], "--threads does nothing with --backend"),
    ],
)
def test_options_that_would_do_nothing_are_refused(model, capsys, extra, needle):
    """An engine option the chosen mode or backend would ignore is refused, for every
    command that runs the model."""
    for cmd in (
        ["prefill", str(model), "--tokens", "1"],
        ["classify", str(model), "--prompt", "x", "--labels", "a,b"],
        ["eval", "cloze", str(model), "--text-file", "/dev/null"],
    ):
        rc, _, err = run(capsys, *cmd, *extra)
        refused(rc, err, needle)
        assert rc == 2


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--dense-ops", "host"],
        ["--backend", "hexagon", "--threads", "2", "--dense-ops", "host"],
        ["--backend", "host-process", "--threads", "2", "--dense-ops", "backend"],
        ["--mode", "resident", "--verify", "--act", "f32"],
        ["--mode", "naive", "--schedule", "ondemand"],
        ["--budget", "1GiB", "--schedule", "after-routing"],
        ["-G", "8", "-Q", "2", "-B", "3"],
        ["--pin", "64MiB", "-G", "2"],
        ["--mode", "naive", "--pin", "64MiB"],  # naive streams through an arena too
    ],
)
def test_options_that_take_effect_are_accepted(model, extra):
    """The combinations in which every option given changes something pass the check."""
    from estream_cli.main import build_parser
    from estream_cli.options import check_engine_opts

    args = build_parser().parse_args(["prefill", str(model), "--tokens", "1", *extra])
    check_engine_opts(args)


def test_bench_threads_bounded_like_prefill(model, capsys):
    """bench --threads has prefill's bound, refused before any run."""
    rc, _, err = run(capsys, "bench", str(model), "--threads", "1025")
    refused(rc, err, "--threads", "at most 1024 threads")


def test_bench_budget_without_a_stream_run(model, capsys):
    """bench --budget applies to stream runs: with none among --modes it is refused."""
    rc, _, err = run(capsys, "bench", str(model), "--modes", "resident", "--budget", "1GiB")
    refused(rc, err, "--budget applies to the stream runs only")


def test_json_with_a_batch(model, capsys, tmp_path):
    """--json changes nothing for a batch (its results are JSON lines): refused."""
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "x"}\n')
    rc, _, err = run(capsys, "classify", str(model), "--input", str(f), "--labels", "a,b", "--json")
    refused(rc, err, "--json does nothing with --input")


# -- messages -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "{d}/nope.estream", "--tokens", "1"],
        ["prefill", "{d}/nope.estream", "--prompt", "hi"],
        ["classify", "{d}/nope.estream", "--prompt", "hi", "--labels", "a,b"],
        ["config", "{d}/nope.estream", "--budget", "1GiB"],
        ["profile", "{d}/nope.estream"],
        ["eval", "cloze", "{d}/nope.estream", "--text-file", "/dev/null"],
    ],
)
def test_missing_pack_is_reported_alike_with_or_without_a_gguf(model, capsys, tmp_path, argv):
    """A missing pack is one message, the same whether or not NAME.gguf lies beside it."""
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    rc1, _, err1 = run(capsys, *argv)
    (tmp_path / "nope.gguf").write_bytes((model.parent / "m.gguf").read_bytes())
    rc2, _, err2 = run(capsys, *argv)
    refused(rc1, err1, "nope.estream: no such packed model")
    assert (rc1, err1) == (rc2, err2)


def test_messages_name_no_python_class(capsys):
    """An error of a lower package is printed as its message alone; an unanticipated one is
    called an internal error, without its class name."""
    from estream.errors import PackError
    from estream_cli.messages import describe
    from estream_layout.errors import NotGGUFError

    assert describe(PackError("x.estream does not exist")) == "x.estream does not exist"
    assert describe(NotGGUFError("x.gguf is not a GGUF file")) == "x.gguf is not a GGUF file"
    assert describe(FileNotFoundError(2, "No such file or directory", "a.txt")) == (
        "a.txt: no such file or directory"
    )
    msg = describe(AttributeError("'NoneType' object has no attribute 'read'"))
    assert msg.startswith("internal error") and "AttributeError" not in msg


def test_unanticipated_error_in_a_command(model, capsys, monkeypatch):
    """A bug inside a command ends in one line saying so, no class name, exit 1."""
    import estream_cli.main as cli

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(cli, "cmd_config", broken)
    monkeypatch.delenv("ESTREAM_DEBUG", raising=False)
    rc, _, err = run(capsys, "config", str(model), "--budget", "1GiB")
    assert rc == 1 and err.startswith("estream: error: internal error") and "KeyError" not in err


def test_plural():
    """Counts take the singular for one and the plural otherwise."""
    from estream_cli.messages import plural

    assert plural(1, "pass") == "1 pass"
    assert plural(2, "pass") == "2 passes"
    assert plural(0, "prompt token") == "0 prompt tokens"
    assert plural(1, "prompt token") == "1 prompt token"
    assert plural(3, "batch") == "3 batches"


@pytest.mark.parametrize(
    ("rounds", "words"), [(1, "1 interleaved round,"), (2, "2 interleaved rounds,")]
)
def test_profile_log_plural(model, monkeypatch, rounds, words):
    """profile's log says "1 round", "2 rounds"."""
    from estream import profiling

    monkeypatch.setattr(profiling, "measure_bandwidth_table", _stop)
    lines: list[str] = []
    with pytest.raises(_Stop):
        profiling.profile_model(
            model,
            candidates=(1,),
            queue_depths=(1,),
            n_tokens=4,
            bw_rounds=rounds,
            log=lines.append,
        )
    assert any(words in ln for ln in lines), lines


def test_profile_names_its_candidates_as_a_set(model, capsys, monkeypatch):
    """profile's first line lists the group sizes as {1, 2}, not as a Python tuple."""
    from estream import profiling

    monkeypatch.setattr(profiling, "profile_model", _stop)  # stops after the first line
    main(["profile", str(model), "--candidates", "1,2", "--tokens", "1"])
    err = capsys.readouterr().err
    assert "one calibration request per g ∈ {1, 2}, 1 token" in err, err


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_text_report_names_the_backend():
    """The metrics block says which backend ran the experts."""
    from estream_cli.report import print_metrics

    out = io.StringIO()
    print_metrics({"mode": "stream", "tokens": 1, "backend": "host-process", "threads": 2}, out)
    assert "backend=host-process" in out.getvalue()
    assert "tokens=1 " in out.getvalue()
    assert "attention=" not in out.getvalue()  # (not in the metrics: not in the line)


def test_text_report_names_the_attention_that_ran():
    """The metrics block says which attention precision ran (what auto resolved to)."""
    from estream_cli.report import print_metrics

    out = io.StringIO()
    print_metrics({"mode": "stream", "tokens": 1, "act": "q8", "attention": "bf16"}, out)
    assert "act=q8  attention=bf16" in out.getvalue()


# -- chat templates ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**10 }}",
        "{{ 10**10 * 'x' }}",
        "{{ ['x'] * 10**9 }}",
        "{{ 'x'|center(10**10) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ '%9999999999d' % 1 }}",
        "{{ '%9999999999d'|format(1) }}",
        "{{ '{:>9999999999}'.format(1) }}",
        "{{ 2 ** (10**9) }}",
        "{% set n = namespace(s='x') %}{% for i in range(64) %}{% set n.s = n.s ~ n.s %}"
        "{% endfor %}",
        "{% set n = namespace(s='x') %}{% for i in range(64) %}{% set n.s = n.s + n.s %}"
        "{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    ],
)
def test_hostile_chat_templates_end_quickly(source):
    """A chat template asking for a huge string, number or output, or a long loop, is refused
    within a few seconds with one plain message."""
    from estream.template import ChatTemplate, TemplateRenderError

    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError) as got:
        ChatTemplate.compile(source).render("hello")
    assert time.monotonic() - t0 < 10
    assert "chat template" in str(got.value)


def test_ordinary_chat_template_still_renders():
    """Bounds leave an ordinary template, its formatting and a long message alone."""
    from estream.template import MAX_RENDER_CHARS, ChatTemplate

    t = ChatTemplate.compile(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] ~ '' }}"
        "{{ '%3d' % 7 }}{{ '{:>3}'.format(1) }}{% endfor %}{{ '-' * 3 }}"
    )
    assert t.render("hi") == "<|user|>hi  7  1---"
    long = "y" * (2 * MAX_RENDER_CHARS)
    assert t.render(long) == f"<|user|>{long}  7  1---"
