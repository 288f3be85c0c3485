"""Task commands (classify, score, rerank, embed): registered into the `estream` parser.

Every command answers one request given by options, or a batch: ``--input FILE.jsonl`` (``-``
for stdin), one JSON object per line whose fields are the options' (missing fields fall back
to the options), one JSON result per line on stdout, ``id`` carried over. The whole input is
read and checked before the model is loaded, so a bad line fails fast and names its line.
A batch's requests share forward passes (``--batch-tokens``), each result line carrying its
own metrics and a summary of the passes it ran in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from estream import tasks
from estream.errors import BadRequestError, json_kind
from estream.packed import PackedModel

from .messages import describe, plural
from .options import add_engine_opts, engine_from_args, positive_int
from .ray_commands import add_ray_opts, run_ray, run_single

__all__ = ["add_task_commands", "read_docs_file", "read_jsonl", "read_lines_file"]


# -- input files -------------------------------------------------------------------------------
#: The most an input file (``--input``, ``--text-file``, ``--docs-file``, ...) may hold: the
#: whole input is read and checked before the model loads, so a stream without end
#: (``/dev/zero``) must stop being read somewhere.
MAX_INPUT_BYTES = 256 * 2**20

#: The most a prompt file may hold (a prompt longer than any model's context in any tokenizer).
MAX_PROMPT_BYTES = 16 * 2**20


def read_text(path: str, what: str, limit: int = MAX_INPUT_BYTES) -> tuple[str, str]:
    """(text, name to cite) of a UTF-8 file (``-``: stdin) of at most ``limit`` bytes, else
    one clear error."""
    from estream import memory

    name = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            if sys.stdin is None:
                raise BadRequestError(f"the {what} is '-', standard input, which is closed")
            stream = getattr(sys.stdin, "buffer", None)
            if stream is not None:
                data = stream.read(limit + 1)
            else:  # a text stream standing in for standard input (embedding, tests)
                chars = sys.stdin.read(limit + 1)
                try:
                    data = chars.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise BadRequestError(
                        f"{what} {name} is not UTF-8 text (a lone surrogate at character "
                        f"{exc.start})"
                    ) from None
        else:
            with _open_for_reading(path) as f:
                data = f.read(limit + 1)
    except OSError as exc:
        raise BadRequestError(f"cannot read {what} {name}: {exc.strerror or exc}") from None
    except ValueError:  # a closed file object
        raise BadRequestError(f"cannot read {what} {name}: the stream is closed") from None
    if len(data) > limit:
        raise BadRequestError(
            f"{what} {name} is larger than {memory.format_bytes(limit)}, the most it may hold"
        )
    try:
        return data.decode("utf-8"), name
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"{what} {name} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def _open_for_reading(path: str) -> Any:
    """``open(path, "rb")`` that does not wait for a writer: a FIFO nobody writes to reads as
    empty (its ``open`` would block for ever), one being written (``<(command)``) as usual."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.set_blocking(fd, True)  # reads wait for data again, as for any file
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def _check_unicode(value: Any, where: str) -> None:
    """JSON's ``\\ud800``-style escapes can spell lone surrogates, which are not text: refused
    here, before a tokenizer (or the output) meets them."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise BadRequestError(
                    f"{where}: a string holds a lone surrogate (\\u{ord(v[exc.start]):04x}), "
                    "which is not text"
                ) from None
        elif isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v


def _check_id(obj: dict[str, Any], where: str) -> None:
    """A request's ``id`` is carried into its result line: a string, an integer or null (what
    every JSON reader reads back as it was written)."""
    v = obj.get("id")
    if v is not None and (isinstance(v, bool) or not isinstance(v, str | int)):
        kind = {bool: "true/false", float: "a number with a fraction", list: "a list"}.get(
            type(v), "an object"
        )
        raise BadRequestError(f"{where}: 'id' must be a string or an integer, not {kind}")


def read_jsonl(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSON Lines file (``-``: stdin)."""
    return read_jsonl_named(path)[0]


