"""Attention precision on the engine: all-position logit error against the float64 reference
(``integration/reference.py``) with fp32 attention products and with each of ``--products``
(default ``bf16,bf16-pv``: everything rounded to bfloat16, or only P·V), per architecture and
activation format, on synthetic models (``estream_layout.synth_model``), averaged over
``--prompts`` random prompts (a tiny model's routing flips on small perturbations, so one
prompt's ratio swings by ±10 %).

A bf16 mode may become the engine's default only if, on every architecture, its error stays
within 5 % of the fp32 path's (``ratio`` = its error / fp32's error <= 1.05) with the default
``q8`` activations; the ``f32`` activation rows show the attention error alone (the fp32 path
there is ~1e-7 off the reference). Prints a table and a verdict per mode; writes JSON.

Usage: ``python integration/bench/attention_precision.py [--archs olmoe,deepseek2]
[--preset tiny] [--tokens 256] [--prompts 4] [--products bf16,bf16-pv] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

ARCHS = "olmoe,qwen3moe,mixtral,deepseek2,lfm2moe"
LIMIT = 1.05  # a mode's error / fp32 error a default needs on every row


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(arch: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Per activation format, the errors of one architecture against its float64 reference
    with fp32 attention and with each of ``args.products``."""
    from reference import reference_forward

    import estream
    from estream_layout import pack_model, synth_model

    src, dst = work / f"{arch}.gguf", work / f"{arch}.estream"
    synth_model(arch, args.preset, src, seed=args.seed)
    pack_model(src, dst, progress=False)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 64, size=args.tokens) for _ in range(args.prompts)]
    refs = [reference_forward(src, tokens) for tokens in prompts]
    rows = []
    for act in ("q8", "f32"):
        err = {}
        for attention in ("f32", *args.products):
            errs = []
            with estream.load(dst, act=act, attention=attention, mode="resident") as eng:
                for tokens, ref in zip(prompts, refs, strict=True):
                    logits = eng.prefill(tokens, all_logits=True).logits
                    errs.append(rel_l2(np.asarray(logits, np.float64), ref))
            err[attention] = float(np.mean(errs))
        ratio = {p: err[p] / err["f32"] for p in args.products}
        rows.append({"arch": arch, "act": act, "err": err, "ratio": ratio})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=ARCHS)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=256, help="prompt length T")
    ap.add_argument("--prompts", type=int, default=4, help="random prompts averaged over")
    ap.add_argument(
        "--products", default="bf16,bf16-pv", help="attention products compared with f32"
    )
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "attention_precision.json"))
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.prompts < 1:
        ap.error(f"--tokens and --prompts must be >= 1, got {args.tokens}, {args.prompts}")
    from estream.engine import ATTENTION

    args.products = [p.strip() for p in args.products.split(",") if p.strip()]
    bad = [p for p in args.products if p in ("f32", "auto") or p not in ATTENTION]
    if bad or not args.products:
        ap.error(f"--products: {','.join(bad) or 'empty'} (choose from bf16, bf16-pv)")
    rows: list[dict[str, Any]] = []
    names = ["f32", *args.products]
    print(f"{'arch':10s} {'act':4s} " + " ".join(f"{n + ' err':>13s}" for n in names)
          + " " + " ".join(f"{n + ' ratio':>14s}" for n in args.products))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="attention-precision-") as tmp:
        for arch in args.archs.split(","):
            for r in measure(arch, args, Path(tmp)):
                rows.append(r)
                print(f"{r['arch']:10s} {r['act']:4s} "
                      + " ".join(f"{r['err'][n]:13.3e}" for n in names) + " "
                      + " ".join(f"{r['ratio'][n]:14.3f}" for n in args.products),
                      flush=True)  # fmt: skip
    default_ok = {}
    for p in args.products:
        over = [f"{r['arch']} ({r['ratio'][p]:.3f})" for r in rows
                if r["act"] == "q8" and r["ratio"][p] > LIMIT]  # fmt: skip
        default_ok[p] = not over
        verdict = "may be the default" if not over else "stays opt-in: " + ", ".join(over)
        print(f"{p}: q8 rows within {LIMIT:.2f}x of the fp32 path's error: {verdict}")
    doc = {"preset": args.preset, "tokens": args.tokens, "prompts": args.prompts,
           "seed": args.seed, "limit": LIMIT, "products": args.products,
           "rows": rows, "default_ok": default_ok}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(doc, indent=2))
    tmp_out.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
