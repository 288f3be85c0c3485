"""``estream classify|score|rerank|embed --input FILE --ray [ADDRESS] --actors N``: a batch run
on Ray Data (`estream.data`; the extra ``estream-cli[ray]``).

* Input: a JSON Lines file is read and checked here, on the driver, exactly as without
  ``--ray`` (same limits, same one-line errors naming the line, before any actor starts); a
  Parquet file or directory (``*.parquet``, or a directory) is read by Ray Data's reader on
  the cluster, its columns checked here and each row's fields by the actor that answers it
  (a bad row is a result row with an ``error``).
* Output: JSON Lines (``--output FILE`` or standard output) through the one output writer, in
  input order, each line as the command without ``--ray`` writes it; or Parquet
  (``--output NAME.parquet``), written by Ray Data's writer as a *directory* of part files —
  into a new temporary directory beside it, renamed onto ``NAME.parquet`` once complete. An
  existing ``NAME.parquet`` is refused, never replaced or added to.
* Every input row is answered exactly once: the results are counted against the input (by
  position, or by ``id`` for Parquet) before anything is written, and a shortfall or a
  duplicate is an error, not a file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from estream.errors import BadRequestError, EStreamError

from .messages import plural
from .options import check_engine_opts, engine_kwargs, positive_int
from .output import STDOUT, check_output, write_json

__all__ = ["add_ray_opts", "run_ray"]

#: Seconds the job waits for every actor to start and load the model before giving blocks out.
ACTOR_START_TIMEOUT_S = 3600

#: Most rows of one block without ``--block-rows`` (`default_block_rows`): one call of an
#: actor, and what is answered again if the actor dies.
DEFAULT_BLOCK_ROWS = 256


def add_ray_opts(p: argparse.ArgumentParser) -> None:
    """The options of a batch on Ray, added to a task command's parser."""
    p.add_argument(
        "--output",
        metavar="FILE",
        help="batch: write the result lines here instead of standard output (replaced "
        "atomically); with --ray, NAME.parquet writes a new Parquet directory",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="batch: run on Ray Data (needs estream-cli[ray]); ADDRESS of a running cluster "
        "(e.g. ray://head:10001 or auto), none for a local Ray on this machine; --input may "
        "then be Parquet too",
    )
    p.add_argument(
        "--actors",
        type=positive_int,
        metavar="N",
        help="with --ray: N actors, each loading the model once (default 1); --threads is per "
        "actor (default 1), --budget too",
    )
    p.add_argument(
        "--block-rows",
        type=positive_int,
        metavar="N",
        help="with --ray: requests per block, the unit an actor answers and a restarted actor "
        f"answers again (default: the requests shared evenly between the actors, at most "
        f"{DEFAULT_BLOCK_ROWS} a block)",
    )


def _is_parquet(path: str) -> bool:
    return path.endswith(".parquet") or (path != STDOUT and Path(path).is_dir())


def _check_args(args: argparse.Namespace) -> None:
    if args.ray is None:
        for opt, v in (("--actors", args.actors), ("--block-rows", args.block_rows)):
            if v is not None:
                raise BadRequestError(f"{opt} goes with --ray; add --ray or drop {opt}")
        if args.output is not None and args.input is None:
            raise BadRequestError("--output goes with --input (a batch); add --input FILE")
        if args.output is not None and _is_parquet(args.output):
            raise BadRequestError(
                f"--output {args.output}: Parquet is written with --ray only; add --ray or "
                "give a .jsonl path"
            )
        return
    if args.input is None:
        raise BadRequestError("--ray runs a batch: give --input FILE.jsonl or FILE.parquet")
    if args.json:
        raise BadRequestError(
            "--json does nothing with --input: a batch's results are JSON lines already; drop it"
        )
    if args.backend != "host":
        raise BadRequestError(
            f"--backend {args.backend} does not go with --ray: each actor runs the host backend"
        )


def _check_parquet_output(path: str) -> None:
    if os.path.lexists(path):
        raise BadRequestError(
            f"--output {path}: already exists; Parquet output is a new directory and this "
            "command never replaces or adds to one it did not create: give a new path"
        )
    parent = Path(path).parent
    if not parent.is_dir():
        raise BadRequestError(f"--output {path}: directory {parent} does not exist")