def read_jsonl_named(path: str) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """`read_jsonl` and the file's name to cite in errors (``<stdin>`` for ``-``)."""
    text, name = read_text(path, "input file")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            raise BadRequestError(
                f"{name}:{n}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except ValueError as exc:  # NaN, Infinity: Python's extensions, not JSON
            raise BadRequestError(f"{name}:{n}: not valid JSON ({exc})") from None
        except RecursionError:
            raise BadRequestError(f"{name}:{n}: the JSON is nested too deeply") from None
        if not isinstance(obj, dict):
            kind = {list: "a list", str: "a string", type(None): "null"}.get(type(obj), "a value")
            raise BadRequestError(f"{name}:{n}: expected a JSON object, got {kind}")
        _check_unicode(obj, f"{name}:{n}")
        _check_id(obj, f"{name}:{n}")
        out.append((n, obj))
    if not out:
        raise BadRequestError(f"{name} has no requests (it is empty)")
    return out, name


def read_lines_file(path: str, what: str) -> list[str]:
    """One item per line; blank lines are skipped; an empty file is an error."""
    text, name = read_text(path, what)
    items = [line for line in text.splitlines() if line.strip()]
    if not items:
        raise BadRequestError(f"{what} {name} is empty: give one per line")
    return items


def read_docs_file(path: str) -> list[Any]:
    """Documents, one per line: ``{"id": …, "text": …}``, a JSON string, or plain text."""
    text, name = read_text(path, "docs file")
    docs: list[Any] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        s = line.strip()
        if s.startswith("{"):
            try:
                obj = json.loads(s, parse_constant=_no_constant)
            except json.JSONDecodeError as exc:
                raise BadRequestError(
                    f"{name}:{n}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except ValueError as exc:  # NaN, Infinity
                raise BadRequestError(f"{name}:{n}: not valid JSON ({exc})") from None
            except RecursionError:
                raise BadRequestError(f"{name}:{n}: the JSON is nested too deeply") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise BadRequestError(f"{name}:{n}: a document object needs a 'text' string")
            _check_unicode(obj, f"{name}:{n}")
            _check_id(obj, f"{name}:{n}")
            docs.append(obj)
        elif s.startswith('"'):
            try:
                val = json.loads(s)
            except (ValueError, RecursionError):
                val = line
            _check_unicode(val, f"{name}:{n}")
            docs.append(val if isinstance(val, str) else line)
        else:
            docs.append(line)
    if not docs:
        raise BadRequestError(f"docs file {name} is empty: give one document per line")
    return docs


# -- request checking --------------------------------------------------------------------------
def _labels(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        labels = [s.strip() for s in value.split(",")]
        labels = [s for s in labels if s]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        labels = list(value)
    else:
        raise BadRequestError(f"{where}: 'labels' must be a list of strings or 'a,b,c'")
    if not labels:
        raise BadRequestError(f"{where}: no labels: give --labels yes,no or a 'labels' field")
    return labels


def _text_list(value: Any, field: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequestError(f"{where}: '{field}' must be a list of strings")
    if not value:
        raise BadRequestError(f"{where}: '{field}' is empty")
    return value


def _string(obj: dict[str, Any], field: str, default: Any, where: str, hint: str) -> str:
    v = obj.get(field, default)
    if v is None:
        raise BadRequestError(f"{where}: no {field}: {hint}")
    if not isinstance(v, str):
        raise BadRequestError(f"{where}: '{field}' must be a string, not {json_kind(v)}")
    return v


def _check_fields(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in obj:
        if k not in allowed:
            raise BadRequestError(f"{where}: unknown field {k!r} (expected: {', '.join(allowed)})")


@attrs.frozen
class _Task:
    name: str
    fields: tuple[str, ...]
    check: Callable[[dict[str, Any], argparse.Namespace, str], dict[str, Any]]
    plan: Callable[..., tasks.Plan]
    show: Callable[[Any, dict[str, Any]], None]


def _check_classify(obj: dict[str, Any], args: argparse.Namespace, where: str) -> dict[str, Any]:
    prompt = _string(obj, "prompt", args.prompt, where, "give --prompt TEXT or a 'prompt' field")
    raw = obj.get("labels", args.labels)
    if raw is None:
        raise BadRequestError(f"{where}: no labels: give --labels yes,no or a 'labels' field")
    method = obj.get("method", args.method)
    if method not in tasks.CLASSIFY_METHODS:
        raise BadRequestError(
            f"{where}: method must be one of {', '.join(tasks.CLASSIFY_METHODS)}, got {method!r}"
        )
    return {"prompt": prompt, "labels": _labels(raw, where), "method": method}


def _check_score(obj: dict[str, Any], args: argparse.Namespace, where: str) -> dict[str, Any]:
    context = _string(
        obj, "context", args.context, where, "give --context TEXT or a 'context' field"
    )
    if "choices" in obj:
        choices = _text_list(obj["choices"], "choices", where)
    elif args.choices is not None:
        choices = args.choices
    else:
        raise BadRequestError(
            f"{where}: no choices: give --choices-file FILE, --choice TEXT or a 'choices' field"
        )
    return {"context": context, "choices": choices}


def _check_rerank(obj: dict[str, Any], args: argparse.Namespace, where: str) -> dict[str, Any]:
    query = _string(obj, "query", args.query, where, "give --query TEXT or a 'query' field")
    docs = obj.get("docs", args.docs)
    if docs is None:
        raise BadRequestError(f"{where}: no documents: give --docs-file FILE or a 'docs' field")
    if not isinstance(docs, list) or not docs:
        raise BadRequestError(f"{where}: 'docs' must be a non-empty list")
    for i, d in enumerate(docs):
        ok = isinstance(d, str) or (isinstance(d, dict) and isinstance(d.get("text"), str))
        if not ok:
            raise BadRequestError(
                f"{where}: document {i + 1} must be a string or an object with a 'text' string"
            )
    return {"query": query, "docs": docs}


def _check_embed(obj: dict[str, Any], args: argparse.Namespace, where: str) -> dict[str, Any]:
    prompt = _string(obj, "prompt", args.prompt, where, "give --prompt TEXT or a 'prompt' field")
    pool = obj.get("pool", args.pool)
    if pool not in tasks.POOLS:
        raise BadRequestError(
            f"{where}: pool must be one of {', '.join(tasks.POOLS)}, got {pool!r}"
        )
    normalize = obj.get("normalize", args.normalize)
    if not isinstance(normalize, bool):
        raise BadRequestError(f"{where}: 'normalize' must be true or false")
    return {"prompt": prompt, "pool": pool, "normalize": normalize}


# -- human-readable output ---------------------------------------------------------------------
def _show_classify(res: tasks.ClassifyResult, req: dict[str, Any]) -> None:
    width = max(5, *(len(s.label) for s in res.labels))
    print(
        f"{plural(len(res.labels), 'label')} after "
        f"{plural(res.prompt_tokens, 'prompt token')} ({res.method}):"
    )
    print(f"  {'label':<{width}s}  {'prob':>8s}  {'log P':>10s}  {'tokens':>6s}")
    for s in res.labels:
        mark = "  *" if s.label == res.best else ""
        print(
            f"  {s.label:<{width}s}  {s.prob:8.4f}  {s.logprob:10.4f}  {len(s.token_ids):6d}{mark}"
        )


def _show_score(res: tasks.ScoreResult, req: dict[str, Any]) -> None:
    print(
        f"{plural(len(res.choices), 'choice')} after {plural(res.context_tokens, 'context token')}:"
    )
    print(f"  {'#':>3s}  {'log P':>10s}  {'/token':>8s}  {'/char':>8s}  {'tokens':>6s}  choice")
    for i, c in enumerate(res.choices):
        mark = ("*" if i == res.best else " ") + ("n" if i == res.best_norm else " ")
        text = c.text if len(c.text) <= 50 else c.text[:47] + "..."
        print(
            f"  {i:3d}  {c.logprob:10.4f}  {c.logprob_per_token:8.4f}  {c.logprob_per_char:8.4f}"
            f"  {c.n_tokens:6d} {mark} {text}"
        )
    print("  * best by summed log P (acc), n best per character (acc_norm)")


def _show_rerank(res: tasks.RerankResult, req: dict[str, Any]) -> None:
    texts = [d if isinstance(d, str) else d["text"] for d in req["docs"]]
    print(f"{plural(len(res.docs), 'document')}, by log P(yes) - log P(no):")
    print(f"  {'rank':>4s}  {'score':>9s}  {'id':>8s}  document")
    for r, d in enumerate(res.docs, 1):
        t = texts[d.index].replace("\n", " ")
        t = t if len(t) <= 60 else t[:57] + "..."
        print(f"  {r:4d}  {d.score:9.4f}  {d.id!s:>8s}  {t}")


def _show_embed(res: tasks.EmbedResult, req: dict[str, Any]) -> None:
    print(json.dumps(res.to_dict()))


# -- running -----------------------------------------------------------------------------------
def _progress(i: int, n: int, name: str, t0: float) -> None:
    width = 30
    done = width * i // n
    rate = i / max(time.perf_counter() - t0, 1e-9)
    bar = "#" * done + "." * (width - done)
    print(f"\r  {name} [{bar}] {i}/{n}  {rate:.1f}/s", end="", file=sys.stderr, flush=True)


def _requests(
    args: argparse.Namespace, task: _Task
) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(key, where, checked request): the key is ``{"id": …}`` when the request has an id,
    else ``{"line": n}``; from --input, or the one request given by the options."""
    if args.input is None:
        yield {}, "request", task.check({}, args, "request")
        return
    name = "<stdin>" if args.input == "-" else args.input
    for n, obj in read_jsonl(args.input):
        where = f"{name}:{n}"
        _check_fields(obj, ("id", *task.fields), where)
        key = {"id": obj["id"]} if "id" in obj else {"line": n}
        yield key, where, task.check(obj, args, where)


@attrs.frozen
class _ModelShape:
    """What planning a task request reads of an engine (`estream.tasks`): the hyperparameters."""

    hp: Any


def _run(args: argparse.Namespace, task: _Task) -> int:
    """Check every request, load the model once, answer the requests in order.

    In a batch the requests' passes are formed across requests (`tasks.run_plans`: at most
    ``--batch-tokens`` tokens a pass, in input order), and a request the model cannot answer
    (e.g. longer than the context) gets a result line ``{"id": …, "error": "…"}`` while the
    others go on (a failed pass is re-run request by request); the exit code is then 2 (1
    when a request failed for another reason than its content: a read or checksum error, NaN,
    ...)."""
    from estream.tokenizer import Tokenizer

    t0 = time.perf_counter()
    if args.input is not None and args.json:
        raise BadRequestError(
            "--json does nothing with --input: a batch's results are JSON lines already; drop it"
        )
    reqs = list(_requests(args, task))  # all checked before the model loads
    batch = args.input is not None
    tok = Tokenizer.from_gguf(args.model)
    template = tasks.chat_template(args.model, tok) if args.template else None
    show = batch and sys.stderr.isatty()
    failed = broken = 0
    pass_ids: set[int] = set()
    # planned before the model loads (planning reads only its hyperparameters), so that a
    # --budget configuration is chosen for the longest pass the run needs: its longest request,
    # or --batch-tokens
    shape = _ModelShape(PackedModel(args.model).hparams)
    plans: list[tasks.Plan | BaseException] = []
    for _, _, req in reqs:
        try:
            plans.append(task.plan(shape, tok, template=template, **req))
        except Exception as exc:  # a request that cannot be planned fails on its own line
            if not batch:
                raise
            plans.append(exc)
    longest = max((p.longest_request() for p in plans if isinstance(p, tasks.Plan)), default=0)
    longest = max(longest, args.batch_tokens or 0)
    progress = not (batch or args.json)
    with engine_from_args(args, progress=progress, tokens=longest or None) as engine:
        t1 = time.perf_counter()
        answers = tasks.run_plans(engine, plans, batch_tokens=args.batch_tokens)
        for i, ((key, where, req), res) in enumerate(zip(reqs, answers, strict=True)):
            if isinstance(res, BaseException):
                if not batch:
                    raise res
                failed += 1
                if not isinstance(res, BadRequestError):
                    broken += 1
                msg = describe(res)
                print(json.dumps({**key, "error": f"{where}: {msg}"}), flush=True)
            else:
                pass_ids.update(p["pass_id"] for p in res.metrics["pass"])
                if batch:
                    print(json.dumps({**key, **res.to_dict()}), flush=True)
                elif args.json:
                    print(json.dumps(res.to_dict(), indent=1))
                else:
                    task.show(res, req)
            if show:
                _progress(i + 1, len(reqs), task.name, t1)
    if batch:
        if show:
            print(file=sys.stderr)
        dt = time.perf_counter() - t1
        fails = f", {failed} failed (see their 'error' field)" if failed else ""
        print(
            f"estream {task.name}: {plural(len(reqs), 'request')} in "
            f"{plural(len(pass_ids), 'pass')}, {dt:.2f} s "
            f"({len(reqs) / max(dt, 1e-9):.1f}/s; load {t1 - t0:.2f} s){fails}",
            file=sys.stderr,
        )
    return 1 if broken else 2 if failed else 0


def _plan_classify(engine: Any, tok: Any, **kw: Any) -> tasks.Plan:
    return tasks.plan_classify(engine, tok, kw.pop("prompt"), kw.pop("labels"), **kw)


def _plan_score(engine: Any, tok: Any, **kw: Any) -> tasks.Plan:
    return tasks.plan_score(engine, tok, kw.pop("context"), kw.pop("choices"), **kw)


def _plan_rerank(engine: Any, tok: Any, **kw: Any) -> tasks.Plan:
    return tasks.plan_rerank(engine, tok, kw.pop("query"), kw.pop("docs"), **kw)


def _plan_embed(engine: Any, tok: Any, **kw: Any) -> tasks.Plan:
    return tasks.plan_embed(engine, tok, kw.pop("prompt"), **kw)


_TASKS = {
    "classify": _Task(
        "classify", ("prompt", "labels", "method"), _check_classify, _plan_classify, _show_classify
    ),
    "score": _Task("score", ("context", "choices"), _check_score, _plan_score, _show_score),
    "rerank": _Task("rerank", ("query", "docs"), _check_rerank, _plan_rerank, _show_rerank),
    "embed": _Task(
        "embed", ("prompt", "pool", "normalize"), _check_embed, _plan_embed, _show_embed
    ),
}


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if name == "score":
            choices = list(args.choice or [])
            if args.choices_file:
                choices += read_lines_file(args.choices_file, "choices file")
            args.choices = choices or None
        if name == "rerank":
            args.docs = read_docs_file(args.docs_file) if args.docs_file else None
        task = _TASKS[name]
        if args.ray is not None:
            return run_ray(args, task, lambda: _requests(args, task))
        return run_single(args, lambda: _run(args, task))

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        metavar="FILE.jsonl",
        help="batch: one JSON request per line ('-': stdin; at most 256 MiB); one JSON result "
        "per line",
    )
    p.add_argument(
        "--batch-tokens",
        type=positive_int,
        metavar="N",
        help="batch: at most N tokens per forward pass, requests packed in input order (a "
        "longer request runs alone); default from the memory a pass may use (README: Batching)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output (one request; not with --input)",
    )
    p.add_argument(
        "--template",
        action="store_true",
        help="wrap the text as a user turn with the model's chat template (GGUF)",
    )
    add_engine_opts(p)
    add_ray_opts(p)


#: Help of the positional ``model`` of every command that runs a packed model.
MODEL_HELP = "packed model directory (NAME.estream, from `estream pack`)"


def add_task_commands(sub: Any) -> None:
    """Add the prefill-only task sub-commands to `sub` (an argparse subparsers object)."""
    p = sub.add_parser("classify", help="label probabilities for a prompt")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", help="the text to classify (the labels continue it)")
    p.add_argument("--labels", help="comma-separated labels, e.g. yes,no,maybe")
    p.add_argument(
        "--method",
        choices=tasks.CLASSIFY_METHODS,
        default="auto",
        help="first-token: next-token logits of each label's first token; sequence: whole "
        "label log-likelihood; auto (default): first-token if every label is one token",
    )
    _common(p)
    p.set_defaults(func=_command("classify"))

    p = sub.add_parser("score", help="log-likelihood of each continuation (multiple choice)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--context", help="the shared context")
    p.add_argument("--choices-file", help="one continuation per line (with --choice: both)")
    p.add_argument("--choice", action="append", help="a continuation (repeatable)")
    _common(p)
    p.set_defaults(func=_command("score"))

    p = sub.add_parser("rerank", help="sort documents by relevance to a query (yes/no log-odds)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--query", help="the query")
    p.add_argument(
        "--docs-file", help='one document per line: {"id": …, "text": …}, a JSON string or text'
    )
    _common(p)
    p.set_defaults(func=_command("rerank"))

    p = sub.add_parser("embed", help="final hidden state of a prompt (JSON)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", help="the text to embed")
    p.add_argument("--pool", choices=tasks.POOLS, default="last", help="last token or mean")
    p.add_argument("--normalize", action="store_true", help="L2-normalise the vector")
    _common(p)
    p.set_defaults(func=_command("embed"))
