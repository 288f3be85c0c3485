"""Parity: llama.cpp vs the float64 reference (vs the engine) on synthetic GGUF MoE models.

For each architecture, a synthetic model (``estream_layout.synth_model``, ``small`` preset) is
evaluated on the same random token ids by

* the float64 numpy reference (``integration/reference.py``, reading the original GGUF),
* llama.cpp through llama-cpp-python (built once, wheel cached in ``.cache/wheels``),
* the EStream engine (``estream.load(packed).prefill(tokens, all_logits=True)``), when it
  is installed and the model packs,

and all-position logits are compared pairwise: relative L2 error ``|a-b|/|b|`` and top-1
agreement. Two weight variants: ``q4_0``, the synthetic model as llama.cpp runs it by default
(F16 KV cache; its CPU Q4_0 matmuls quantize activations to Q8_0, so ~1e-2 differences are
llama.cpp's own rounding), and ``f32``, the same model with every tensor dequantized to F32 and
an F32 KV cache, on which llama.cpp computes in float32 — that run isolates the *conventions*
(RoPE style, norms, routing, MLA) and should agree with the reference to ~1e-6.

Usage: ``nox -s parity [-- --archs olmoe,qwen3moe,mixtral --preset small --tokens 256]``.
Writes ``bench-results/parity.json``. If llama.cpp refuses a synthetic GGUF, its exact message
is printed, stored in the JSON and appended to ``bench-results/synth-issues.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from llamacpp import LlamaCppError, ensure_llama_cpp, llama_cpp_version, llama_logits  # noqa: E402
from reference import ReferenceModel  # noqa: E402

NOTES = ROOT / "bench-results" / "synth-issues.md"
TARGET_REL_L2 = 1e-2
TARGET_TOP1 = 0.99


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """``a`` measured against ``b`` (the yardstick)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    per_pos = np.linalg.norm(a64 - b64, axis=1) / np.linalg.norm(b64, axis=1)
    agree = a64.argmax(axis=1) == b64.argmax(axis=1)
    # Diagnostic: a top-1 whose margin over the runner-up is below the size of the logit
    # error itself can flip on rounding alone; agreement on the other ("decisive") positions
    # tells a rounding-level difference from a real one.
    top2 = np.sort(b64, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    rms_err = np.sqrt(np.mean((a64 - b64) ** 2, axis=1))
    decisive = margin > 4.0 * rms_err
    return {
        "rel_l2": float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64)),
        "rel_l2_max_pos": float(per_pos.max()),
        "top1": float(np.mean(agree)),
        "max_abs": float(np.abs(a64 - b64).max()),
        "n_decisive": int(decisive.sum()),
        "top1_decisive": float(np.mean(agree[decisive])) if decisive.any() else float("nan"),
        "top1_margin_median": float(np.median(margin)),
    }


def note_issue(arch: str, preset: str, variant: str, message: str) -> None:
    try:
        NOTES.parent.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        with NOTES.open("a") as f:
            f.write(
                f"\n## {stamp} — llama.cpp ({llama_cpp_version()}) refuses synthetic "
                f"`{arch}` `{preset}` ({variant})\n\n```\n{message.strip()}\n```\n"
                f"(reported by integration/bench/parity.py)\n"
            )
    except OSError as exc:  # notes are a convenience; never fail the benchmark on them
        print(f"  (could not append to {NOTES}: {exc})")