def run_single(args: argparse.Namespace, run: Any) -> int:
    """The command without ``--ray``: ``run()`` prints the result lines; with ``--output`` they
    are collected and written through the output writer when the command succeeds."""
    _check_args(args)
    if args.output is None:
        return int(run())
    check_output(args.output, "--output")
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = int(run())
    data = buf.getvalue().encode("utf-8")
    from .output import write_output

    write_output(args.output, "--output", lambda f: f.write(data))
    return rc


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Each actor's `estream.load` options: the command's (`engine_kwargs`). A ``--budget`` is
    chosen for passes of ``--batch-tokens`` when given (the actors' passes are at most that
    long, a longer request alone; the requests are not read here to find the longest), else for
    the profile's pass, from which the actors' default pass length is derived to fit it."""
    return engine_kwargs(args, args.batch_tokens)


def _defaults(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The options a request row without that field falls back to."""
    if name == "classify":
        return {"prompt": args.prompt, "labels": args.labels, "method": args.method}
    if name == "score":
        return {"context": args.context, "choices": args.choices}
    if name == "rerank":
        return {"query": args.query, "docs": args.docs}
    return {"prompt": args.prompt, "pool": args.pool, "normalize": args.normalize}


def _start_ray(ray: Any, args: argparse.Namespace, actors: int, threads: int) -> bool:
    """Connect to Ray (or start a local instance); whether this call started it (a Ray this
    process had already started is used as it is, and left running)."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    if args.ray:
        try:
            ray.init(address=args.ray, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            msg = " ".join(str(exc).split())
            raise BadRequestError(f"--ray {args.ray}: cannot connect to Ray ({msg})") from None
    else:  # a local instance: the actors' CPUs, one more for the readers and writers
        cpus = max(os.cpu_count() or 1, actors * threads) + 1
        # Ray starts its workers at niceness 15 by default: the actors are this command's
        # work, so they run at the priority of the command itself.
        system = {"worker_niceness": 0}
        ray.init(num_cpus=cpus, include_dashboard=False, _system_config=system, **quiet)
    ctx = ray.data.DataContext.get_current()
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ctx.enable_progress_bars = False
    return True


def _parquet_columns(path: str, allowed: tuple[str, ...]) -> list[Any]:
    """The ``id`` column of a Parquet input, after checking its columns."""
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise BadRequestError(f"cannot read --input {path}: no such file or directory")
    try:
        names = list(pq.ParquetDataset(path).schema.names)
        ids = pq.read_table(path, columns=["id"]).column("id").to_pylist() if "id" in names else []
    except (OSError, ValueError) as exc:
        raise BadRequestError(f"cannot read --input {path}: {' '.join(str(exc).split())}") from None
    for n in names:
        if n not in allowed:
            raise BadRequestError(
                f"--input {path}: unknown column {n!r} (expected: {', '.join(allowed)})"
            )
    if "id" not in names:
        raise BadRequestError(
            f"--input {path}: no 'id' column; a Parquet input needs one to key its results"
        )
    return list(ids)


def _read_input(
    args: argparse.Namespace, task: Any, requests: Any, parquet_in: bool, parquet_out: bool
) -> tuple[list[tuple[dict[str, Any], str, dict[str, Any]]], list[Any]]:
    """The checked JSON Lines requests (none for a Parquet input, which Ray reads itself) and
    the ids that key Parquet results (a Parquet input's 'id' column, or every line's 'id')."""
    if parquet_in:
        ids = _parquet_columns(args.input, ("id", *task.fields))
        if not ids:
            raise BadRequestError(f"--input {args.input} has no rows")
        return [], ids
    reqs = list(requests())
    if not parquet_out:
        return reqs, []
    ids = [key.get("id") for key, _, _ in reqs]
    if any("id" not in key for key, _, _ in reqs):
        raise BadRequestError(
            f"--output {args.output}: Parquet results are keyed by 'id'; give every "
            "input line an 'id'"
        )
    if len({type(i) for i in ids}) > 1:
        raise BadRequestError(
            f"--output {args.output}: a Parquet 'id' column holds one type; give every "
            "input line a string 'id', or every line an integer one"
        )
    return reqs, ids


def run_ray(args: argparse.Namespace, task: Any, requests: Any) -> int:
    """The batch on Ray Data (see the module doc); ``requests()`` yields the checked requests
    of a JSON Lines input as the command without ``--ray`` reads them."""
    from estream import data
    from estream.packed import PackedModel

    _check_args(args)
    t0 = time.perf_counter()
    actors, threads = args.actors or 1, args.threads or 1
    out_path = args.output if args.output is not None else STDOUT
    parquet_out = _is_parquet(out_path)
    if parquet_out:
        _check_parquet_output(out_path)
    else:
        check_output(out_path, "--output")
    parquet_in = args.input != "-" and _is_parquet(args.input)
    reqs, ids = _read_input(args, task, requests, parquet_in, parquet_out)
    n = len(ids) if parquet_in else len(reqs)
    block_rows = args.block_rows or default_block_rows(n, actors)
    PackedModel(args.model)  # a missing or broken pack fails here, once, not in every actor
    check_engine_opts(args)
    phases = Phases(t0)
    phases.mark("input")
    ray = data.need_ray()
    phases.mark("import_ray")
    started = _start_ray(ray, args, actors, threads)
    phases.mark("ray_init")
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # Blocks go out once every actor has loaded the model: the first actor up would otherwise
    # take blocks meant to be shared (Ray Data's default provisions the pool asynchronously).
    ctx.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S
    try:
        if parquet_in:
            ds = ray.data.read_parquet(args.input)
        else:
            items = [
                {"_pos": i, data.REQUEST_COLUMN: json.dumps(req)}
                | ({"id": key["id"]} if parquet_out else {})
                for i, (key, _, req) in enumerate(reqs)
            ]
            ds = ray.data.from_items(items, override_num_blocks=max(1, math.ceil(n / block_rows)))
        common = {
            "actors": actors,
            "threads": threads,
            "batch_size": block_rows,
            "batch_tokens": args.batch_tokens,
            "template": args.template,
            "engine": _engine_kwargs(args),
            "defaults": _defaults(args, task.name),
        }
        t1 = time.perf_counter()
        phases.mark("dataset")
        try:
            if parquet_out:
                out = data.apply(ds, task.name, args.model, output="columns", **common)
                failed = _write_parquet(out, out_path, ids)
                broken = 0
                phases.mark("run_and_write")
            else:
                out = data.apply(
                    ds,
                    task.name,
                    args.model,
                    keep=("_pos",),
                    output="json",
                    timings=True,
                    **common,
                )
                lines, failed, broken = _result_lines(out, reqs, ids, args.input, phases)
                phases.mark("collect")
                write_json(out_path, "--output", lines, lines=True)
                phases.mark("write")
        except Exception as exc:
            raise _own_error(exc) from None
        dt = time.perf_counter() - t1
    finally:
        if started:
            ray.shutdown()
    fails = f", {failed} failed (see their 'error' field)" if failed else ""
    print(
        f"estream {task.name}: {plural(n, 'request')} on {plural(actors, 'actor')} (Ray), "
        f"{dt:.2f} s ({n / max(dt, 1e-9):.1f}/s; start {t1 - t0:.2f} s){fails}",
        file=sys.stderr,
    )
    print(f"estream {task.name}: phases: {phases.describe()}", file=sys.stderr)
    return 1 if broken else 2 if failed else 0


def default_block_rows(rows: int, actors: int) -> int:
    """Rows of a block without ``--block-rows``: the rows shared evenly between the actors, at
    most `DEFAULT_BLOCK_ROWS` (a pass never spans two blocks, so fewer blocks than that make
    no more passes than the command without ``--ray`` makes on one actor)."""
    return max(1, min(DEFAULT_BLOCK_ROWS, math.ceil(rows / actors)))


class Phases:
    """Where a ``--ray`` job's time went: the driver's own steps (seconds from the start of
    `run_ray` to each `mark`) and what the actors report with each block (`TaskRunner`'s
    ``_timings``), summed up in one line by `describe`."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.marks: dict[str, float] = {}
        self.blocks: list[dict[str, Any]] = []
        self.first_block: float | None = None  # when the first block's results came back
        self.job_started: float | None = None  # wall clock: execution began (see `mark`)

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()
        if name == "dataset":
            self.job_started = time.time()

    def arrived(self) -> None:
        """Results came back (the first time: the first block's)."""
        if self.first_block is None:
            self.first_block = time.perf_counter()

    def describe(self) -> str:
        parts: list[str] = []
        prev = self.t0
        names = {
            "input": "input and pack checked",
            "import_ray": "Ray imported",
            "ray_init": "Ray start",
            "dataset": "dataset",
            "collect": "all blocks back",
            "write": "writing",
            "run_and_write": "run and Parquet writing",
        }
        for name, t in self.marks.items():
            if name == "collect" and self.first_block is not None:
                parts.append(f"first block back {self.first_block - prev:.2f} s")
                prev = self.first_block
            parts.append(f"{names[name]} {t - prev:.2f} s")
            prev = t
        firsts = [b for b in self.blocks if "init" in b]
        for b in firsts:
            init = b["init"]
            up = init["started"] - (self.job_started or init["started"])
            check = b.get("check_s")
            proc = init.get("process_s")
            parts.append(
                f"actor {b['actor']}: up after {up:.2f} s"
                + (f" (its process {proc:.2f} s old)" if proc is not None else "")
                + f", imports {init['imports_s']:.2f} s, "
                f"tokenizer {init['tokenizer_s']:.2f} s, model load {init['load_s']:.2f} s, "
                + (f"pack check {check:.2f} s, " if check is not None else "")
                + f"first block {b['block_s']:.2f} s ({b['rows']} rows; "
                f"waited {b.get('wait_s', 0.0):.2f} s for the check)"
            )
        if self.blocks:
            secs = [b["block_s"] for b in self.blocks]
            passes = sum(b.get("run_s", 0.0) for b in self.blocks)
            parts.append(
                f"{plural(len(secs), 'block')} answered in {sum(secs):.2f} s "
                f"(longest {max(secs):.2f} s; in the passes {passes:.2f} s)"
            )
        return "; ".join(parts)


