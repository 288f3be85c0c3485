"""`estream.data` and ``--ray`` on a local Ray instance (needs the extra ``estream-cli[ray]``;
run by ``nox -s ray``): the same answers as the single-process command, every row exactly once,
a SIGKILLed actor restarted with no row lost or duplicated, Parquet in and out."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
from ray import cloudpickle

import estream
from estream import data, tasks
from estream.tokenizer import Tokenizer
from estream_cli.main import main
from estream_layout import pack_model, synth_model

ENGINE = ("-G", "2", "-Q", "2", "-B", "2")
ENGINE_KW = {"G": 2, "Q": 2, "B": 2}
LABELS = ["no", "yes", "maybe"]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the killing runner below


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("raypack")
    synth_model("qwen3moe", "tiny", d / "m.gguf", seed=4)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (the command uses it rather than start its own)."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def without_metrics(line: dict) -> dict:
    """A result line less its timings and pass ids (which differ from run to run)."""
    return {k: v for k, v in line.items() if k != "metrics"}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines()]


def corpus(n: int) -> list[dict]:
    """Short utterances (MASSIVE-like), ids mostly integers, some lines without one, and two
    requests the model cannot answer (a label given twice, an empty prompt)."""
    rows: list[dict] = []
    for i in range(n):
        row: dict = {"prompt": f"wake me at {i % 12} please {i % 7}"}
        if i % 97 != 5:
            row = {"id": i, **row}
        rows.append(row)
    rows[10]["labels"] = ["a", "a"]
    rows[1234 % n]["prompt"] = ""
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_2000_rows_on_two_actors_equal_the_single_process_command(
    pack, local_ray, tmp_path, capsys
):
    """A 2,000-row JSON Lines classify through ``--ray --actors 2`` writes the lines the
    command without ``--ray`` writes, bit for bit (less the metrics), in input order, error
    lines included, each input line answered exactly once, with the same exit code."""
    src = write_jsonl(tmp_path / "in.jsonl", corpus(2000))
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    argv = ["classify", str(pack), "--input", str(src), "--labels", ",".join(LABELS), *ENGINE]
    rc1 = main([*argv, "--output", str(one)])
    rc2 = main([*argv, "--output", str(two), "--ray", "--actors", "2", "--block-rows", "128"])
    err = capsys.readouterr().err
    assert rc1 == rc2 == 2, err  # two requests failed on their own lines
    a, b = read_lines(one), read_lines(two)
    assert len(a) == len(b) == 2000
    assert [without_metrics(x) for x in a] == [without_metrics(y) for y in b]
    keys = Counter(json.dumps(x.get("id", ("line", x.get("line")))) for x in b)
    assert len(keys) == 2000 and set(keys.values()) == {1}
    assert sum("error" in x for x in b) == 2
    assert "2000 requests on 2 actors (Ray)" in err


TASK_ROWS = {
    "score": [{"id": i, "context": f"the cat sat {i}", "choices": ["on it", "far away"]}
              for i in range(6)],
    "rerank": [{"id": i, "query": f"cats {i}",
                "docs": ["cats sit", {"id": "x", "text": "rain"}, {"id": None, "text": "mats"}]}
               for i in range(4)],
    "embed": [{"id": i, "prompt": f"hello {i}", "pool": ["last", "mean"][i % 2],
               "normalize": i % 3 == 0} for i in range(6)] + [{"id": "e", "prompt": ""}],
}  # fmt: skip


@pytest.mark.parametrize("task", sorted(TASK_ROWS))
def test_score_rerank_embed_on_ray_equal_the_single_process_command(
    pack, local_ray, tmp_path, capsys, task
):
    """``score``, ``rerank`` and ``embed`` batches through ``--ray`` write the lines the
    command writes without it (less the metrics), error lines included."""
    src = write_jsonl(tmp_path / "in.jsonl", TASK_ROWS[task])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    argv = [task, str(pack), "--input", str(src), *ENGINE]
    rc1 = main([*argv, "--output", str(one)])
    rc2 = main([*argv, "--output", str(two), "--ray", "--actors", "2", "--block-rows", "2"])
    assert rc1 == rc2, capsys.readouterr().err
    a, b = read_lines(one), read_lines(two)
    assert len(a) == len(TASK_ROWS[task]) and "error" not in a[0]
    assert [without_metrics(x) for x in a] == [without_metrics(y) for y in b]


class KillOnce(data.TaskRunner):
    """A runner whose actor kills itself with SIGKILL the first time it is given the block
    holding row `KILL_AT`, before answering it (`MARKER` records the pid it killed)."""

    MARKER = ""
    KILL_AT = 0

    def __call__(self, batch):
        ids = batch.column("id").to_pylist()
        if self.KILL_AT in ids:
            try:
                fd = os.open(self.MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(batch)


def test_an_actor_killed_mid_job_loses_and_duplicates_no_row(pack, local_ray, tmp_path):
    """On two actors, the actor given row 150 is SIGKILLed mid-job: Ray restarts it and runs
    the block again; every row is answered exactly once, with the answers of the engine run
    in this process."""
    rows = [{"id": i, "prompt": f"set an alarm {i}"} for i in range(300)]
    marker = tmp_path / "killed"
    runner = type("KillAt150", (KillOnce,), {"MARKER": str(marker), "KILL_AT": 150})
    out = data.apply(
        ray.data.from_items(rows, override_num_blocks=12),
        "classify",
        pack,
        defaults={"labels": LABELS},
        actors=2,
        batch_size=25,
        engine=ENGINE_KW,
        runner=runner,
    ).take_all()
    assert marker.exists() and int(marker.read_text()) > 0  # the kill happened
    assert Counter(r["id"] for r in out) == Counter(range(300))
    tok = Tokenizer.from_gguf(pack)
    with estream.load(pack, **ENGINE_KW) as eng:
        plans = [tasks.plan_classify(eng, tok, r["prompt"], LABELS) for r in rows]
        want = {r["id"]: res.to_dict() for r, res in zip(rows, tasks.run_plans(eng, plans))}
    for r in out:
        assert r["error"] is None
        assert r["best"] == want[r["id"]]["best"]
        assert r["labels"] == want[r["id"]]["labels"]


def test_the_helpers_answer_as_the_api(pack, local_ray):
    """`data.score`, `rerank`, `embed` and `classify` give, row by row, the fields the task
    functions give in this process; a row that cannot be answered is a row with an `error`."""
    tok = Tokenizer.from_gguf(pack)
    ctx = [{"id": i, "context": f"the cat sat {i}"} for i in range(5)]
    choices = ["on the mat", "in the sky"]
    docs = [{"id": "d1", "text": "cats sit on mats"}, {"id": "d2", "text": "rain"}]
    with estream.load(pack, **ENGINE_KW) as eng:
        got = data.score(ray.data.from_items(ctx), pack, choices=choices, engine=ENGINE_KW)
        for r in got.take_all():
            want = tasks.score(eng, tok, r_ctx := ctx[r["id"]]["context"], choices).to_dict()
            assert r_ctx and r["choices"] == want["choices"] and r["best"] == want["best"]
        q = [
            {"id": 0, "query": "where do cats sit"},
            {"id": 1, "query": "and dogs", "docs": [{"id": "e", "text": "  "}]},
        ]
        got = data.rerank(ray.data.from_items(q), pack, docs=docs, engine=ENGINE_KW)
        rows = sorted(got.take_all(), key=lambda r: r["id"])
        assert rows[0]["docs"] == tasks.rerank(eng, tok, q[0]["query"], docs).to_dict()["docs"]
        assert rows[0]["error"] is None and rows[1]["error"] == "document 1 is empty"
        p = [{"id": 0, "prompt": "hello there"}, {"id": 1, "prompt": ""}]
        got = data.embed(ray.data.from_items(p), pack, pool="mean", engine=ENGINE_KW)
        rows = sorted(got.take_all(), key=lambda r: r["id"])
        want = tasks.embed(eng, tok, "hello there", pool="mean").to_dict()["embedding"]
        assert rows[0]["embedding"] == want and rows[0]["error"] is None
        got = data.classify(ray.data.from_items(p), pack, labels=["a", "a"], engine=ENGINE_KW)
        assert all("given twice" in r["error"] for r in got.take_all())


def test_parquet_out_and_in(pack, local_ray, tmp_path, capsys):
    """``--output NAME.parquet`` writes a new Parquet directory whose rows are the JSON Lines
    results (by id); an existing path is refused before anything runs and left as it was;
    a Parquet input answers as the same JSON Lines input does."""
    rows = [{"id": i, "prompt": f"play song {i}"} for i in range(60)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    base = ["classify", str(pack), "--labels", ",".join(LABELS), *ENGINE, "--ray"]
    one = tmp_path / "one.jsonl"
    assert main([*base, "--input", str(src), "--output", str(one), "--block-rows", "16"]) == 0
    want = {x["id"]: without_metrics(x) for x in read_lines(one)}
    outdir = tmp_path / "out.parquet"
    assert main([*base, "--input", str(src), "--output", str(outdir)]) == 0
    assert outdir.is_dir() and not list(tmp_path.glob(".out.parquet.*"))
    table = pq.read_table(outdir).to_pylist()
    assert sorted(r["id"] for r in table) == list(range(60))
    for r in table:
        assert r["error"] is None
        assert r["best"] == want[r["id"]]["best"] and r["labels"] == want[r["id"]]["labels"]
    before = sorted(p.name for p in outdir.iterdir())
    capsys.readouterr()
    assert main([*base, "--input", str(src), "--output", str(outdir)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in outdir.iterdir()) == before
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    two = tmp_path / "two.jsonl"
    assert main([*base, "--input", str(tmp_path / "in.parquet"), "--output", str(two)]) == 0
    assert {x["id"]: without_metrics(x) for x in read_lines(two)} == want


def test_a_corrupt_pack_fails_the_job_with_its_checksum_error(pack, local_ray, tmp_path, capsys):
    """An actor verifies the pack beside its first block: a flipped byte in an expert record
    fails the job with one last line naming the checksum that differs (no answer is written
    before the check has passed), exit 1, nothing written."""
    import shutil

    bad = tmp_path / "bad.estream"
    shutil.copytree(pack, bad)
    blob = bytearray((bad / "experts.bin").read_bytes())
    blob[100] ^= 0xFF
    (bad / "experts.bin").write_bytes(bytes(blob))
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    argv = ["classify", str(bad), "--input", str(src), "--labels", "a,b", *ENGINE, "--ray"]
    assert main([*argv, "--output", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("estream: error: ") and "checksum" in last and "experts.bin" in last
    assert not out.exists()


def test_a_local_ray_runs_its_actors_at_the_commands_priority(tmp_path):
    """The local Ray instance the command starts runs its workers at the command's own
    niceness (Ray's default, 15, lets any other process take an actor's cores first)."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import argparse, os, ray
        from estream_cli.ray_commands import _start_ray
        assert _start_ray(ray, argparse.Namespace(ray=None), 1, 1)
        try:
            print(os.nice(0), ray.get(ray.remote(lambda: os.nice(0)).remote()))
        finally:
            ray.shutdown()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    mine, worker = out.stdout.split()
    assert worker == mine


