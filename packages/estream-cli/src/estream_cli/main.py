"""The `estream` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import estream_cli
from estream import memory
from estream.config import OverBudgetWarning, StaleProfileWarning
from estream.errors import BadRequestError, EStreamError, PackError

from .messages import describe, plural
from .options import (
    MAX_THREADS,
    READ_MARGIN_HELP,
    add_engine_opts,
    bounded_int,
    check_engine_opts,
    engine_from_args,
    int_list,
    parse_ints,
    positive_int,
    read_margin,
)
from .output import check_output, stdout_claimed, write_output, write_output_named
from .report import print_metrics, public_metrics, with_measured_peaks, write_trace
from .task_commands import MODEL_HELP

__all__ = ["main"]


def _err(msg: str) -> None:
    print(f"estream: error: {msg}", file=sys.stderr)


class WarningLines:
    """`warnings.showwarning` while a command runs: the library's warnings meant for the user
    as one ``estream: warning:`` line each, like the command's other messages: a stale
    profile's `StaleProfileWarning` (at load), the first `OverBudgetWarning` (later ones:
    nothing, a batch's passes would repeat it). Any other warning as Python shows it."""

    CATEGORIES = (StaleProfileWarning, OverBudgetWarning)

    def __init__(self, show: Any) -> None:
        self.show, self.said_over = show, False

    def __call__(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, OverBudgetWarning):
            if self.said_over:
                return
            self.said_over = True
            more = "; the run goes on (later passes over the budget are not reported)"
            print(f"estream: warning: {message.facts}{more}", file=sys.stderr, flush=True)
        elif issubclass(category, StaleProfileWarning):
            print(f"estream: warning: {message}", file=sys.stderr, flush=True)
        else:
            self.show(message, category, *args, **kwargs)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- token input ------------------------------------------------------------------------------
def _parse_ids(text: str, option: str = "--tokens") -> list[int]:
    """Comma-separated token ids in ASCII digits (a negative one is left to the vocabulary
    check, which names it)."""
    return parse_ints(text, option, noun="integer ids")


# Options whose value is text for the tokenizer (not a path): must be valid UTF-8.
_TEXT_OPTIONS = ("prompt", "text", "labels", "context", "choice", "query", "tokens", "ids")


def _check_text_args(args: argparse.Namespace) -> None:
    """Arguments reach Python with undecodable bytes smuggled in as lone surrogates; text
    that is not UTF-8 must be an error, not tokenized as garbage."""
    for name in _TEXT_OPTIONS:
        values = getattr(args, name, None)
        for v in values if isinstance(values, list) else [values]:
            if not isinstance(v, str):
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                opt = name if name in ("text", "ids") else "--" + name.replace("_", "-")
                raise BadRequestError(
                    f"{opt} is not valid UTF-8 text (undecodable byte at position {exc.start})"
                ) from None


def _tokenizer(model: str | Path) -> Any:
    from estream.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model)


def _tokens_from_args(args: argparse.Namespace) -> tuple[list[int], Any]:
    tok = None
    if getattr(args, "tokens", None) is not None:
        return _parse_ids(args.tokens), None
    text = None
    if getattr(args, "prompt", None) is not None:
        text = args.prompt
    elif getattr(args, "prompt_file", None):
        from .task_commands import MAX_PROMPT_BYTES, read_text

        text, _ = read_text(args.prompt_file, "prompt file", MAX_PROMPT_BYTES)
    if text is None:
        raise BadRequestError("give the prompt as --tokens 1,2,3, --prompt TEXT or --prompt-file F")
    tok = _tokenizer(args.model)
    ids = tok.encode(text, add_special=True)
    return ids, tok


def _piece(tok: Any, i: int) -> str:
    if tok is None:
        return ""
    try:
        return tok.token_to_piece(i)
    except Exception:
        return ""