def _own_error(exc: BaseException) -> BaseException:
    """The EStream error behind an exception Ray raised for an actor (a pack that fails its
    check, a budget too small, ...), re-raised here with its own message; else ``exc``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, EStreamError) and type(e).__module__.startswith("estream"):
            return e
        cause = getattr(e, "cause", None)  # a Ray error's wrapped exception
        todo += [e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None]
    # An actor that died in its constructor reaches the driver as text only: its last line
    # names the error (``estream.errors.PackError: …``).
    found = _NAMED_ERROR.findall(str(exc))
    if found:
        return EStreamError(f"an actor could not start: {found[-1]}")
    return exc


_NAMED_ERROR = re.compile(r"\bestream[\w.]*\.\w+Error: (.+?)(?=$|\n)")


def _result_lines(
    out: Any,
    reqs: list[tuple[dict[str, Any], str, dict[str, Any]]],
    ids: list[Any],
    name: str,
    phases: Phases | None = None,
) -> tuple[list[dict[str, Any]], int, int]:
    """The result lines in input order, each as the command without ``--ray`` writes it, after
    checking that every input row was answered exactly once; (lines, failed, broken). Each
    block's ``_timings`` entry goes to ``phases``."""
    lines: list[dict[str, Any]] = []
    seen: collections.Counter[int] = collections.Counter()
    failed = broken = 0
    by_pos: dict[int, dict[str, Any]] = {}
    for batch in out.iter_batches(batch_format="pyarrow", batch_size=None):
        if phases is not None:
            phases.arrived()
            if "_timings" in batch.column_names:
                for entry in batch.column("_timings").to_pylist():
                    if entry is not None:
                        phases.blocks.append(json.loads(entry))
        for row in batch.to_pylist():
            pos = row.get("_pos")
            key: dict[str, Any]
            if pos is None:  # a Parquet input: keyed by id, in input order
                pos, key, where = len(lines), {"id": row.get("id")}, f"{name} id {row.get('id')!r}"
            else:
                key, where, _ = reqs[pos]
            seen[pos] += 1
            if row["error"] is not None:
                failed += 1
                broken += not row["bad_request"]
                line = {**key, "error": f"{where}: {row['error']}"}
            else:
                line = {**key, **json.loads(row["result"])}
            by_pos[pos] = line
            lines.append(line)
    expected = len(reqs) if reqs else len(ids)
    _exactly_once(seen, expected, ids if not reqs else None, lines)
    if reqs:
        lines = [by_pos[i] for i in range(len(reqs))]
    return lines, failed, broken


