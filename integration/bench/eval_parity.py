"""Accuracy parity: `estream eval perplexity` on a streamed model vs llama.cpp on the same GGUF.

For each architecture a synthetic Q4_0 model (``estream_layout.synth_model``, with the real
qwen2 vocabulary so that text tokenizes into words) is packed and evaluated twice on the same
text:

* EStream: ``evaluation.perplexity`` on the streamed engine (``mode=stream``, default q8
  activations) — exactly what ``estream eval perplexity`` prints;
* llama.cpp (llama-cpp-python, wheel cached in ``.cache/wheels``): the all-position logits of
  each of the same windows, one child process per window, scored here in float64 with
  llama-perplexity's rule written out (positions ``ctx/2 + 1 … ctx − 1`` of each window).

Reported per architecture: both perplexities with their ± (standard error of the mean NLL
through exp), bits per byte, the paired per-token NLL difference (mean and its standard error:
what rounding alone moves), and top-1 agreement over the scored positions. The text is the
first ``--chars`` characters of this repository's ``docs/design.md`` unless ``--text-file``.

Usage: ``python integration/bench/eval_parity.py [--archs olmoe,qwen3moe] [--preset small]
[--ctx 128]``; writes ``bench-results/eval-parity.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from llamacpp import ensure_llama_cpp, llama_cpp_version, llama_logits  # noqa: E402


def _logsoftmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def run_arch(arch: str, args: argparse.Namespace, text: str, work: Path) -> dict[str, Any]:
    import estream
    from estream import evaluation, tasks
    from estream.tokenizer import Tokenizer
    from estream.tokenizer.testing import find_vocab_dir
    from estream_layout import pack_model, synth_model

    src = work / f"{arch}.gguf"
    vocab = find_vocab_dir() / "ggml-vocab-qwen2.gguf"
    synth_model(arch, args.preset, src, seed=args.seed, vocab=vocab)
    dst = work / f"{arch}.estream"
    pack_model(src, dst, progress=False)
    tok = Tokenizer.from_gguf(dst)
    t0 = time.perf_counter()
    with estream.load(dst, mode="stream", n_threads=args.threads) as eng:
        res = evaluation.perplexity(eng, tok, text, ctx=args.ctx)
        ids = tasks.encode_context(tok, text)
        bos = tok.bos_id if tok.add_bos else None
        windows, _ = evaluation.perplexity_windows(ids, args.ctx, args.ctx, bos)
        es_nll, es_top = [], []
        for w in windows:  # the engine's own per-token figures, for the paired difference
            lp = _logsoftmax(eng.prefill(w, all_logits=True).logits)
            for j in range(args.ctx // 2 + 1, args.ctx):
                es_nll.append(-lp[j - 1, w[j]])
                es_top.append(int(lp[j - 1].argmax()))
    t_es = time.perf_counter() - t0
    t0 = time.perf_counter()
    ll_nll, ll_top = [], []
    for w in windows:
        lp = _logsoftmax(llama_logits(src, w, n_threads=args.threads))
        for j in range(args.ctx // 2 + 1, args.ctx):
            ll_nll.append(-lp[j - 1, w[j]])
            ll_top.append(int(lp[j - 1].argmax()))
    t_ll = time.perf_counter() - t0
    a, b = np.array(es_nll), np.array(ll_nll)
    assert len(a) == res.scored_tokens, (len(a), res.scored_tokens)
    m = b.mean()
    se = math.sqrt((np.mean(b * b) - m * m) / (len(b) - 1))
    d = a - b
    return {
        "arch": arch,
        "preset": args.preset,
        "ctx": args.ctx,
        "windows": len(windows),
        "scored_tokens": res.scored_tokens,
        "estream": {
            "perplexity": res.perplexity.value,
            "perplexity_stderr": res.perplexity.stderr,
            "bits_per_byte": res.bits_per_byte.value,
            "seconds": t_es,
        },
        "llama_cpp": {
            "perplexity": math.exp(m),
            "perplexity_stderr": math.exp(m) * se,
            "bits_per_byte": float(b.sum() / math.log(2) / res.scored_bytes),
            "seconds": t_ll,
        },
        "ppl_ratio": res.perplexity.value / math.exp(m),
        "nll_diff_mean": float(d.mean()),
        "nll_diff_stderr": float(d.std(ddof=1) / math.sqrt(len(d))),
        "nll_diff_max_abs": float(np.abs(d).max()),
        "top1_agreement": float(np.mean(np.array(es_top) == np.array(ll_top))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="olmoe,qwen3moe")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chars", type=int, default=4000, help="characters of the text used")
    ap.add_argument("--text-file", help="default: docs/design.md of this repository")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "eval-parity.json"))
    args = ap.parse_args(argv)
    ensure_llama_cpp()
    path = Path(args.text_file) if args.text_file else ROOT / "docs" / "design.md"
    text = path.read_text(encoding="utf-8")[: args.chars]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            r = run_arch(arch, args, text, Path(tmp))
            rows.append(r)
            e, ll = r["estream"], r["llama_cpp"]
            print(
                f"{arch:>9s} {args.preset}: estream PPL {e['perplexity']:.3f} ± "
                f"{e['perplexity_stderr']:.3f}, llama.cpp {ll['perplexity']:.3f} ± "
                f"{ll['perplexity_stderr']:.3f} (ratio {r['ppl_ratio']:.4f}); ΔNLL "
                f"{r['nll_diff_mean']:+.5f} ± {r['nll_diff_stderr']:.5f}, top-1 agree "
                f"{r['top1_agreement']:.3f}; {r['scored_tokens']} tokens, {r['windows']} windows",
                flush=True,
            )
    doc = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "llama_cpp_python": llama_cpp_version(),
        "text": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "chars": len(text),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
