"""`estream eval …`: accuracy evaluation commands, registered into the `estream` parser.

Each command reads and checks its whole input before the model loads, runs the evaluation of
`estream.evaluation`, prints one JSON object on stdout (and, with ``--output FILE``, writes
the same object there atomically), and a one-line summary on stderr. A progress bar is drawn on
stderr when it is a terminal. Bad input is a one-line error naming the file (and line) with
exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from estream import evaluation
from estream.errors import BadRequestError

from .messages import plural
from .options import add_engine_opts, engine_from_args, positive_int
from .output import STDOUT, check_output, stdout_claimed, write_json
from .task_commands import MODEL_HELP, read_jsonl_named, read_text

__all__ = ["add_eval_command"]

_PPL_HELP = f"""\
Perplexity and bits per byte of a text file, as llama.cpp's llama-perplexity computes them.

The file is tokenized whole with the model's own tokenizer (BOS first when the model adds one,
no EOS) and cut into windows of --ctx tokens (default {evaluation.DEFAULT_PPL_CTX}, capped by
the model context) starting at tokens 0, S, 2S, ... for --stride S (default: --ctx, windows do
not overlap); only whole windows are used, so the text needs at least --ctx tokens. When the
model adds BOS, every window's first token is replaced by BOS (the first window starts with it
already). Each window is its own forward pass; its last min(S, ctx - 1 - ctx//2) positions are
scored, the others are context (default stride: positions ctx//2+1 .. ctx-1, llama-perplexity's
"second half"; stride <= ctx-1-ctx//2: the last S positions, as --ppl-stride). The first
window's context tokens are never scored.

perplexity = exp(mean NLL) over the scored tokens, ± (stderr) the standard error of the mean NLL
times the perplexity (llama-perplexity's ±); bits per byte = total NLL (nats) / ln 2 / the
number of UTF-8 bytes of the scored tokens (each token's own bytes).
"""

_CHOICE_HELP = """\
Multiple-choice accuracy (HellaSwag, ARC, BoolQ, ... style).

--input is JSON Lines, one item per line: {"context": TEXT, "choices": [TEXT, ...], "gold": I}
with at least two choices, gold the 0-based index of the right one, an optional "id"; blank
lines are skipped. Each choice is scored as the continuation of the context (a space joins
them unless the context ends in whitespace or the choice starts with it; the choice's tokens are
those of context + choice tokenized whole, after the context's tokens), all choices of an item
as branches of one shared-prefix pass. Reported: acc (argmax of the summed log-probability),
acc_per_token (of the mean log-probability per token, llama.cpp's HellaSwag score),
acc_per_char (per character of the choice, lm-eval's acc_norm) and acc_per_byte; ties go to the
lower index. Each with its standard error sqrt(p(1-p)/n) and 95 % interval.
"""

_CLOZE_HELP = """\
LAMBADA-style last-word accuracy.

--input is JSON Lines, one passage per line: {"text": TEXT} (optional "id"); or --text-file with
one passage per line (blank lines skipped). The last whitespace-separated word is the target,
the text before it the context. The word is correct when each of its tokens is the argmax of
the logits given the context and the word's earlier tokens (what greedy decoding would
produce; one forward pass over context + word). Also reported: the mean over passages of the
word's summed log-probability and the word perplexity exp(-mean).
"""

_EVAL_EPILOG = """\
commands:
  estream eval perplexity MODEL --text-file F [--ctx N] [--stride S] [--output FILE]
  estream eval choice MODEL --input F.jsonl [--output FILE] [--details FILE.jsonl]
  estream eval cloze MODEL --input F.jsonl | --text-file F [--output FILE] [--details FILE.jsonl]
and the engine options of prefill: --mode --schedule --budget -G -Q -B --threads --verify
--act --attention --backend.
'estream eval COMMAND --help' states each convention exactly.
"""


class _Bar:
    """A progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.show = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.drawn = False

    def __call__(self, i: int, n: int) -> None:
        if not self.show:
            return
        width = 30
        done = width * i // max(n, 1)
        rate = i / max(time.perf_counter() - self.t0, 1e-9)
        bar = "#" * done + "." * (width - done)
        print(f"\r  {self.name} [{bar}] {i}/{n}  {rate:.2f}/s", end="", file=sys.stderr, flush=True)
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn = False


def _read_text_file(path: str) -> tuple[str, str]:
    return read_text(path, "file")


def _finish(
    args: argparse.Namespace, doc: dict[str, Any], summary: str, t0: float, details: Any = None
) -> int:
    doc["model"] = str(args.model)
    doc["elapsed_s"] = time.perf_counter() - t0
    if getattr(args, "details", None) and details is not None:
        write_json(args.details, "--details", details, lines=True)
    if args.output:
        write_json(args.output, "--output", doc)
    if args.output != STDOUT:  # with --output - the result is already on standard output
        # With --details - the per-item lines hold standard output; the result goes to stderr.
        report = sys.stderr if getattr(args, "details", None) == STDOUT else sys.stdout
        print(json.dumps(doc, indent=1), file=report, flush=True)
    print(f"estream eval {doc['task']}: {summary} ({doc['elapsed_s']:.2f} s)", file=sys.stderr)
    return 0


def _run(
    args: argparse.Namespace, name: str, body: Callable[[Any, Any, _Bar], tuple[Any, str, Any]]
) -> int:
    from estream.tokenizer import Tokenizer

    t0 = time.perf_counter()
    outputs = (("--output", args.output), ("--details", getattr(args, "details", None)))
    for option, path in outputs:
        check_output(path, option)  # refused before the model loads
    stdout_claimed(outputs)  # at most one of them is -
    tok = Tokenizer.from_gguf(args.model)
    bar = _Bar(name)
    try:
        with engine_from_args(args, progress=False) as engine:
            doc, summary, details = body(engine, tok, bar)
    finally:
        bar.close()
    return _finish(args, doc, summary, t0, details)


# -- perplexity --------------------------------------------------------------------------------
def cmd_perplexity(args: argparse.Namespace) -> int:
    text, name = _read_text_file(args.text_file)
    if not text.strip():
        raise BadRequestError(f"text file {name} is empty")

    def body(engine: Any, tok: Any, bar: _Bar) -> tuple[Any, str, Any]:
        try:
            res = evaluation.perplexity(
                engine, tok, text, ctx=args.ctx, stride=args.stride, progress=bar
            )
        except BadRequestError as exc:
            raise BadRequestError(f"{name}: {exc}") from None
        doc = {"task": "perplexity", "text_file": name, **res.to_dict()}
        p = res.perplexity
        pm = f" ± {p.stderr:.4f}" if p.stderr is not None else ""
        summary = (
            f"PPL = {p.value:.4f}{pm}, {res.bits_per_byte.value:.4f} bits/byte over "
            f"{plural(res.scored_tokens, 'token')} ({plural(res.windows, 'window')} of {res.ctx})"
        )
        return doc, summary, None

    return _run(args, "perplexity", body)


# -- multiple choice ---------------------------------------------------------------------------
def _read_jsonl(path: str) -> tuple[list[tuple[str, Any]], str]:
    """(``FILE:LINE``, object) of every non-blank line (the task commands' reader)."""
    lines, name = read_jsonl_named(path)
    return [(f"{name}:{n}", obj) for n, obj in lines], name


def cmd_choice(args: argparse.Namespace) -> int:
    lines, name = _read_jsonl(args.input)
    items = [evaluation.ChoiceItem.from_dict(obj, where) for where, obj in lines]

    def body(engine: Any, tok: Any, bar: _Bar) -> tuple[Any, str, Any]:
        res = evaluation.multiple_choice(engine, tok, items, progress=bar)
        doc = {"task": "choice", "input": name, **res.to_dict()}
        a, t = res.acc, res.acc_per_token
        summary = (
            f"acc = {a.value:.4f} ± {a.stderr:.4f}, acc_per_token = {t.value:.4f} ± "
            f"{t.stderr:.4f} over {plural(res.count, 'item')}"
        )
        return doc, summary, res.details

    return _run(args, "choice", body)


# -- cloze -------------------------------------------------------------------------------------
def cmd_cloze(args: argparse.Namespace) -> int:
    if args.input is not None:
        lines, name = _read_jsonl(args.input)
        items = [evaluation.ClozeItem.from_dict(obj, where) for where, obj in lines]
    else:
        text, name = _read_text_file(args.text_file)
        items = [
            evaluation.ClozeItem(line, where=f"{name}:{n}")
            for n, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
        if not items:
            raise BadRequestError(f"{name} is empty: give one passage per line")

    def body(engine: Any, tok: Any, bar: _Bar) -> tuple[Any, str, Any]:
        res = evaluation.cloze(engine, tok, items, progress=bar)
        doc = {"task": "cloze", "input": name, **res.to_dict()}
        a, w = res.accuracy, res.word_logprob
        wse = f" ± {w.stderr:.4f}" if w.stderr is not None else ""
        summary = (
            f"accuracy = {a.value:.4f} ± {a.stderr:.4f}, mean word log P = {w.value:.4f}{wse} "
            f"over {plural(res.count, 'passage')}"
        )
        return doc, summary, res.details

    return _run(args, "cloze", body)


# -- registration ------------------------------------------------------------------------------
def _output_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        metavar="FILE",
        help="also write the JSON result to FILE, atomically (-: print it once on standard output)",
    )


def _details_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--details",
        metavar="FILE.jsonl",
        help="write one JSON line per item (predictions, log-probabilities), atomically; - for "
        "standard output (the result then goes to stderr)",
    )


def add_eval_command(sub: Any) -> None:
    """Add ``estream eval {perplexity,choice,cloze}`` to `sub` (an argparse subparsers object)."""
    raw = argparse.RawDescriptionHelpFormatter
    ev = sub.add_parser(
        "eval",
        help="accuracy evaluation: perplexity, multiple choice, cloze (JSON)",
        description="Accuracy evaluation of a packed model, to compare it with the same "
        "model run elsewhere (llama-perplexity, lm-evaluation-harness).",
        epilog=_EVAL_EPILOG,
        formatter_class=raw,
    )
    esub = ev.add_subparsers(dest="eval_command", required=True, metavar="COMMAND")

    p = esub.add_parser(
        "perplexity",
        help="perplexity and bits per byte of a text file",
        description=_PPL_HELP,
        formatter_class=raw,
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--text-file", required=True, metavar="F", help="UTF-8 text ('-': stdin)")
    p.add_argument(
        "--ctx",
        type=positive_int,
        metavar="N",
        help=f"window length in tokens (default {evaluation.DEFAULT_PPL_CTX}, ≤ model context)",
    )
    p.add_argument(
        "--stride", type=positive_int, metavar="S", help="window start advance (default: --ctx)"
    )
    _output_opts(p)
    add_engine_opts(p)
    p.set_defaults(func=cmd_perplexity)

    p = esub.add_parser(
        "choice",
        help="multiple-choice accuracy (HellaSwag/ARC/BoolQ style JSON Lines)",
        description=_CHOICE_HELP,
        formatter_class=raw,
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--input",
        required=True,
        metavar="F.jsonl",
        help='items {"context", "choices", "gold"} one per line (\'-\': stdin)',
    )
    _output_opts(p)
    _details_opt(p)
    add_engine_opts(p)
    p.set_defaults(func=cmd_choice)

    p = esub.add_parser(
        "cloze",
        help="LAMBADA-style last-word accuracy",
        description=_CLOZE_HELP,
        formatter_class=raw,
    )
    p.add_argument("model", help=MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input", metavar="F.jsonl", help="passages {\"text\": ...} one per line ('-': stdin)"
    )
    src.add_argument("--text-file", metavar="F", help="one passage per line ('-': stdin)")
    _output_opts(p)
    _details_opt(p)
    add_engine_opts(p)
    p.set_defaults(func=cmd_cloze)