def _exactly_once(
    seen: collections.Counter[int],
    expected: int,
    ids: list[Any] | None,
    lines: list[dict[str, Any]],
) -> None:
    dup = sorted(p for p, c in seen.items() if c > 1)
    missing = expected - len(seen)
    if ids is not None:
        want = collections.Counter(json.dumps(i) for i in ids)
        got = collections.Counter(json.dumps(line.get("id")) for line in lines)
        if want != got:
            raise BadRequestError(
                f"the results do not match the input rows one for one ({sum(got.values())} "
                f"results for {sum(want.values())} rows); nothing written"
            )
        return
    if dup or missing:
        raise BadRequestError(
            f"the results do not match the input rows one for one ({len(dup)} answered twice, "
            f"{missing} not answered); nothing written"
        )


def _write_parquet(out: Any, path: str, ids: list[Any]) -> int:
    """Write ``out`` as the Parquet directory ``path``: into a new temporary directory beside
    it, checked against the input ids, renamed into place; the rows that failed."""
    import pyarrow.parquet as pq

    target = Path(path)
    # the name first, the directory made under it inside the `try` that removes it: an
    # interrupt at any moment leaves nothing behind
    tmp: Path | None = target.with_name(f".{target.name[:200]}.{secrets.token_hex(6)}.tmp")
    try:
        try:
            tmp.mkdir()
        except OSError:
            tmp = None  # not made here: nothing to remove
            raise
        out.write_parquet(str(tmp))
        table = pq.read_table(tmp, columns=["id", "error"])
        got = collections.Counter(json.dumps(i) for i in table.column("id").to_pylist())
        want = collections.Counter(json.dumps(i) for i in ids)
        if got != want:
            raise BadRequestError(
                f"the results do not match the input rows one for one ({sum(got.values())} "
                f"results for {sum(want.values())} rows); nothing written"
            )
        failed = sum(e is not None for e in table.column("error").to_pylist())
        if os.path.lexists(target):
            raise BadRequestError(
                f"--output {path}: something appeared there while it was being written; "
                "left it alone"
            )
        os.rename(tmp, target)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return failed
