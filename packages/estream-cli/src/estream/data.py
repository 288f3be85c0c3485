"""The prefill-only tasks over Ray Data: corpus jobs spread over the actors of a cluster.

Needs the optional extra ``estream-cli[ray]`` (Ray Data); ``import estream`` never imports this
module, and this module imports Ray only when a function below needs it.

`TaskRunner` is a callable class for ``Dataset.map_batches``: each actor loads the pack once
(``stream`` within its own memory budget, or ``resident``) and verifies it once
(`estream_layout.verify.verify_pack`: the manifest and every checksum; the pack is only ever
opened read-only) while the load and the first block run — no answer leaves an actor before
its check has passed, and a pack that fails it fails the job with the check's error —, then
answers every block it is given with the batched task planner
(`estream.tasks.run_plans`, passes of at most ``batch_tokens`` tokens). `classify`, `score`,
`rerank` and `embed` wrap it: they take a dataset of requests (the fields of the ``--input``
lines of the ``estream`` task commands) and return a dataset of results with the fields of the
command's result lines. A request that cannot be answered becomes a row with an ``error``
field, never a failed job.

>>> import ray.data, estream.data                                  # doctest: +SKIP
>>> ds = ray.data.read_parquet("tickets.parquet")                 # columns id, prompt
>>> out = estream.data.classify(ds, "m.estream", labels=["bug", "billing"], actors=4)
>>> out.write_parquet("labelled")

An actor killed mid-block (SIGKILL, a lost node) is restarted by Ray and its block run again
(Ray Data's ``max_restarts``, ``max_task_retries``): a block's results are only kept once the whole block
is answered, so no row is lost and none is answered twice.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import (
    BadRequestError,
    BudgetTooSmallError,
    EStreamError,
    InsufficientMemoryError,
    PackError,
)

__all__ = [
    "ACTOR_ENV",
    "TASKS",
    "TaskRunner",
    "apply",
    "classify",
    "embed",
    "need_ray",
    "rerank",
    "score",
]

#: The task of each name and the request fields it reads (as in the command's ``--input``).
TASKS: dict[str, tuple[str, ...]] = {
    "classify": ("prompt", "labels", "method"),
    "score": ("context", "choices"),
    "rerank": ("query", "docs"),
    "embed": ("prompt", "pool", "normalize"),
}

#: A column holding a whole request as JSON text (what the ``estream`` command sends, so that
#: a request's fields need not fit one Arrow type across rows); its fields come first.
REQUEST_COLUMN = "_estream_request"

INSTALL_HINT = (
    "Ray Data is not installed: install estream-cli[ray] (pip install 'estream-cli[ray]')"
)


def need_ray() -> Any:
    """The ``ray`` module (with ``ray.data``), or BadRequestError naming the extra to install."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise BadRequestError(INSTALL_HINT) from None
    return ray


def _message(exc: BaseException) -> str:
    """One line for a row's ``error`` field: the message of an EStream error as written for the
    user, the class name too for anything else."""
    text = " ".join(str(exc).split()) or "no details"
    if isinstance(exc, EStreamError):
        return text
    if isinstance(exc, MemoryError):
        return "out of memory"
    return f"{type(exc).__name__}: {text}"


def _present(row: Mapping[str, Any], field: str) -> bool:
    return row.get(field) is not None


