"""The engine options that every model-running sub-command shares, and the engine they make."""

from __future__ import annotations

import argparse
import re
from typing import Any

from estream.engine import ACTS, ATTENTION, DENSE_OPS, MODES, Engine, load
from estream.experts import SCHEDULES
from estream.memory import parse_bytes

__all__ = [
    "MAX_BANKS",
    "MAX_COUNT",
    "MAX_QUEUE_DEPTH",
    "MAX_THREADS",
    "add_engine_opts",
    "bounded_int",
    "check_engine_opts",
    "engine_from_args",
    "int_list",
    "parse_ints",
    "positive_int",
]

#: The largest count an option takes (threads, group size, lengths, ...): beyond it a value is
#: a typo, not a request.
MAX_COUNT = 2**31 - 1

# ASCII digits only: Python's int() also reads full-width and other Unicode digits ("１"),
# underscores ("1_0") and surrounding blanks, none of which a command line should accept.
_INT = re.compile(r"-?[0-9]+")


def _shown(text: str) -> str:
    """A value as quoted in an error message: at most 40 characters, escapes for the rest."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_ints(
    text: str, option: str, *, minimum: int | None = None, noun: str = "integers"
) -> list[int]:
    """The integers of a comma-separated list (``1,2,3``; blanks around items allowed),
    ASCII digits only, no empty item, each ``>= minimum`` when given; else one clear error
    naming ``option``."""
    from estream.errors import BadRequestError

    items = text.split(",")
    out: list[int] = []
    for n, raw in enumerate(items, 1):
        item = raw.strip(" \t")
        if not item:
            where = "is empty" if len(items) == 1 else f"has an empty item (item {n})"
            raise BadRequestError(
                f"{option} {where}: give comma-separated {noun} such as 1,2,3, got {_shown(text)}"
            )
        if not _INT.fullmatch(item) or len(item) > 19:
            where = "" if item == text.strip(" \t") else f" in {_shown(text)}"
            raise BadRequestError(
                f"{option} takes comma-separated {noun} (ASCII digits), got {_shown(item)}{where}"
            )
        v = int(item)
        if minimum is not None and v < minimum:
            raise BadRequestError(f"{option} values must be >= {minimum}, got {v}")
        out.append(v)
    return out


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 written in ASCII digits (0 never silently means "the
    default"), at most `MAX_COUNT`."""
    s = text.strip(" \t")
    if not re.fullmatch(r"[0-9]+", s):
        if re.fullmatch(r"-[0-9]+", s):
            raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {_shown(text)} (ASCII digits only)"
        )
    v = int(s) if len(s) <= 19 else MAX_COUNT + 1
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    if v > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, got {_shown(s)}")
    return v


