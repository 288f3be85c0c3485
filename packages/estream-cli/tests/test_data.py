"""`estream.data` and the ``--ray``/``--output`` options where Ray is not needed: the library
without Ray, the actor's work done in this process, the options refused when they would do
nothing, and ``--output`` of the single-process command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import estream
from estream import data, tasks
from estream.errors import BadRequestError
from estream.tokenizer import Tokenizer
from estream_cli.main import main
from estream_layout import pack_model, synth_model

ENGINE_KW = {"G": 2, "Q": 2, "B": 2, "act": "f32"}
ENGINE = ("-G", "2", "-Q", "2", "-B", "2", "--act", "f32")


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("datapack")
    synth_model("qwen3moe", "tiny", d / "m.gguf", seed=4)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def pack_state(pack) -> dict:
    """Every file of a pack: its size, modification time and bytes."""
    return {
        p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(pack.iterdir())
    }


def test_import_estream_and_estream_data_load_no_ray() -> None:
    """`import estream` (and `estream.data`, and the command) leaves `ray` and `pyarrow` out of
    `sys.modules`, in a fresh process."""
    code = (
        "import json, sys\n"
        "import estream, estream.tasks, estream.data, estream_cli.main\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'pyarrow'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_without_ray_installed_ray_is_one_clear_error(pack, tmp_path) -> None:
    """With Ray not importable, ``--ray`` exits 2 with one line naming the extra to install,
    no traceback, and writes nothing; `data.need_ray` raises the same message."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from estream_cli.main import main\n"
        f"sys.exit(main(['classify', {str(pack)!r}, '--input', {str(src)!r}, '--labels', "
        f"'a,b', '--output', {str(out)!r}, '--ray']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"estream: error: {data.INSTALL_HINT}"]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_the_runner_answers_rows_as_the_task_functions(pack) -> None:
    """`TaskRunner.answer` (an actor's work) answers each row as `tasks.classify` does, a row's
    own field over the default, and a row that cannot be answered gets its exception; the
    pack is only read: no file in it is added, removed or changed."""
    before = pack_state(pack)
    runner = data.TaskRunner(
        pack, "classify", defaults={"labels": ["yes", "no"]}, engine=ENGINE_KW, verify=True
    )
    try:
        rows = [
            {"id": 1, "prompt": "is the sky blue?"},
            {"id": 2, "prompt": "pick one", "labels": "red,green"},
            {"id": 3, "prompt": "twice", "labels": ["a", "a"]},
            {"id": 4, "labels": ["a", "b"]},
        ]
        got = runner.answer(rows)
        tok = Tokenizer.from_gguf(pack)
        with estream.load(pack, **ENGINE_KW) as eng:
            want1 = tasks.classify(eng, tok, "is the sky blue?", ["yes", "no"]).to_dict()
            want2 = tasks.classify(eng, tok, "pick one", ["red", "green"]).to_dict()
        for res, want in ((got[0], want1), (got[1], want2)):
            d = res.to_dict()
            assert d.pop("metrics") and want.pop("metrics")
            assert d == want
        assert isinstance(got[2], BadRequestError) and "given twice" in str(got[2])
        assert isinstance(got[3], BadRequestError) and str(got[3]).startswith("no prompt")
    finally:
        runner.close()
    assert pack_state(pack) == before