def _request(task: str, row: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the task's planner for one row: its fields, else the defaults
    (a null field counts as missing: Arrow fills a column a row does not have with nulls)."""
    fields: dict[str, Any] = {}
    if _present(row, REQUEST_COLUMN):
        fields.update(json.loads(row[REQUEST_COLUMN]))
    as_json = set(fields)  # as written: a null in it was given, not filled in by Arrow
    for f in TASKS[task]:
        if f not in fields:
            if _present(row, f):
                fields[f] = row[f]
            elif defaults.get(f) is not None:
                fields[f] = defaults[f]

    def text(field: str) -> str:
        v = fields.get(field)
        if v is None:
            raise BadRequestError(f"no {field}: give a '{field}' field or a default")
        if not isinstance(v, str):
            raise BadRequestError(f"'{field}' must be a string, not {type(v).__name__}")
        return v

    def texts(field: str) -> list[str]:
        v = fields.get(field)
        if isinstance(v, str) and field == "labels":
            v = [s.strip() for s in v.split(",") if s.strip()]
        if v is None:
            raise BadRequestError(f"no {field}: give a '{field}' field or a default")
        v = list(v) if not isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise BadRequestError(f"'{field}' must be a list of strings")
        return v

    if task == "classify":
        return {
            "prompt": text("prompt"),
            "labels": texts("labels"),
            "method": fields.get("method") or "auto",
        }
    if task == "score":
        return {"context": text("context"), "choices": texts("choices")}
    if task == "rerank":
        docs = fields.get("docs")
        if docs is None:
            raise BadRequestError("no docs: give a 'docs' field or a default")
        out: list[Any] = []
        for d in list(docs):
            if isinstance(d, Mapping) and "docs" not in as_json:  # Arrow nulls a missing id
                d = {k: v for k, v in d.items() if not (k == "id" and v is None)}
            out.append(d)
        return {"query": text("query"), "docs": out}
    normalize = fields.get("normalize", False)
    if not isinstance(normalize, bool):
        raise BadRequestError("'normalize' must be true or false")
    return {"prompt": text("prompt"), "pool": fields.get("pool") or "last", "normalize": normalize}


def _plan(task: str, engine: Any, tok: Any, template: Any, req: dict[str, Any]) -> Any:
    from . import tasks

    req = dict(req)
    if task == "classify":
        return tasks.plan_classify(
            engine, tok, req.pop("prompt"), req.pop("labels"), template=template, **req
        )
    if task == "score":
        return tasks.plan_score(
            engine, tok, req.pop("context"), req.pop("choices"), template=template, **req
        )
    if task == "rerank":
        return tasks.plan_rerank(
            engine, tok, req.pop("query"), req.pop("docs"), template=template, **req
        )
    return tasks.plan_embed(engine, tok, req.pop("prompt"), template=template, **req)


class TaskRunner:
    """One actor's task: the pack loaded once, each block of requests answered in one call.

    ``pack``: the packed model (``NAME.estream``), on storage every actor can read (shared, or a
    copy at the same path on each node). ``task``: a key of `TASKS`. ``defaults``: a request
    field's value where a row has none (``{"labels": [...]}``). ``engine``: keyword arguments
    of `estream.load` (``mode``, ``budget`` — per actor —, ``n_threads``, ``act``, ...).
    ``template``: wrap texts with the model's chat template. ``verify``: check the whole pack
    (manifest and every checksum) once, on a thread beside the load and the first block,
    whose answers wait for it (a failed check raises PackError from that call on). ``keep``: columns copied from
    each request row to its result row (``id`` always is, when the dataset has it).
    ``output``: ``"columns"`` — the result's fields as columns, as in the command's result
    lines — or ``"json"`` — the result as JSON text in a ``result`` column, with ``error`` and
    ``bad_request`` (whether the error is the request's own fault). ``timings``: add a
    ``_timings`` column, JSON text on each block's first row (null on the others): the block's
    rows and seconds (``block_s``: the whole call; ``plan_s``, ``run_s``: planning and the
    passes; ``wait_s``: waiting for the pack's check after them), and on the actor's first
    block its start (``init``: ``imports_s``; ``load_s``, `estream.load`: the pack opened,
    the dense weights read, the first reads started; ``tokenizer_s``, read beside the load;
    ``started``, the wall clock when the constructor began; ``process_s``, how long the
    actor's process had been running then — Ray's worker start —, Linux only, else null)
    and the check's own duration (``check_s``).

    A call takes a ``pyarrow.Table`` block (``batch_format="pyarrow"``) and returns one."""

    def __init__(
        self,
        pack: str | os.PathLike[str],
        task: str,
        *,
        defaults: Mapping[str, Any] | None = None,
        engine: Mapping[str, Any] | None = None,
        batch_tokens: int | None = None,
        template: bool = False,
        verify: bool = True,
        keep: Sequence[str] = (),
        output: str = "columns",
        timings: bool = False,
    ) -> None:
        started, t0, age = time.time(), time.perf_counter(), _process_age()
        from . import tasks
        from .engine import load
        from .tokenizer import Tokenizer

        if task not in TASKS:
            raise BadRequestError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        if output not in ("columns", "json"):
            raise BadRequestError(f"output must be 'columns' or 'json', got {output!r}")
        self.task, self.output = task, output
        self.defaults = dict(defaults or {})
        self.batch_tokens = batch_tokens
        self.keep = ("id", *(k for k in keep if k != "id"))
        self.timings = timings
        self._blocks = 0
        # The whole-pack check reads every byte once: it runs beside the model's load and the
        # first block (no answer leaves the actor before it has passed), not before them.
        self._check = _Check(pack) if verify else None
        t1 = time.perf_counter()
        # The tokenizer (Python parsing model.gguf's vocabulary) is read beside the model's load
        # (mostly reads of dense.bin that release the GIL).
        tok = _Beside(Tokenizer.from_gguf, pack, name="estream-tokenizer")
        try:
            try:
                self.engine = load(pack, **dict(engine or {}))
            finally:
                t2 = time.perf_counter()
                tok.join()
            try:
                self.tokenizer = tok.result()
                self.template = tasks.chat_template(pack, self.tokenizer) if template else None
            except BaseException:
                self.engine.close()
                raise
        except BaseException as exc:
            self._load_failed(exc)
            raise
        self.init = {
            "started": started,
            "process_s": age,
            "imports_s": t1 - t0,
            "tokenizer_s": tok.seconds,
            "load_s": t2 - t1,
        }
        self._last: dict[str, float] = {}

    def answer(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """The results of ``rows`` (requests), in order: a task result, or the exception that
        kept a request from being answered."""
        from . import tasks

        if self._check is not None and self._check.done():
            self._checked()  # a pack that failed its check answers nothing more
        t0 = time.perf_counter()
        plans: list[Any] = []
        for row in rows:
            try:
                req = _request(self.task, row, self.defaults)
                plans.append(_plan(self.task, self.engine, self.tokenizer, self.template, req))
            except Exception as exc:  # this request fails on its own row
                plans.append(exc)
        t1 = time.perf_counter()
        results = list(tasks.run_plans(self.engine, plans, batch_tokens=self.batch_tokens))
        t2 = time.perf_counter()
        self._checked()
        self._last = {"plan_s": t1 - t0, "run_s": t2 - t1, "wait_s": time.perf_counter() - t2}
        return results

    def _checked(self) -> None:
        """Wait for the pack's check (once); PackError if it failed."""
        if self._check is not None:
            self._check.result()

    def _load_failed(self, exc: BaseException) -> None:
        """The load raised ``exc``: a failed check is the error to report when the pack may be
        what failed (its checksum error, waited for); an error of the options or the machine
        (`_NOT_THE_PACK`, an interrupt) comes out at once, the check stopped."""
        if self._check is None:
            return
        at_once = isinstance(exc, _NOT_THE_PACK) or not isinstance(exc, Exception)
        if at_once and not self._check.done():
            self._check.stop()
        else:
            self._checked()

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        t0 = time.perf_counter()
        rows = batch.to_pylist()
        out: list[dict[str, Any]] = []
        for row, res in zip(rows, self.answer(rows), strict=True):
            kept = {k: row[k] for k in self.keep if k in row}
            failed = isinstance(res, BaseException)
            if self.output == "json":
                out.append(
                    kept
                    | {
                        "result": None if failed else json.dumps(res.to_dict()),
                        "error": _message(res) if failed else None,
                        "bad_request": isinstance(res, BadRequestError) if failed else None,
                    }
                )
            else:
                out.append(kept | ({"error": _message(res)} if failed else res.to_dict()))
        names: list[str] = []
        for r in out:
            names += [k for k in r if k not in names]
        if self.output == "columns" and "error" not in names:
            names.append("error")
        typed = {"error": pa.string(), "result": pa.string(), "bad_request": pa.bool_()}
        columns = {k: pa.array([r.get(k) for r in out], typed.get(k)) for k in names}
        if self.timings:
            columns["_timings"] = pa.array(
                [self._timing(len(rows), time.perf_counter() - t0)] + [None] * (len(rows) - 1),
                pa.string(),
            )
        return pa.table(columns)

    def _timing(self, rows: int, seconds: float) -> str:
        """The ``_timings`` entry of a block of ``rows`` answered in ``seconds``."""
        self._blocks += 1
        t: dict[str, Any] = {"actor": os.getpid(), "rows": rows, "block_s": seconds}
        t |= self._last
        if self._blocks == 1:
            t["init"] = self.init
            t["check_s"] = self._check.seconds if self._check is not None else None
        return json.dumps(t)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self._check is not None:
                self._check.join()


#: Load errors a damaged pack does not cause: the runner reports them without the pack's check.
_NOT_THE_PACK = (BadRequestError, BudgetTooSmallError, InsufficientMemoryError, TypeError)


def _process_age() -> float | None:
    """Seconds since this process started (Linux, to the clock tick; None elsewhere)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # from the state, field 3, on
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return since_boot - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _Beside:
    """``fn(*args)`` on a thread of its own, started at once; its value or error taken with
    `result` (after `join`), its duration in `seconds`."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to the thread that takes the result
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _Check:
    """`verify_once` of a pack on a thread of its own (hashing and reading release the GIL):
    started at once, its outcome taken with `result`, or ended early with `stop`."""

    def __init__(self, pack: str | os.PathLike[str]) -> None:
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.seconds: float | None = None  # the check's own duration, once done
        self._thread = threading.Thread(
            target=self._run, args=(pack,), name="estream-pack-check", daemon=True
        )
        self._thread.start()

    def _run(self, pack: str | os.PathLike[str]) -> None:
        t0 = time.perf_counter()
        _lower_priority()
        try:
            verify_once(pack, stop=self._stop.is_set)
        except BaseException as exc:  # handed to the thread that takes the result
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        """End the check before it has read the whole pack (its outcome is not known then)
        and wait for its thread."""
        self._stop.set()
        self._thread.join()

    def result(self) -> None:
        """Wait for the check; raise its error (PackError: a checksum that differs, ...)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


#: The niceness the check's thread adds to its own (Linux: per thread): where the cores are
#: short, the passes of the first block — the job's critical path — get them first.
CHECK_NICENESS = 10


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority by `CHECK_NICENESS` where the system sets it per
    thread (Linux); elsewhere leave it (it would lower the whole actor's)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + CHECK_NICENESS)
    except OSError:  # not permitted here: the check runs at the actor's priority
        pass


def verify_once(pack: str | os.PathLike[str], stop: Callable[[], bool] | None = None) -> None:
    """The whole pack checked (manifest, every checksum), or PackError naming the first
    problem. ``stop``: see `estream_layout.verify_pack` (VerifyStoppedError once it says
    True)."""
    from estream_layout import LayoutError
    from estream_layout.verify import verify_pack

    try:
        report = verify_pack(pack, stop=stop)
    except FileNotFoundError as exc:
        raise PackError(f"{pack}: no such packed model ({exc.strerror})") from None
    except LayoutError as exc:
        raise PackError(str(exc)) from None
    if report.problems:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise PackError(f"{pack}: {report.problems[0]}{more}")


#: The environment Ray starts each actor's process with (``runtime_env`` env_vars, merged with
#: the job's). ``MALLOC_ARENA_MAX=1``: every thread allocates from glibc's main heap. An actor's
#: passes run on a thread Ray starts, not on its process's main thread, and glibc gives such a
#: thread an arena of its own, made of 64 MiB heaps that are unmapped whole as soon as they are
#: empty whatever `estream.memory.keep_freed_heap` set: a pass's ``[T, d]`` activations were
#: fresh mappings, faulted in again at every op (a 3166-token OLMoE-shaped pass on one thread:
#: ~40k page faults against ~7k in the command without ``--ray``, qk_norm 3.5 s of CPU against
#: 0.25 s, ~5 s more CPU in all). glibc reads it when the process starts, hence the
#: environment and not ``mallopt`` in the actor (which a thread that already has an arena
#: ignores).
ACTOR_ENV: dict[str, str] = {"MALLOC_ARENA_MAX": "1"}


def apply(
    ds: Any,
    task: str,
    pack: str | os.PathLike[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    actors: int = 1,
    threads: int = 1,
    batch_size: int = 256,
    batch_tokens: int | None = None,
    template: bool = False,
    verify: bool = True,
    engine: Mapping[str, Any] | None = None,
    keep: Sequence[str] = (),
    output: str = "columns",
    timings: bool = False,
    runner: type[TaskRunner] = TaskRunner,
) -> Any:
    """``ds.map_batches`` with `TaskRunner` on a pool of ``actors`` actors of ``threads`` compute
    threads (and CPUs) each: a lazy dataset of results. ``batch_size``: the rows of one block
    (one call of an actor, and what is run again when an actor dies). ``timings``: each block's
    phases in a ``_timings`` column (see `TaskRunner`). ``runner``: `TaskRunner` or a subclass.

    Ray Data's actor pool restarts an actor that died and runs its block again (its defaults,
    ``max_restarts=-1`` and ``max_task_retries=-1``, which this leaves in place). Each actor's
    process starts with `ACTOR_ENV` in its environment."""
    ray = need_ray()
    if task not in TASKS:
        raise BadRequestError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    for name, v in (("actors", actors), ("threads", threads), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadRequestError(f"{name} must be an integer >= 1, got {v!r}")
    kwargs = {"n_threads": threads, **dict(engine or {})}
    return ds.map_batches(
        runner,
        fn_constructor_args=(os.fspath(pack), task),
        fn_constructor_kwargs={
            "defaults": dict(defaults or {}),
            "engine": kwargs,
            "batch_tokens": batch_tokens,
            "template": template,
            "verify": verify,
            "keep": tuple(keep),
            "output": output,
            "timings": timings,
        },
        batch_format="pyarrow",
        batch_size=batch_size,
        # One block in flight per actor: a block is minutes of passes, and a second one queued
        # behind it on the first actor to start would leave another actor idle.
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
        num_cpus=threads,
        runtime_env={"env_vars": dict(ACTOR_ENV)},
    )


def classify(
    ds: Any,
    pack: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
    prompt: str | None = None,
    method: str = "auto",
    **kw: Any,
) -> Any:
    """Label probabilities of each row's ``prompt`` (`estream.tasks.classify`); ``labels``,
    ``prompt``, ``method``: for rows without that field. Other keywords: `apply`'s."""
    defaults = {"labels": list(labels) if labels is not None else None, "prompt": prompt}
    return apply(ds, "classify", pack, defaults=defaults | {"method": method}, **kw)


def score(
    ds: Any,
    pack: str | os.PathLike[str],
    *,
    choices: Sequence[str] | None = None,
    context: str | None = None,
    **kw: Any,
) -> Any:
    """Log-likelihood of each row's ``choices`` after its ``context`` (`estream.tasks.score`)."""
    defaults = {"choices": list(choices) if choices is not None else None, "context": context}
    return apply(ds, "score", pack, defaults=defaults, **kw)


def rerank(
    ds: Any,
    pack: str | os.PathLike[str],
    *,
    query: str | None = None,
    docs: Sequence[Any] | None = None,
    **kw: Any,
) -> Any:
    """Each row's ``docs`` sorted by relevance to its ``query`` (`estream.tasks.rerank`)."""
    defaults = {"query": query, "docs": list(docs) if docs is not None else None}
    return apply(ds, "rerank", pack, defaults=defaults, **kw)


def embed(
    ds: Any,
    pack: str | os.PathLike[str],
    *,
    pool: str = "last",
    normalize: bool = False,
    **kw: Any,
) -> Any:
    """The final hidden state of each row's ``prompt`` (`estream.tasks.embed`)."""
    return apply(ds, "embed", pack, defaults={"pool": pool, "normalize": normalize}, **kw)