def f32_copy(src: Path, dst: Path, overrides: dict[str, Any] | None = None) -> Path:
    """The same model with every tensor dequantized to F32 (metadata and tokenizer kept).

    ``overrides``: metadata to add or replace, ``{key: (value, GGUFValueType)}``.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or not field.types:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if key not in (overrides or {}):
            writer.add_key_value(key, field.contents(), vtype, sub)
    for key, (value, vtype) in (overrides or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        values = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape(tuple(int(n) for n in reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def yarn_overrides(arch: str) -> dict[str, Any]:
    """YaRN RoPE metadata as DeepSeek-V2-Lite's GGUF has it, with a short original context so
    that the prompt runs past it (factor 40; log multiplier 0.1 * mscale_all_dim 0.707)."""
    from gguf import GGUFValueType as V

    a = "llama" if arch == "mixtral" else arch
    out: dict[str, Any] = {
        f"{a}.rope.scaling.type": ("yarn", V.STRING),
        f"{a}.rope.scaling.factor": (40.0, V.FLOAT32),
        f"{a}.rope.scaling.original_context_length": (64, V.UINT32),
    }
    if a == "deepseek2":
        out[f"{a}.rope.scaling.yarn_log_multiplier"] = (0.0707, V.FLOAT32)
    return out


def engine_logits(
    gguf: Path, work: Path, tokens: list[int], mode: str = "stream", act: str = ""
) -> tuple[np.ndarray | None, str]:
    """The engine's all-position logits, or ``(None, reason)`` when it is not available."""
    try:
        import estream
    except ImportError as exc:
        return None, f"estream not importable ({exc})"
    packed = work / (gguf.stem + ".estream")
    try:
        from estream_layout import pack_model

        if not packed.exists():
            pack_model(gguf, packed, progress=False)
    except Exception as exc:
        return None, f"packing failed: {type(exc).__name__}: {exc}"
    try:
        engine = estream.load(packed, mode=mode, **({"act": act} if act else {}))
        try:
            result = engine.prefill(tokens, all_logits=True)
        finally:
            engine.close()
    except Exception as exc:
        return None, f"engine failed: {type(exc).__name__}: {exc}"
    return np.asarray(result.logits, dtype=np.float64), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="olmoe,qwen3moe,mixtral,deepseek2,lfm2moe")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=256, help="prompt length T")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--variants",
        default="q4_0,f32",
        help="q4_0: the synthetic model; f32: it dequantized; yarn: f32 with YaRN RoPE",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--engine-mode", default="stream", help="stream | resident | naive | layer")
    ap.add_argument(
        "--engine-acts", default="q8,f32", help="engine activation formats to run (act=...)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "parity.json"))
    args = ap.parse_args(argv)

    from estream_layout import synth_model

    ensure_llama_cpp()
    version = llama_cpp_version()
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="parity-"))
    print(f"llama-cpp-python {version}; preset {args.preset}; T={args.tokens}; work dir {work}")

    for arch in archs:
        for variant in variants:
            row: dict[str, Any] = {"arch": arch, "preset": args.preset, "variant": variant}
            rows.append(row)
            base = work / f"{arch}-{args.preset}.gguf"
            gguf = base if variant == "q4_0" else work / f"{arch}-{args.preset}-{variant}.gguf"
            try:
                if not base.exists():
                    synth_model(arch, args.preset, base, seed=args.seed)
                if variant == "f32":
                    f32_copy(base, gguf)
                elif variant == "yarn":
                    f32_copy(base, gguf, yarn_overrides(arch))
            except Exception as exc:
                row["error"] = f"synth failed: {type(exc).__name__}: {exc}"
                print(f"{arch}/{variant}: {row['error']}")
                continue
            rng = np.random.default_rng(args.seed)
            t0 = time.perf_counter()
            try:
                model = ReferenceModel(gguf)
                tokens = rng.integers(0, model.config.n_vocab, size=args.tokens).tolist()
                ref = model.forward(tokens)
            except Exception as exc:
                row["error"] = f"reference failed: {type(exc).__name__}: {exc}"
                traceback.print_exc()
                continue
            row["t_reference_s"] = time.perf_counter() - t0
            row["n_vocab"] = int(ref.shape[1])
            t0 = time.perf_counter()
            try:
                lcpp = llama_logits(gguf, tokens, n_threads=args.threads, kv_f32=variant != "q4_0")
                row["t_llamacpp_s"] = time.perf_counter() - t0
                row["llamacpp_vs_ref"] = compare(lcpp, ref)
            except LlamaCppError as exc:
                lcpp = None
                row["llamacpp_error"] = str(exc)
                print(f"\n{arch}/{variant}: llama.cpp refused the model:\n{exc}\n")
                note_issue(arch, args.preset, variant, str(exc))
            if "llamacpp_vs_ref" in row:
                c = row["llamacpp_vs_ref"]
                print(
                    f"{arch}/{variant}: llama.cpp vs reference rel L2 {c['rel_l2']:.2e}, "
                    f"top-1 {c['top1']:.3f}",
                    flush=True,
                )
            if variant == "q4_0" and not args.no_engine:
                acts = [a.strip() for a in args.engine_acts.split(",") if a.strip()] or [""]
                for n, act in enumerate(acts):
                    if n:  # one row per engine activation format
                        row = {k: v for k, v in row.items() if not k.startswith("engine")}
                        rows.append(row)
                    row["engine_act"] = act
                    t0 = time.perf_counter()
                    eng, why = engine_logits(gguf, work, tokens, args.engine_mode, act)
                    if eng is None:
                        row["engine_note"] = why
                        print(f"{arch}/{variant}: engine ({act}) skipped: {why}", flush=True)
                        continue
                    row["t_engine_s"] = time.perf_counter() - t0
                    row["engine_vs_ref"] = compare(eng, ref)
                    if lcpp is not None:
                        row["engine_vs_llamacpp"] = compare(eng, lcpp)
                    c = row["engine_vs_ref"]
                    print(
                        f"{arch}/{variant}: engine ({act}) vs reference rel L2 "
                        f"{c['rel_l2']:.2e}, top-1 {c['top1']:.3f}",
                        flush=True,
                    )

    _print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "parity",
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "llama_cpp_python": version,
        "tokens": args.tokens,
        "engine_mode": args.engine_mode,
        "seed": args.seed,
        "targets": {"rel_l2": TARGET_REL_L2, "top1": TARGET_TOP1},
        "rows": rows,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _fmt(cmp: dict[str, float] | None) -> str:
    if not cmp:
        return f"{'-':>9} {'-':>7}"
    return f"{cmp['rel_l2']:9.2e} {cmp['top1']:7.3f}"