# -- commands ---------------------------------------------------------------------------------
def cmd_prefill(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    outputs = (("--all-logits", args.all_logits), ("--trace", args.trace))
    for option, path in outputs:
        check_output(path, option)  # refused before the model loads
    # With an output on standard output (-), the report goes to stderr: stdout holds the file.
    report = sys.stderr if stdout_claimed(outputs) else sys.stdout
    ids, tok = _tokens_from_args(args)
    op_stats = bool(args.op_stats or args.trace)  # a traced run keeps the table in its metadata
    with engine_from_args(
        args, progress=not args.json, tokens=max(1, len(ids)), op_stats=op_stats
    ) as engine:
        res = engine.prefill(ids, all_logits=bool(args.all_logits))
        m = dict(res.metrics)
        if m.get("op_table"):  # each rate read against this CPU's peak on the pass's threads
            m["op_table"] = with_measured_peaks(m["op_table"], engine.backend)
    m["end_to_end_s"] = time.perf_counter() - t0
    top = res.top_k(args.top_k)
    if args.all_logits:
        logits = res.logits.astype(np.float32)
        write_output(args.all_logits, "--all-logits", lambda f: np.save(f, logits))
    if args.trace:
        write_trace(args.trace, res.events, public_metrics(m))
    if args.json:
        doc = {
            "tokens": len(ids),
            "top_k": [{"id": i, "prob": p, "piece": _piece(tok, i)} for i, p in top],
            "metrics": public_metrics(m),
        }
        print(json.dumps(doc, indent=1), file=report)
    else:
        print(f"next-token top-{len(top)} after {plural(len(ids), 'token')}:", file=report)
        for i, p in top:
            piece = _piece(tok, i)
            line = f"  {i:>8d}  {p:8.4f}  {piece!r}" if piece else f"  {i:>8d}  {p:8.4f}"
            print(line, file=report)
        print("metrics:", file=report)
        print_metrics(m, report)
    return 0


PROFILE_DESCRIPTION = """\
Calibrate the pack: one request per candidate group size and the grouped-read bandwidth
BW(g, q); the profile is stored in the pack's manifest, and `estream config` and
`--budget` choose (G, Q, B) from it.

A profile records what it was measured with: the CPU, the SIMD kernel set the kernels
picked, the estream-htp build (version and a hash of its compiled library), the thread
count, the activation format, the backend and the pack's expert formats. A profile whose
record differs from the running ones, or that records none (made by an older estream), is
stale: its times belong to other kernels or another machine.
  * `estream prefill --budget` and a stored configuration do not use a stale profile:
    the run takes the default G=min(4, experts) Q=2 B=4 (smaller if the budget needs it)
    and prints one warning line saying what differs.
  * `estream config` refuses a stale profile (exit 1).
  * `estream profile --if-stale` re-profiles only when the profile is missing or stale.
"""


def cmd_profile(args: argparse.Namespace) -> int:
    from estream.config import profile_staleness, store_profile
    from estream.packed import PackedModel
    from estream.profiling import profile_model

    if args.if_stale:
        diffs = profile_staleness(PackedModel(args.model), args.threads)
        if diffs == []:
            _log(f"{args.model}: the stored profile is current; nothing to do")
            return 0
        if diffs is None:
            _log(f"{args.model}: no profile stored")
        else:
            _log(f"{args.model}: the stored profile is stale: {'; '.join(diffs)}")
    cands = args.candidates
    if cands is None:  # the default set, the sizes of it that fit the model's experts
        from estream.profiling import DEFAULT_CANDIDATES

        n_experts = PackedModel(args.model).hparams.n_experts
        cands = [g for g in DEFAULT_CANDIDATES if g <= n_experts]
    qs = tuple(args.queue_depths)
    _log(
        f"profiling {args.model}: one calibration request per g ∈ {{{', '.join(map(str, cands))}}}, "
        f"{plural(args.tokens, 'token')}"
    )
    t0 = time.perf_counter()
    prof = profile_model(
        args.model,
        candidates=tuple(cands),
        queue_depths=qs,
        n_tokens=args.tokens,
        bw_rounds=args.bw_rounds,
        n_threads=args.threads,
        log=_log,
    )
    store_profile(PackedModel(args.model), prof)
    _log(f"profile stored in {args.model}/manifest.json ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from estream.config import configure_for_budget, require_fresh_profile, store_config
    from estream.packed import PackedModel

    check_output(args.plot, "--plot")
    # With --plot - (the PNG on standard output) the report goes to stderr.
    report = sys.stderr if stdout_claimed([("--plot", args.plot)]) else sys.stdout
    model = PackedModel(args.model)
    budget = memory.parse_bytes(args.budget)
    if args.tokens is not None and args.tokens > model.hparams.n_ctx:
        raise BadRequestError(
            f"--tokens {args.tokens} is longer than the model context "
            f"({model.hparams.n_ctx} tokens)"
        )
    require_fresh_profile(model, args.threads)  # stale times would choose for other kernels
    t0 = time.perf_counter()
    choice = configure_for_budget(model, budget, args.tokens, read_margin=args.read_margin)
    dt = time.perf_counter() - t0
    cfg = store_config(model, choice, budget)
    if args.json:
        doc = {
            "config": cfg,
            "read_margin": choice.read_margin,
            "slow_reads_s": choice.slow_reads_s,
            "select_ms": dt * 1e3,
            "table": _table_rows(choice),
        }
        print(json.dumps(doc), file=report)
    else:
        with contextlib.redirect_stdout(report):
            _print_choice(choice, budget, dt)
    if args.plot:
        _plot(choice, budget, args.plot, report)
    return 0


def _table_rows(choice: Any) -> list[dict[str, Any]]:
    rows = []
    for r in getattr(choice, "table", []) or []:
        if hasattr(r, "__attrs_attrs__"):
            import attrs

            rows.append(attrs.asdict(r))
        elif isinstance(r, dict):
            rows.append(r)
        else:
            rows.append(dict(r._asdict()) if hasattr(r, "_asdict") else {"row": list(r)})
    return rows


def _print_choice(choice: Any, budget: int, dt: float) -> None:
    extra = choice.extra_bytes
    prompt = f", {memory.format_bytes(extra)} of it the longer prompt's" if extra else ""
    margin = float(getattr(choice, "read_margin", 0.0) or 0.0)
    slow = (
        f" ({choice.slow_reads_s * 1e3:.1f} ms with reads {1 + margin:g} times as long)"
        if margin
        else ""
    )
    print(
        f"budget {memory.format_bytes(budget)} → G={choice.G} Q={choice.Q} B={choice.B}: "
        f"predicted {choice.predicted_s * 1e3:.1f} ms{slow} per request of "
        f"{choice.tokens or '?'} tokens, memory {memory.format_bytes(choice.memory_bytes)}{prompt} "
        f"(selected in {dt * 1e3:.2f} ms)"
    )
    rows = _table_rows(choice)
    if not rows:
        return
    # One line per candidate group size: its best feasible bank count B*(g), ranked as the
    # configurator ranks them (reads slowed by the margin first, then as profiled).
    slow_head = f" {'slow reads':>12s}" if margin else ""
    print(f"  {'g':>4s} {'B*(g)':>6s} {'B_max':>6s} {'predicted':>12s}{slow_head} {'memory':>12s}")
    for g in sorted({int(r["g"]) for r in rows}):
        mine = [r for r in rows if int(r["g"]) == g]
        feas = [r for r in mine if r["feasible"]]
        if not feas:
            print(f"  {g:>4d} {'-':>6s} {'-':>6s} {'infeasible':>12s} {'':>12s}")
            continue
        best = min(
            feas,
            key=lambda r: (r.get("slow_reads_s", 0.0), r["predicted_s"], r["memory_bytes"]),
        )
        mark = " *" if (g, int(best["b"])) == (choice.G, choice.B) else ""
        slow_col = f" {best['slow_reads_s'] * 1e3:>9.1f} ms" if margin else ""
        print(
            f"  {g:>4d} {int(best['b']):>6d} {max(int(r['b']) for r in feas):>6d} "
            f"{best['predicted_s'] * 1e3:>9.1f} ms{slow_col} "
            f"{memory.format_bytes(best['memory_bytes']):>12s}{mark}"
        )


def _plot(choice: Any, budget: int, out: str, report: Any) -> None:
    try:
        import estream_sched as es

        write_output_named(
            out,
            "--plot",
            lambda name: es.plot_frontier(choice.table, name, chosen=choice, budget=budget),
        )
        print(f"plot written to {out}", file=report)
    except ImportError as exc:
        raise BadRequestError(
            f"--plot needs matplotlib: pip install 'estream-sched[plot]' ({exc})"
        ) from None


def _pass_through(command: str, argv: list[str]) -> int:
    """`estream synth|pack ARGS` is `estream-synth|estream-pack ARGS`: every argument, `--help`
    included, goes to estream-layout's own parser untouched (argparse's REMAINDER would eat
    options such as `--arch` that come first), so the two spellings cannot drift apart."""
    from estream_layout import cli as lcli

    run = lcli.synth_main if command == "synth" else lcli.pack_main
    return int(run(argv) or 0)


def cmd_synth(args: argparse.Namespace) -> int:
    return _pass_through("synth", args.rest)


def cmd_pack(args: argparse.Namespace) -> int:
    return _pass_through("pack", args.rest)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_tokenize(args: argparse.Namespace) -> int:
    tok = _tokenizer(args.model)
    ids = tok.encode(args.text, add_special=args.add_special, parse_special=args.parse_special)
    if args.json:
        print(json.dumps({"ids": ids}))
    else:
        print(" ".join(str(i) for i in ids))
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    tok = _tokenizer(args.model)
    ids = _parse_ids(args.ids, "the ids argument")
    bad = [i for i in ids if not 0 <= i < tok.n_vocab]
    if bad:
        raise BadRequestError(f"token id {bad[0]} is out of the vocabulary (0..{tok.n_vocab - 1})")
    text = tok.decode(ids, skip_special=args.skip_special)
    print(json.dumps({"text": text}) if args.json else text)
    return 0


#: The order of the commands in a model's life, shown by `estream --help`.
WORKFLOW = """\
workflow (one model, in this order):
  1. estream synth --arch olmoe --preset tiny -o m.gguf   a synthetic model (or bring a GGUF)
  2. estream pack m.gguf -o m.estream                     pack it for streaming
  3. estream profile m.estream                            calibrate this machine's storage
  4. estream config m.estream --budget 1.5GiB             choose G, Q, B for a memory budget
  5. estream prefill m.estream --prompt "..."             run it; or the tasks classify,
     score, rerank, embed; or eval perplexity|choice|cloze
`estream demo` runs steps 1-5 on a synthetic model; `estream COMMAND --help` for each command.
"""


def build_parser() -> argparse.ArgumentParser:
    # long: the dispatch table of the commands, one subparser and its options per command
    ap = argparse.ArgumentParser(
        prog="estream",
        description="Streamed prefill-only MoE inference: experts stay in storage.",
        epilog=WORKFLOW,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("synth", help="write a synthetic GGUF MoE model (see estream-synth -h)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="estream-synth's arguments")
    p.set_defaults(func=cmd_synth)
    p = sub.add_parser("pack", help="pack a GGUF model into NAME.estream (see estream-pack -h)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="estream-pack's arguments")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser(
        "profile",
        help="calibrate: one request per candidate group size",
        description=PROFILE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--if-stale",
        action="store_true",
        help="profile only if the stored profile is missing or stale (measured with another "
        "CPU, SIMD kernel set, estream-htp build, thread count or expert formats, or not "
        "saying what with); otherwise say it is current and change nothing",
    )
    p.add_argument(
        "--threads",
        type=bounded_int(MAX_THREADS, "threads"),
        help="compute threads to calibrate with: those of the runs the profile is for (default: "
        "all cores, ≤ 8, as the runs'); a run at another count finds the profile stale",
    )
    p.add_argument(
        "--candidates",
        type=int_list,
        default=None,
        metavar="G,G,...",
        help="comma-separated group sizes g to profile, each ≤ the model's expert count "
        "(default: those of 1,2,4,8,16,32 that are)",
    )
    p.add_argument(
        "--queue-depths",
        type=int_list,
        default=[1, 2, 4, 8],
        metavar="Q,Q,...",
        help="comma-separated queue depths q at which BW(g, q) is measured (default 1,2,4,8)",
    )
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=256,
        help="calibration prompt length, ≤ the model context (default 256)",
    )
    p.add_argument(
        "--bw-rounds",
        type=positive_int,
        default=3,
        help="interleaved rounds of BW(g, q) measurements; each point keeps its median",
    )
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("config", help="choose (G, Q, B) for a memory budget from the profile")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--budget", required=True, help="memory budget: bytes or e.g. 800MiB, 1.5GiB, 2GB"
    )
    p.add_argument(
        "--tokens",
        type=positive_int,
        help="prompt length to configure for, ≤ the model context (default: the profile's "
        "calibration length; "
        "`estream prefill --budget` uses each request's own)",
    )
    p.add_argument(
        "--read-margin", type=read_margin, help=READ_MARGIN_HELP.removeprefix("with --budget: ")
    )
    p.add_argument(
        "--json", action="store_true", help="machine-readable output (the choice and its table)"
    )
    p.add_argument("--plot", metavar="PNG", help="plot the latency–memory frontier")
    p.add_argument(
        "--threads",
        type=bounded_int(MAX_THREADS, "threads"),
        help="compute threads of the runs to configure for (default: all cores, ≤ 8); a "
        "profile measured at another count is stale and refused",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("prefill", help="one forward pass; print next-token top-k and metrics")
    p.add_argument("model", help=MODEL_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument(
        "--prompt-file", help="file with the prompt text (UTF-8, at most 16 MiB; '-': stdin)"
    )
    p.add_argument(
        "--top-k", type=positive_int, default=5, help="how many next tokens to list (default 5)"
    )
    p.add_argument("--all-logits", metavar="OUT.npy", help="save float32 logits [T, n_vocab]")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--trace",
        metavar="OUT.json",
        help="write a Chrome trace-event timeline (its metadata and the report hold the per-op "
        "table, as with --op-stats)",
    )
    p.add_argument(
        "--op-stats",
        action="store_true",
        help="print the per-op table: time, share of the pass, work (GOP), GOP/s of each op "
        "kind and its share of this CPU's measured peak for its precision (in --json: "
        "metrics.op_table)",
    )
    add_engine_opts(p)
    p.set_defaults(func=cmd_prefill)

    # The commands in workflow order: prefill's siblings (tasks, eval), then the tools.
    from .eval_commands import add_eval_command
    from .task_commands import add_task_commands

    add_task_commands(sub)
    add_eval_command(sub)

    p = sub.add_parser("bench", help="TTFT / memory over prompt lengths and modes")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--lengths",
        default="256,1024",
        metavar="T,T,...",
        help="comma-separated prompt lengths in tokens, each ≤ the model context "
        "(default 256,1024)",
    )
    p.add_argument(
        "--modes",
        default="stream,resident",
        metavar="MODE,...",
        help="comma-separated modes among stream, resident, naive, layer (default stream,resident)",
    )
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    p.add_argument("--json", action="store_true", help="machine-readable output (every run)")
    p.add_argument(
        "--budget",
        help="memory budget for the stream runs (needs a stored profile and stream in --modes)",
    )
    p.add_argument(
        "--threads",
        type=bounded_int(MAX_THREADS, "threads"),
        help=f"compute threads of each run (default: all cores, ≤ 8; at most {MAX_THREADS})",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="runs per length and mode, each a fresh process (default 1)",
    )
    p.set_defaults(func=cmd_bench)

    from estream_layout.synth import ARCHES, PRESETS

    p = sub.add_parser("demo", help="the main job: synth → pack → profile → config → prefill")
    p.add_argument(
        "--arch",
        default="olmoe",
        choices=ARCHES,
        help="architecture of the synthetic model (default olmoe)",
    )
    p.add_argument(
        "--preset",
        default="demo",
        choices=("demo", *PRESETS),
        help="demo (default: ≈ 230 MiB of experts), or a preset of estream-synth: tiny, small "
        "or a full-size one of --arch's family",
    )
    p.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    p.add_argument("--tokens", type=positive_int, default=256, help="prompt length")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("tokenize", help="text → token ids with the model's own tokenizer")
    p.add_argument("model", help="packed model, GGUF model or vocabulary-only GGUF")
    p.add_argument("text", help="the text to tokenize (UTF-8)")
    p.add_argument("--add-special", action="store_true", help="add BOS/EOS as the model does")
    p.add_argument("--parse-special", action="store_true", help="match special tokens in text")
    p.add_argument("--json", action="store_true", help='print {"ids": [...]}')
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids → text")
    p.add_argument("model", help="packed model, GGUF model or vocabulary-only GGUF")
    p.add_argument("ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--skip-special", action="store_true", help="leave special tokens (BOS, EOS, ...) out"
    )
    p.add_argument("--json", action="store_true", help='print {"text": ...}')
    p.set_defaults(func=cmd_detokenize)

    return ap


#: Subcommands handed to estream-layout's command lines with their arguments untouched.
PASS_THROUGH = ("synth", "pack")


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        return _main(list(argv))
    # As a program: once the answer is known, a Ctrl-C while the interpreter exits must not
    # turn a finished run (its output written) into a silent death by SIGINT.
    try:
        return _main(sys.argv[1:])
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _check_model(args: argparse.Namespace) -> None:
    """The model argument names something that exists: one message for a missing pack,
    whichever command it is given to and whatever else lies beside it (a GGUF of that name)."""
    model = getattr(args, "model", None)
    if model is None or os.path.lexists(model):
        return
    if args.command in ("tokenize", "detokenize"):
        raise PackError(
            f"{model}: no such packed model or GGUF file (expected a NAME.estream directory "
            "or a .gguf file)"
        )
    raise PackError(f"{model}: no such packed model (expected a NAME.estream directory)")


def _main(argv: list[str]) -> int:
    if signal.getsignal(signal.SIGINT) is estream_cli.interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # see estream_cli/__init__
    if argv and argv[0] in PASS_THROUGH:
        return _pass_through(argv[0], argv[1:])  # --help / usage errors exit as theirs do
    try:
        args = build_parser().parse_args(argv)
        _check_text_args(args)
        _check_model(args)
        if hasattr(args, "backend") and hasattr(args, "mode"):
            check_engine_opts(args)  # an option the mode would ignore: refused before any work
        with warnings.catch_warnings():
            for category in WarningLines.CATEGORIES:
                warnings.simplefilter("always", category)
            warnings.showwarning = WarningLines(warnings.showwarning)
            return int(args.func(args) or 0)
    except BrokenPipeError:
        # `estream ... | head`: the reader left; stop quietly (no traceback, nothing on
        # stderr). Point stdout at /dev/null so the interpreter's final flush does not fail.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by SIGPIPE
    except EStreamError as exc:
        _err(describe(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as exc:
        # Errors from the lower packages carry specific messages: printed alone, as sentences
        # (no class name); anything else is a bug, said to be one. No traceback for users.
        if os.environ.get("ESTREAM_DEBUG"):
            raise
        _err(describe(exc))
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