class ArenaProbe(data.TaskRunner):
    """A runner whose answer to a block is its process's ``MALLOC_ARENA_MAX`` and the page
    faults, on the thread Ray calls it on, of 16 layers' worth of ``[3166, 2048]`` float32
    activations made and freed there (after a first layer that maps the heap)."""

    def __call__(self, batch):
        import resource

        import numpy as np

        def layer(x):
            q, k, v = x * 2, x + 1, x - 1
            qn, kn = q / 3, k / 3
            del q, k
            return (qn + kn + v) * 0.5, np.ones(100)

        x, kept = layer(np.ones((3166, 2048), np.float32))
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(16):
            x, k = layer(x)
            kept = (kept, k)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        return pa.table({"arena_max": [os.environ.get("MALLOC_ARENA_MAX")], "faults": [faults]})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD")
def test_an_actor_reuses_the_freed_activations_of_its_passes(pack, local_ray):
    """An actor's process starts with `data.ACTOR_ENV`, so the thread Ray runs its blocks on
    takes a pass's activations from freed heap memory: fewer page faults for 16 layers of
    ``[3166, 2048]`` float32 arrays than one such array has pages (with an arena of its own,
    each layer faulted its arrays in again, ~2 pages a page)."""
    out = data.apply(
        ray.data.from_items([{"id": 0, "prompt": "hi"}]),
        "classify",
        pack,
        defaults={"labels": LABELS},
        engine=ENGINE_KW,
        runner=ArenaProbe,
    ).take_all()
    assert len(out) == 1
    assert out[0]["arena_max"] == data.ACTOR_ENV["MALLOC_ARENA_MAX"]
    assert out[0]["faults"] < 3166 * 2048 * 4 // os.sysconf("SC_PAGE_SIZE"), out