def _print_table(rows: list[dict[str, Any]]) -> None:
    print()
    head = (
        f"{'arch':<9} {'weights':<10} | {'llama.cpp vs ref':^17} | {'engine vs ref':^17} | "
        f"{'engine vs llama':^17} | {'t_ref':>6} {'t_lcpp':>6}"
    )
    print(head)
    print(
        f"{'':<20} | {'relL2':>9} {'top1':>7} | {'relL2':>9} {'top1':>7} | {'relL2':>9} {'top1':>7} |"
    )
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:<9} {r['variant']:<10} | {r['error']}")
            continue
        label = r["variant"] + (f"/{r['engine_act']}" if r.get("engine_act") else "")
        print(
            f"{r['arch']:<9} {label:<10} | {_fmt(r.get('llamacpp_vs_ref'))} | "
            f"{_fmt(r.get('engine_vs_ref'))} | {_fmt(r.get('engine_vs_llamacpp'))} | "
            f"{r.get('t_reference_s', float('nan')):6.1f} {r.get('t_llamacpp_s', float('nan')):6.1f}"
        )
        if "llamacpp_error" in r:
            print(f"{'':<20} | llama.cpp error: {r['llamacpp_error'].splitlines()[0][:120]}")
        if "engine_note" in r:
            print(f"{'':<20} | engine: {r['engine_note'][:120]}")
    print(f"targets (engine vs reference): rel L2 <= {TARGET_REL_L2:g}, top-1 >= {TARGET_TOP1:.0%}")
    print("weights/act: the engine's activation format (q8: int8 blocks, f32: float)")
    print("top-1 on decisive positions (reference margin > 4x the RMS logit error):")
    seen: set[tuple[str, str]] = set()
    for r in rows:
        for key in ("llamacpp_vs_ref", "engine_vs_ref"):
            c = r.get(key)
            if key == "llamacpp_vs_ref":
                if (r["arch"], r["variant"]) in seen:
                    continue
                seen.add((r["arch"], r["variant"]))
            if c:
                label = r["variant"] + (f"/{r['engine_act']}" if "engine" in key else "")
                print(
                    f"  {r['arch']:<9} {label:<10} {key:<16} {c['top1_decisive']:.3f} "
                    f"of {c['n_decisive']} positions"
                )


if __name__ == "__main__":
    raise SystemExit(main())