def int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers (see `parse_ints`)."""
    from estream.errors import BadRequestError

    try:
        values = parse_ints(text, "the list", minimum=1)
    except BadRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the list ")) from None
    if any(v > MAX_COUNT for v in values):
        raise argparse.ArgumentTypeError(f"values must be at most {MAX_COUNT}")
    return values


def read_margin(text: str) -> float:
    """argparse type: the configurator's margin for slower reads, a decimal number from 0 to
    `estream_sched.MAX_READ_MARGIN` (`estream_sched.check_read_margin`)."""
    import estream_sched as es

    s = text.strip(" \t")
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", s):
        raise argparse.ArgumentTypeError(
            f"expected a number from 0 to {es.MAX_READ_MARGIN:g} (0.5: reads 1.5 times as long "
            f"as profiled), got {_shown(text)}"
        )
    try:
        return es.check_read_margin(float(s))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("read_margin ")) from None


READ_MARGIN_HELP = (
    "with --budget: choose G, Q and B for reads this much longer than the profile measured "
    "(default 0.5: 1.5 times as long, so that a disk slowed by another reader still hides "
    "behind compute; 0: for the profiled disk exactly)"
)


#: Upper bounds of the engine's count options: beyond them a value starts thousands of threads
#: or reads before anything useful happens.
MAX_THREADS = 1024
MAX_QUEUE_DEPTH = 256
MAX_BANKS = 4096


def bounded_int(limit: int, what: str) -> Any:
    """argparse type: a `positive_int` at most ``limit`` (``what``: the unit, for messages)."""

    def parse(text: str) -> int:
        v = positive_int(text)
        if v > limit:
            raise argparse.ArgumentTypeError(f"at most {limit} {what}, got {v}")
        return v

    parse.__name__ = "positive integer"  # argparse names the type in its messages
    return parse


def add_engine_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=MODES,
        default="stream",
        help="expert placement: stream (default: experts read from storage through the arena), "
        "resident (all experts in memory), naive (G=1 Q=1 B=3) or layer (a whole layer a group)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="when expert reads start (streamed modes; default early)",
    )
    p.add_argument(
        "--budget",
        help="memory budget, e.g. 1.5GiB: G, Q and B chosen for it from the stored profile "
        "(mode stream; not with -G/-Q/-B)",
    )
    p.add_argument("--read-margin", type=read_margin, help=READ_MARGIN_HELP)
    p.add_argument(
        "--pin",
        help="memory for experts read once at load and kept for every pass, e.g. 800MiB (whole "
        "groups: group 0 of every layer, then group 1, ...), or auto: what --budget leaves "
        "over the run's predicted memory (not with --mode resident)",
    )
    p.add_argument(
        "-G",
        type=bounded_int(MAX_COUNT, "experts"),
        help="experts per group (mode stream; ≤ the model's expert count; overrides the "
        "stored configuration)",
    )
    p.add_argument(
        "-Q",
        type=bounded_int(MAX_QUEUE_DEPTH, "reads in flight"),
        help=f"group reads in flight (mode stream; ≤ {MAX_QUEUE_DEPTH})",
    )
    p.add_argument(
        "-B",
        type=bounded_int(MAX_BANKS, "banks"),
        help=f"banks in the arena, each one group (mode stream; ≤ {MAX_BANKS})",
    )
    p.add_argument(
        "--threads",
        type=bounded_int(MAX_THREADS, "threads"),
        help="compute threads of this process (default: all cores, ≤ 8; with --backend hexagon "
        "only together with --dense-ops host)",
    )
    p.add_argument("--verify", action="store_true", help="check each record's checksum as it loads")
    p.add_argument(
        "--act",
        choices=ACTS,
        default="q8",
        help="activations: q8 (int8 per 32-block, fast; default) or f32 (exact)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default="auto",
        help="attention products: auto (default: with --act q8 where bf16 runs at twice fp32's "
        "rate, bf16 for the architectures whose parity rows all show its error within 5 %% of "
        "f32's (OLMoE, Mixtral, DeepSeek-V2, LFM2-MoE), else f32; always f32 with --act f32), "
        "f32 (fp32 products), bf16 (q, k, v and the softmax weights rounded to bfloat16, fp32 "
        "sums, ~3e-3 relative per op: about twice fp32's rate where the CPU has AVX512_BF16 with "
        "an AVX-512 or AMX kernel set; slower than f32 elsewhere, emulated or, on NEON with "
        "FEAT_BF16, native at one product a lane) or bf16-pv (fp32 scores, only v and the "
        "softmax weights rounded: ~2e-3, the weighted sum at bf16's rate). Results report the "
        "precision that ran",
    )
    p.add_argument(
        "--backend",
        choices=("host", "host-process", "hexagon"),
        default="host",
        help="where expert ops run: in this process (default), in an executor process, or in "
        "the Hexagon executor (the library built for Hexagon v67+HVX, run under "
        "qemu-hexagon-static)",
    )
    p.add_argument(
        "--dense-ops",
        choices=DENSE_OPS,
        default=None,
        help="where the dense kernel ops run: host (this process) or backend (the expert "
        "backend's executor, so not with --backend host); default backend for --backend "
        "hexagon, host otherwise",
    )


def check_engine_opts(args: argparse.Namespace) -> None:
    """Refuse an engine option that would do nothing in the chosen combination (a budget in
    resident mode, threads of an executor that runs one, ...): never silently ignored. (A
    group size beyond the model's experts is refused where the configuration is resolved.)"""
    from estream.errors import BadRequestError

    explicit = [f"-{k} {getattr(args, k)}" for k in ("G", "Q", "B") if getattr(args, k, None)]
    budget = getattr(args, "budget", None)
    mode = args.mode
    if mode != "stream":
        fixed = {
            "resident": "holds every expert in memory (no arena)",
            "naive": "fixes G=1 Q=1 B=3",
            "layer": "reads a whole layer a group (G = the expert count, Q=2 B=2)",
        }[mode]
        pin = getattr(args, "pin", None)
        given_opts = [f"--budget {budget}"] if budget is not None else []
        # naive and layer stream through an arena: pins work there
        given_opts += [f"--pin {pin}"] if pin is not None and mode == "resident" else []
        for given in given_opts + explicit:
            raise BadRequestError(
                f"{given.split()[0]} does nothing with --mode {mode}, which {fixed}; "
                "drop it or use --mode stream"
            )
    if mode == "resident" and args.schedule is not None:
        raise BadRequestError(
            "--schedule does nothing with --mode resident (no expert is read during a pass); "
            "drop it or use --mode stream"
        )
    pin = getattr(args, "pin", None)
    if pin == "auto" and budget is None:
        raise BadRequestError(
            "--pin auto pins what --budget leaves over the run's predicted memory: give --budget"
        )
    if pin is not None and pin != "auto":
        parse_bytes(pin)  # a size that cannot be read: refused before any input is read
    if getattr(args, "read_margin", None) is not None and budget is None:
        raise BadRequestError(
            "--read-margin sets how the configurator chooses G, Q and B for --budget: give "
            "--budget, or drop it"
        )
    if budget is not None and explicit:
        raise BadRequestError(
            f"--budget chooses G, Q and B itself; give either --budget or {' '.join(explicit)}"
        )
    if args.backend == "host" and args.dense_ops == "backend":
        raise BadRequestError(
            "--dense-ops backend does nothing with --backend host: that backend is this "
            "process, where the dense ops run anyway; drop it or give --backend host-process "
            "or hexagon"
        )
    if args.backend == "hexagon" and args.threads and (args.dense_ops or "backend") == "backend":
        raise BadRequestError(
            "--threads does nothing with --backend hexagon: the Hexagon executor runs one "
            "thread and the dense ops run there too; drop --threads, or add --dense-ops host "
            "to run the dense ops on this many host threads"
        )


def engine_from_args(
    args: argparse.Namespace, *, progress: bool, tokens: int | None = None, op_stats: bool = False
) -> Engine:
    """Load the engine with the options `add_engine_opts` added to a sub-command; ``tokens``:
    the prompt length a ``--budget`` configuration is chosen for (one request's length);
    ``op_stats``: each pass's metrics get the per-op table (`estream.opstats`)."""
    check_engine_opts(args)
    # a stale profile's StaleProfileWarning: one line, by the hook the command runs under
    # (estream_cli.main.WarningLines)
    return _load(args, progress, tokens, op_stats)


def engine_kwargs(args: argparse.Namespace, tokens: int | None = None) -> dict[str, Any]:
    """The `estream.load` keywords of the engine options `add_engine_opts` added that every
    engine of the command takes, in this process or in a Ray actor: ``tokens`` is the pass
    length a ``--budget`` configuration is chosen for (None: the profile's pass). The threads,
    backend and what a pass reports are the caller's (`_load`; a Ray actor has its own)."""
    return {
        "mode": args.mode,
        "schedule": args.schedule or "early",
        "budget": args.budget,
        "budget_tokens": tokens if args.budget is not None else None,
        "G": args.G,
        "Q": args.Q,
        "B": args.B,
        "verify": args.verify,
        "act": args.act,
        "attention": args.attention,
        "pin": getattr(args, "pin", None),
        "read_margin": getattr(args, "read_margin", None),
    }


def _load(args: argparse.Namespace, progress: bool, tokens: int | None, op_stats: bool) -> Engine:
    return load(
        args.model,
        **engine_kwargs(args, tokens),
        n_threads=args.threads,
        backend=args.backend,
        dense_ops=args.dense_ops,
        progress=progress,
        op_stats=op_stats,
    )
