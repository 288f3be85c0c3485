"""The `estream` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import memory
from .errors import BadRequestError, EStreamError

__all__ = ["main"]


def _err(msg: str) -> None:
    print(f"estream: error: {msg}", file=sys.stderr)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- token input ------------------------------------------------------------------------------
def _parse_ids(text: str) -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise BadRequestError(
            f"--tokens takes comma-separated integer ids, got {text[:40]!r}"
        ) from None


def _tokenizer(model: str | Path) -> Any:
    from .tokenizer import Tokenizer

    return Tokenizer.from_gguf(model)


def _tokens_from_args(args: argparse.Namespace) -> tuple[list[int], Any]:
    tok = None
    if getattr(args, "tokens", None):
        return _parse_ids(args.tokens), None
    text = None
    if getattr(args, "prompt", None) is not None:
        text = args.prompt
    elif getattr(args, "prompt_file", None):
        try:
            text = Path(args.prompt_file).read_text()
        except OSError as exc:
            raise BadRequestError(f"cannot read prompt file {args.prompt_file}: {exc}") from None
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


# -- reporting --------------------------------------------------------------------------------
_METRIC_ROWS = [
    ("ttft_s", "pure-prefill TTFT", lambda v: f"{v * 1e3:.1f} ms"),
    ("end_to_end_s", "end-to-end (load + prefill)", lambda v: f"{v * 1e3:.1f} ms"),
    ("peak_memory_bytes", "peak memory", memory.format_bytes),
    ("expert_memory_bytes", "expert memory (arena)", memory.format_bytes),
    ("dense_bytes", "dense weights (resident)", memory.format_bytes),
    ("bytes_read", "expert bytes read", memory.format_bytes),
    ("io_compute_overlap", "I/O–compute overlap", lambda v: f"{v * 100:.1f} %"),
    ("bubble_rate", "bubble rate", lambda v: f"{v * 100:.1f} %"),
    ("expert_stall_s", "executor waited for reads", lambda v: f"{v * 1e3:.1f} ms"),
]


def print_metrics(m: dict[str, Any], out: Any = sys.stdout) -> None:
    cfg = f"mode={m.get('mode')}"
    if "G" in m:
        cfg += f" G={m['G']} Q={m['Q']} B={m['B']} ({m.get('config_source')}) schedule={m.get('schedule')}"
    print(
        f"  {cfg}  tokens={m.get('tokens')}  threads={m.get('threads')}  simd={m.get('simd')}"
        f"  act={m.get('act')}",
        file=out,
    )
    for key, label, fmt in _METRIC_ROWS:
        if key in m and m[key] is not None:
            print(f"  {label:<30s} {fmt(m[key])}", file=out)


def _public_metrics(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k not in ("layer_t_ne_s",)}


def write_trace(path: str | Path, events: list[Any], meta: dict[str, Any]) -> None:
    """Chrome trace-event JSON (Perfetto / chrome://tracing), written atomically."""
    import estream_sched as es

    doc = es.chrome_trace(events)
    doc["otherData"] = meta
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


# -- commands ---------------------------------------------------------------------------------
def engine_from_args(args: argparse.Namespace, *, progress: bool) -> Any:
    """Load the engine with the options `_add_engine_opts` added to a sub-command."""
    from .engine import load

    return load(
        args.model,
        mode=args.mode,
        schedule=args.schedule,
        budget=args.budget,
        G=args.G,
        Q=args.Q,
        B=args.B,
        n_threads=args.threads,
        verify=args.verify,
        act=args.act,
        backend=args.backend,
        progress=progress,
    )


def cmd_prefill(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    ids, tok = _tokens_from_args(args)
    with engine_from_args(args, progress=not args.json) as engine:
        res = engine.prefill(ids, all_logits=bool(args.all_logits))
    m = dict(res.metrics)
    m["end_to_end_s"] = time.perf_counter() - t0
    top = res.top_k(args.top_k)
    if args.all_logits:
        _save_npy(args.all_logits, res.logits.astype(np.float32))
    if args.trace:
        write_trace(args.trace, res.events, _public_metrics(m))
    if args.json:
        doc = {
            "tokens": len(ids),
            "top_k": [{"id": i, "prob": p, "piece": _piece(tok, i)} for i, p in top],
            "metrics": _public_metrics(m),
        }
        print(json.dumps(doc, indent=1))
    else:
        print(f"next-token top-{len(top)} after {len(ids)} tokens:")
        for i, p in top:
            piece = _piece(tok, i)
            print(f"  {i:>8d}  {p:8.4f}  {piece!r}" if piece else f"  {i:>8d}  {p:8.4f}")
        print("metrics:")
        print_metrics(m)
    return 0


def _save_npy(path: str, arr: np.ndarray) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}.npy")
    try:
        np.save(tmp, arr)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def cmd_profile(args: argparse.Namespace) -> int:
    from .packed import PackedModel
    from .profiling import profile_model, store_profile

    cands = tuple(int(x) for x in args.candidates.split(","))
    qs = tuple(int(x) for x in args.queue_depths.split(","))
    _log(f"profiling {args.model}: one calibration request per g ∈ {cands}, {args.tokens} tokens")
    t0 = time.perf_counter()
    prof = profile_model(
        args.model, candidates=cands, queue_depths=qs, n_tokens=args.tokens, log=_log
    )
    store_profile(PackedModel(args.model), prof)
    _log(f"profile stored in {args.model}/manifest.json ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from .packed import PackedModel
    from .profiling import configure_for_budget, store_config

    model = PackedModel(args.model)
    budget = memory.parse_bytes(args.budget)
    t0 = time.perf_counter()
    choice = configure_for_budget(model, budget)
    dt = time.perf_counter() - t0
    cfg = store_config(model, choice, budget)
    if args.json:
        print(json.dumps({"config": cfg, "select_ms": dt * 1e3, "table": _table_rows(choice)}))
    else:
        _print_choice(choice, budget, dt)
    if args.plot:
        _plot(model, choice, budget, args.plot)
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
    print(
        f"budget {memory.format_bytes(budget)} → G={choice.G} Q={choice.Q} B={choice.B}: "
        f"predicted {choice.predicted_s * 1e3:.1f} ms per calibration request, "
        f"memory {memory.format_bytes(choice.memory_bytes)} (selected in {dt * 1e3:.2f} ms)"
    )
    rows = _table_rows(choice)
    if not rows:
        return
    # One line per candidate group size: its best feasible bank count B*(g).
    print(f"  {'g':>4s} {'B*(g)':>6s} {'B_max':>6s} {'predicted':>12s} {'memory':>12s}")
    for g in sorted({int(r["g"]) for r in rows}):
        mine = [r for r in rows if int(r["g"]) == g]
        feas = [r for r in mine if r["feasible"]]
        if not feas:
            print(f"  {g:>4d} {'-':>6s} {'-':>6s} {'infeasible':>12s} {'':>12s}")
            continue
        best = min(feas, key=lambda r: (r["predicted_s"], r["memory_bytes"]))
        mark = " *" if (g, int(best["b"])) == (choice.G, choice.B) else ""
        print(
            f"  {g:>4d} {int(best['b']):>6d} {max(int(r['b']) for r in feas):>6d} "
            f"{best['predicted_s'] * 1e3:>9.1f} ms {memory.format_bytes(best['memory_bytes']):>12s}{mark}"
        )


def _plot(model: Any, choice: Any, budget: int, out: str) -> None:
    try:
        import estream_sched as es

        es.plot_frontier(choice.table, out, chosen=choice, budget=budget)
        print(f"plot written to {out}")
    except ImportError as exc:
        raise BadRequestError(
            f"--plot needs matplotlib: pip install 'estream-sched[plot]' ({exc})"
        ) from None


def cmd_synth(args: argparse.Namespace) -> int:
    from estream_layout import cli as lcli

    return int(lcli.synth_main(args.rest) or 0)


def cmd_pack(args: argparse.Namespace) -> int:
    from estream_layout import cli as lcli

    return int(lcli.pack_main(args.rest) or 0)


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
    ids = _parse_ids(args.ids)
    bad = [i for i in ids if not 0 <= i < tok.n_vocab]
    if bad:
        raise BadRequestError(f"token id {bad[0]} is out of the vocabulary (0..{tok.n_vocab - 1})")
    text = tok.decode(ids, skip_special=args.skip_special)
    print(json.dumps({"text": text}) if args.json else text)
    return 0


def _add_engine_opts(p: argparse.ArgumentParser) -> None:
    from .engine import MODES
    from .experts import SCHEDULES

    p.add_argument(
        "--mode", choices=MODES, default="stream", help="expert placement (default stream)"
    )
    p.add_argument("--schedule", choices=SCHEDULES, default="early", help="when reads start")
    p.add_argument("--budget", help="memory budget, e.g. 1.5GiB (needs a stored profile)")
    p.add_argument("-G", type=int, help="group size (overrides the configuration)")
    p.add_argument("-Q", type=int, help="reads in flight")
    p.add_argument("-B", type=int, help="banks in the arena")
    p.add_argument("--threads", type=int, help="compute threads (default: all cores, ≤ 8)")
    p.add_argument("--verify", action="store_true", help="check each record's checksum as it loads")
    p.add_argument(
        "--act",
        choices=("q8", "f32"),
        default="q8",
        help="activations: q8 (int8 per 32-block, fast; default) or f32 (exact)",
    )
    p.add_argument(
        "--backend",
        choices=("host", "host-process"),
        default="host",
        help="where expert ops run: in this process (default) or in an executor process",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="estream",
        description="Streamed prefill-only MoE inference: experts stay in storage.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic GGUF MoE model (see estream-synth -h)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_synth)
    p = sub.add_parser("pack", help="pack a GGUF model into NAME.estream (see estream-pack -h)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("profile", help="calibrate: one request per candidate group size")
    p.add_argument("model")
    p.add_argument("--candidates", default="1,2,4,8,16", help="group sizes g to profile")
    p.add_argument("--queue-depths", default="1,2,4,8", help="queue depths q for BW(g, q)")
    p.add_argument("--tokens", type=int, default=256, help="calibration prompt length")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("config", help="choose (G, Q, B) for a memory budget from the profile")
    p.add_argument("model")
    p.add_argument("--budget", required=True, help="e.g. 1.5GiB")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="plot the latency–memory frontier")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("prefill", help="one forward pass; print next-token top-k and metrics")
    p.add_argument("model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tokens", help="comma-separated token ids")
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-file", help="file with the prompt text")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--all-logits", metavar="OUT.npy", help="save float32 logits [T, n_vocab]")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace-event timeline")
    _add_engine_opts(p)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("bench", help="TTFT / memory over prompt lengths and modes")
    p.add_argument("model")
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--modes", default="stream,resident")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--budget", help="memory budget for stream mode (needs a stored profile)")
    p.add_argument("--threads", type=int)
    p.add_argument("--repeat", type=int, default=1)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="the main job: synth → pack → profile → config → prefill")
    p.add_argument("--arch", default="olmoe")
    p.add_argument(
        "--preset", default="demo", help="demo (default: ≈ 230 MiB of experts), tiny, small, …"
    )
    p.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    p.add_argument("--tokens", type=int, default=256, help="prompt length")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("tokenize", help="text → token ids with the model's own tokenizer")
    p.add_argument("model", help="packed model, GGUF model or vocabulary-only GGUF")
    p.add_argument("text")
    p.add_argument("--add-special", action="store_true", help="add BOS/EOS as the model does")
    p.add_argument("--parse-special", action="store_true", help="match special tokens in text")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids → text")
    p.add_argument("model")
    p.add_argument("ids", help="comma-separated token ids")
    p.add_argument("--skip-special", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_detokenize)

    from .task_commands import add_task_commands

    add_task_commands(sub, _add_engine_opts)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EStreamError as exc:
        _err(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as exc:
        # Errors from the lower packages carry specific messages; no traceback for users.
        name = type(exc).__name__
        if os.environ.get("ESTREAM_DEBUG"):
            raise
        _err(f"{name}: {exc}")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