def test_a_job_reports_its_phases_and_shares_its_rows_between_the_actors(
    pack, local_ray, tmp_path, capsys
):
    """Without ``--block-rows`` 200 rows on two actors are two blocks of 100 (the rows shared
    evenly: no block splits a pass the command without ``--ray`` makes on one actor); the
    job's phases line on stderr names the driver's steps and each actor's start, load, pack
    check and first block."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"hi {i}"} for i in range(200)])
    argv = ["classify", str(pack), "--input", str(src), "--labels", ",".join(LABELS), *ENGINE]
    out = ["--output", str(tmp_path / "o.jsonl"), "--ray", "--actors", "2"]
    assert main([*argv, *out]) == 0
    phases = [s for s in capsys.readouterr().err.splitlines() if " phases: " in s]
    assert len(phases) == 1, phases
    line = phases[0]
    for part in ("Ray start", "first block back", "writing", "model load", "pack check"):
        assert part in line, line
    assert "(100 rows;" in line and "(200 rows;" not in line
    assert ("s old)" in line) == sys.platform.startswith("linux")  # the actor process's age
    assert "2 blocks answered in" in line
    # each block went to its own actor (not both to the first actor up)
    assert len(re.findall(r"actor \d+: ", line)) == 2, line


def test_each_block_carries_its_timings_and_the_first_the_actors_start(pack):
    """With ``timings`` a block's first row holds its timings (rows, seconds of the block, of
    its passes, of the wait for the check), the actor's first block also the start phases and
    the check's duration; the other rows hold none, and the answers are the same as without."""
    kw = {"defaults": {"labels": LABELS}, "engine": ENGINE_KW}
    runner = data.TaskRunner(pack, "classify", timings=True, **kw)
    plain = data.TaskRunner(pack, "classify", **kw)
    try:
        block = pa.table({"id": [1, 2, 3], "prompt": ["a b", "c d", "e"]})
        first, second, bare = runner(block), runner(block), plain(block)
    finally:
        runner.close()
        plain.close()
    for out in (first, second):
        col = out.column("_timings").to_pylist()
        assert col[0] is not None and col[1:] == [None, None]
        assert out.drop_columns(["_timings"]).drop_columns(["metrics"]).to_pylist() == (
            bare.drop_columns(["metrics"]).to_pylist()
        )
    t1 = json.loads(first.column("_timings")[0].as_py())
    t2 = json.loads(second.column("_timings")[0].as_py())
    assert t1["rows"] == t2["rows"] == 3 and t1["actor"] == os.getpid()
    assert t1["block_s"] >= t1["run_s"] + t1["plan_s"] + t1["wait_s"] > 0
    assert set(t1["init"]) == {"started", "process_s", "imports_s", "tokenizer_s", "load_s"}
    assert t1["init"]["process_s"] > t1["init"]["imports_s"]  # this process is the test run
    assert t1["check_s"] > 0 and t1["init"]["load_s"] > 0
    assert "init" not in t2 and "check_s" not in t2
    assert "_timings" not in bare.column_names


def test_an_interrupt_as_the_parquet_temporary_is_made_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C the moment the Parquet output's temporary directory is made: it is removed,
    nothing is at the target."""
    from estream_cli.ray_commands import _write_parquet

    real = os.mkdir
    made: list[str] = []

    def interrupted(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if ".tmp" in os.path.basename(os.fspath(path)):
            made.append(os.fspath(path))
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write_parquet(object(), str(tmp_path / "out.parquet"), [])
    assert len(made) == 1
    assert list(tmp_path.iterdir()) == []