def test_a_corrupt_pack_fails_the_first_block_and_every_later_one(pack, tmp_path) -> None:
    """An actor verifies the whole pack once, on a thread beside its load and first block: a
    flipped byte in an expert record is a PackError naming the problem instead of the first
    block's answers, and of every later block's; `close` leaves no check thread behind."""
    import shutil
    import threading

    bad = tmp_path / "bad.estream"
    shutil.copytree(pack, bad)
    experts = bad / "experts.bin"
    blob = bytearray(experts.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    experts.write_bytes(bytes(blob))
    with estream.load(bad, **ENGINE_KW):  # a load alone reads no expert record: it passes
        pass
    runner = data.TaskRunner(bad, "classify", defaults={"labels": ["a", "b"]}, engine=ENGINE_KW)
    try:
        for _ in range(2):
            with pytest.raises(estream.PackError, match=r"experts\.bin.*checksum"):
                runner.answer([{"id": 1, "prompt": "hi"}])
    finally:
        runner.close()
    assert not [t for t in threading.enumerate() if t.name == "estream-pack-check"]


def test_a_pack_that_fails_to_load_reports_its_check(pack, tmp_path) -> None:
    """When the load itself fails on a damaged pack, the runner's error is the whole-pack
    check's (every file's problems counted), not the load's (its first file only)."""
    import shutil

    bad = tmp_path / "bad.estream"
    shutil.copytree(pack, bad)
    for name in ("model.gguf", "experts.bin"):
        blob = bytearray((bad / name).read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (bad / name).write_bytes(bytes(blob))
    with pytest.raises(estream.PackError, match=r"model\.gguf: checksum .*\(and 1 more\)"):
        data.TaskRunner(bad, "classify", engine=ENGINE_KW)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--actors", "2"], "--actors goes with --ray"),
        (["--block-rows", "8"], "--block-rows goes with --ray"),
        (["--output", "x.parquet"], "Parquet is written with --ray only"),
    ],
)
def test_ray_options_without_ray_are_refused(pack, tmp_path, capsys, extra, message) -> None:
    """An option of a Ray batch given without ``--ray`` is one error line, exit 2."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    rc = main(["classify", str(pack), "--input", str(src), "--labels", "a,b", *ENGINE, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_ray_needs_an_input_file(pack, capsys) -> None:
    """``--ray`` without ``--input`` is refused: a Ray run is a batch."""
    rc = main(["classify", str(pack), "--prompt", "hi", "--labels", "a,b", *ENGINE, "--ray"])
    assert rc == 2 and "--ray runs a batch" in capsys.readouterr().err


def test_output_writes_the_result_lines_and_keeps_a_file_on_failure(pack, tmp_path, capsys):
    """``--output FILE`` holds exactly the lines the batch prints without it (less the metrics);
    a batch that fails before answering leaves an existing FILE as it was."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"row {i}"}) + "\n" for i in range(5)))
    argv = ["classify", str(pack), "--input", str(src), "--labels", "yes,no", *ENGINE]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    out = tmp_path / "out.jsonl"
    assert main([*argv, "--output", str(out)]) == 0
    assert capsys.readouterr().out == ""

    def strip(lines):
        return [{k: v for k, v in json.loads(s).items() if k != "metrics"} for s in lines]

    assert strip(out.read_text().splitlines()) == strip(printed)
    out.write_text("keep me\n")
    src.write_text('{"id": 1, "prompt": "x"}\nnot json\n')
    assert main([*argv, "--output", str(out)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_pack_check_runs_below_the_priority_of_the_passes(pack, monkeypatch) -> None:
    """The actor's whole-pack check runs on a thread whose niceness is the actor's plus
    `CHECK_NICENESS` (capped at 19), so the passes get the cores first; the thread that
    started it keeps its own niceness, and the check still checks the pack."""
    import os
    import threading

    seen: list[int] = []
    check = data.verify_once

    def recorded(pack, stop=None):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        check(pack, stop=stop)

    monkeypatch.setattr(data, "verify_once", recorded)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    c = data._Check(pack)
    c.result()
    assert seen == [min(19, mine + data.CHECK_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert c.seconds is not None and c.seconds > 0


def test_a_tokenizer_that_fails_beside_the_load_fails_the_runner_and_closes_the_engine(
    pack, monkeypatch
) -> None:
    """The tokenizer is read on a thread beside the model's load: when it fails, the runner
    raises its error (not a result-less runner) and the engine loaded beside it is closed."""
    from estream import engine as engine_mod
    from estream import tokenizer as tokenizer_mod

    loaded: list = []
    real_load = engine_mod.load

    def load(*a, **kw):
        loaded.append(real_load(*a, **kw))
        return loaded[-1]

    def broken(path):
        raise BadRequestError("model.gguf: no vocabulary")

    monkeypatch.setattr(engine_mod, "load", load)
    monkeypatch.setattr(tokenizer_mod.Tokenizer, "from_gguf", staticmethod(broken))
    with pytest.raises(BadRequestError, match="no vocabulary"):
        data.TaskRunner(pack, "classify", engine=ENGINE_KW)
    assert len(loaded) == 1 and loaded[0]._closed


LAYER_FAULTS = """
import json, os, resource, sys, threading
import numpy as np
from estream.memory import keep_freed_heap

keep_freed_heap()


def layer(x):
    q, k, v = x * 2, x + 1, x - 1
    qn, kn = q / 3, k / 3
    del q, k
    kept = np.ones(100)  # a small block allocated after them, as the ops' bookkeeping is
    return (qn + kn + v) * 0.5, kept


def faults():
    x = np.ones((3166, 2048), np.float32)
    kept = []
    x, k = layer(x)  # the first layer maps the heap
    kept.append(k)
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(16):
        x, k = layer(x)
        kept.append(k)
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)


out = []
t = threading.Thread(target=faults)
t.start()
t.join()
print(json.dumps({"faults": out[0], "pages": 3166 * 2048 * 4 // os.sysconf("SC_PAGE_SIZE")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc arenas and RUSAGE_THREAD")
def test_a_thread_of_an_actor_process_reuses_the_freed_activations_of_a_pass() -> None:
    """In a process started with `data.ACTOR_ENV` (an actor's), 16 layers' worth of
    ``[3166, 2048]`` float32 activations made and freed on a thread other than the main one
    (where Ray runs an actor's passes) come from freed heap memory: fewer page faults than one
    such array has pages (in a thread arena of its own, each layer faulted its arrays in
    again)."""
    import os

    env = os.environ | data.ACTOR_ENV
    done = subprocess.run(
        [sys.executable, "-c", LAYER_FAULTS], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["faults"] < got["pages"], got


def test_each_actor_loads_with_the_commands_engine_options(pack) -> None:
    """`--ray`'s actors load with every engine option the command was given (none dropped
    on the way): `--pin` and `--read-margin` too, and a `--budget` chosen for passes of
    `--batch-tokens` (without it, for the profile's pass: `budget_tokens` None)."""
    from estream_cli.main import build_parser
    from estream_cli.ray_commands import _engine_kwargs

    base = ["classify", str(pack), "--input", "in.jsonl", "--labels", "a,b", "--ray"]
    args = build_parser().parse_args(
        [*base, "--budget", "1GiB", "--pin", "auto", "--read-margin", "0.25",
         "--batch-tokens", "512", "--act", "f32", "--schedule", "after-routing"]
    )  # fmt: skip
    kw = _engine_kwargs(args)
    assert kw["budget"] == "1GiB" and kw["budget_tokens"] == 512
    assert kw["pin"] == "auto" and kw["read_margin"] == 0.25
    assert kw["act"] == "f32" and kw["schedule"] == "after-routing"
    kw = _engine_kwargs(build_parser().parse_args([*base, "--budget", "1GiB"]))
    assert kw["budget_tokens"] is None and kw["pin"] is None and kw["read_margin"] is None
    # a batch length without a budget chooses nothing: the stored configuration is used
    assert (
        _engine_kwargs(build_parser().parse_args([*base, "--batch-tokens", "64"]))["budget_tokens"]
        is None
    )
    # every keyword is an engine option (the actors' `estream.load` takes them as they are)
    from estream import EngineOptions

    EngineOptions(**_engine_kwargs(build_parser().parse_args([*base, "-G", "2", "-Q", "1"])))
