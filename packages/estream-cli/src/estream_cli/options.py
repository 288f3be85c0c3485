"""The engine options that every model-running sub-command shares, and the engine they make."""

from __future__ import annotations

import argparse

from estream.engine import ACTS, ATTENTION, DENSE_OPS, MODES, Engine, load
from estream.experts import SCHEDULES

__all__ = ["add_engine_opts", "engine_from_args", "positive_int"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 never silently means "the default")."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_engine_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode", choices=MODES, default="stream", help="expert placement (default stream)"
    )
    p.add_argument("--schedule", choices=SCHEDULES, default="early", help="when reads start")
    p.add_argument("--budget", help="memory budget, e.g. 1.5GiB (needs a stored profile)")
    p.add_argument("-G", type=positive_int, help="group size (overrides the configuration)")
    p.add_argument("-Q", type=positive_int, help="reads in flight")
    p.add_argument("-B", type=positive_int, help="banks in the arena")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all cores, ≤ 8)")
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
        default="f32",
        help="attention products: f32 (default) or bf16 (q, k, v and the softmax weights "
        "rounded to bfloat16, fp32 sums, ~3e-3 relative per op: faster on long prompts where the "
        "CPU has AVX512_BF16; emulated, and several times slower, elsewhere)",
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
        "backend's executor); default backend for --backend hexagon, host otherwise",
    )


def engine_from_args(
    args: argparse.Namespace, *, progress: bool, tokens: int | None = None
) -> Engine:
    """Load the engine with the options `add_engine_opts` added to a sub-command; ``tokens``:
    the prompt length a ``--budget`` configuration is chosen for (one request's length)."""
    return load(
        args.model,
        mode=args.mode,
        schedule=args.schedule,
        budget=args.budget,
        budget_tokens=tokens if args.budget is not None else None,
        G=args.G,
        Q=args.Q,
        B=args.B,
        n_threads=args.threads,
        verify=args.verify,
        act=args.act,
        attention=args.attention,
        backend=args.backend,
        dense_ops=args.dense_ops,
        progress=progress,
    )
