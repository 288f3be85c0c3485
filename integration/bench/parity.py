"""Parity: llama.cpp vs the float64 reference (vs the engine) on synthetic GGUF MoE models.

For each architecture, a synthetic model (``estream_layout.synth_model``, ``small`` preset) is
evaluated on the same random token ids by

* the float64 numpy reference (``integration/reference.py``, reading the original GGUF),
* llama.cpp through llama-cpp-python (built once, wheel cached in ``.cache/wheels``),
* the EStream engine (``estream.load(packed).prefill(tokens, all_logits=True)``), when it
  is installed and the model packs,

and all-position logits are compared pairwise: relative L2 error ``|a-b|/|b|`` and top-1
agreement, on ``--prompts`` prompts of random ids (8 by default; the same prompts for every
engine): the error is the geometric mean over prompts, top-1 agreement is over all their
positions, and ``engine_minus_llamacpp`` gives the engine's top-1 agreement minus llama.cpp's and
the ratio of their errors, each with a 95% bootstrap interval over prompts (a near-tie flips on
rounding alone, so one prompt's few flips are not a difference between the engines). Two weight variants: ``q4_0``, the synthetic model as llama.cpp runs it by default
(F16 KV cache; its CPU Q4_0 matmuls quantize activations to Q8_0, so ~1e-2 differences are
llama.cpp's own rounding), and ``f32``, the same model with every tensor dequantized to F32 and
an F32 KV cache, on which llama.cpp computes in float32 — that run isolates the *conventions*
(RoPE style, norms, routing, MLA) and should agree with the reference to ~1e-6.

More variants are made with llama.cpp's own quantizer (``llama_model_quantize``, the function
behind ``llama-quantize``): ``lq4_0``, ``lq4_k_m``, ``lq5_k_m``, ``lq6_k`` and ``lq8_0``. Their
source, variant ``lf32``, is an F32 model with continuous Gaussian weights (expert width 256 so
that every expert matrix can take Q4_K): for deepseek2, lfm2moe, gpt-oss and smallthinker (with
the published window/NoPE layer layout) a synthetic Hugging Face
checkpoint converted by llama.cpp's own ``convert_hf_to_gguf.py`` (``hf_checkpoint.py``; torch
is installed for it into ``.cache/llama-convert``), for the other architectures estream-synth
writing the tensor names and metadata that converter writes (``--lq-source`` chooses). It is
quantized by llama.cpp to Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 (and MXFP4_MOE: MXFP4 experts,
the rest Q8_0) with its default per-tensor
choices (for Q4_K_M: Q6_K output and some ffn_down/attn_v, Q5_0/Q8_0 fallbacks where a row is
not a multiple of 256). For gpt-oss, ``lmxfp4`` is the form it is published in: the
checkpoint itself carries MXFP4 expert blocks and scales (``quantization_config`` mxfp4), which
llama.cpp's converter writes to the GGUF as MXFP4 unchanged, the other tensors F32; its float
weights are the F32 source's, so it has the same original. Every engine and llama.cpp result
there is compared with the reference
of the quantized file *and* with the reference of the F32 original (``*_vs_src``), next to the
quantized model's own distance from the original (``ref_vs_src``). The packer keeps Q4_0, Q8_0, Q4_K and Q6_K tensors as they are;
it is run with ``requantize="q4_0"``, so experts of other types (Q5_0, Q5_K) are re-quantized to
Q4_0 and other dense matrices to Q8_0, with a loud warning; those rows list what it
re-quantized, and ``engine_vs_packed_ref`` compares the engine with the reference of the file as
the packer stores it (``packed_copy``), which separates the engine's own error from the
re-quantization's.

The engine's q8 rows run once per ``--engine-attention`` precision (``f32,bf16,bf16-pv`` by
default: attention products in float32; q·scale, K, V and the softmax weights rounded to
bfloat16 with float32 sums; and fp32 scores with only V and the softmax weights rounded); each
such row carries ``engine_attention`` and, for the bf16 modes, ``engine_vs_ref`` beside the
fp32-attention row's, which is how the report shows their cost in accuracy. The f32-activation rows always run fp32 attention (that path keeps to the float64
reference to ~1e-5).

Usage: ``nox -s parity [-- --archs olmoe,qwen3moe,mixtral --preset small --tokens 256
--variants q4_0,f32,lf32,lq4_0,lq4_k_m,lq5_k_m,lq6_k,lq8_0]``; gpt-oss and smallthinker are not
in the default ``--archs`` (``--archs gpt-oss,smallthinker --variants
lf32,lmxfp4,lmxfp4_moe,lq4_k_m,lq8_0``).
Writes ``bench-results/parity.json``. If llama.cpp refuses a synthetic GGUF, its exact message
is printed, stored in the JSON and appended to ``bench-results/synth-issues.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
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

from hf_checkpoint import HF_ARCH, ConverterError, convert, write_checkpoint  # noqa: E402
from llamacpp import (  # noqa: E402
    LlamaCppError,
    ensure_llama_cpp,
    llama_cpp_version,
    llama_logits,
    llama_quantize,
)
from reference import ReferenceModel  # noqa: E402

NOTES = ROOT / "bench-results" / "synth-issues.md"
TARGET_REL_L2 = 1e-2
TARGET_TOP1 = 0.99
# variants quantized by llama.cpp itself from an F32 synthetic source -> llama.cpp's ftype
LLAMA_QUANT = {
    "lq4_0": "Q4_0",
    "lq4_k_m": "Q4_K_M",
    "lq5_k_m": "Q5_K_M",
    "lq6_k": "Q6_K",
    "lq8_0": "Q8_0",
    "lmxfp4_moe": "MXFP4_MOE",
}
# variants whose quantized experts come in the Hugging Face checkpoint itself (gpt-oss's
# published MXFP4 form), converted by llama.cpp's converter
HF_QUANT = {"lmxfp4": "checkpoint with MXFP4 experts -> llama.cpp converter (MXFP4 kept)"}
QUANTIZED = {*LLAMA_QUANT, *HF_QUANT}
# the F32 source of those: expert rows of 256 (a Q4_K super-block), otherwise the preset
LLAMA_QUANT_DIMS = {"n_ff_exp": 256}
# per architecture, on top: SmallThinker's published layer layout (a window on three layers of
# four, NoPE on the fourth) over five layers, so that NoPE layers 0 and 4 are part of the
# comparison (with exactly four layers llama.cpp takes RoPE on every layer)
HF_SOURCE_DIMS: dict[str, dict[str, Any]] = {
    "smallthinker": {"sliding_window": 4096, "n_layers": 5}
}


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


def aggregate(per_prompt: list[dict[str, float]]) -> dict[str, Any]:
    """`compare` results of the same row on several prompts (of equal length) as one: the
    relative L2 error as the geometric mean over prompts (0 when one is 0), top-1 agreement over all positions,
    the per-prompt figures kept beside them (``rel_l2_prompts``, ``top1_prompts``)."""
    rel = np.array([c["rel_l2"] for c in per_prompt])
    n_dec = sum(c["n_decisive"] for c in per_prompt)
    return {
        "rel_l2": float(np.exp(np.mean(np.log(rel)))) if rel.min() > 0 else 0.0,
        "rel_l2_max_pos": max(c["rel_l2_max_pos"] for c in per_prompt),
        "top1": float(np.mean([c["top1"] for c in per_prompt])),
        "max_abs": max(c["max_abs"] for c in per_prompt),
        "n_decisive": n_dec,
        "top1_decisive": (
            sum(c["top1_decisive"] * c["n_decisive"] for c in per_prompt if c["n_decisive"]) / n_dec
            if n_dec
            else float("nan")
        ),
        "top1_margin_median": float(np.median([c["top1_margin_median"] for c in per_prompt])),
        "n_prompts": len(per_prompt),
        "rel_l2_prompts": [float(x) for x in rel],
        "top1_prompts": [float(c["top1"]) for c in per_prompt],
    }


def paired(
    engine: list[dict[str, float]], llama: list[dict[str, float]], *, draws: int = 10000
) -> dict[str, Any]:
    """The engine against llama.cpp on the same prompts (per-prompt `compare` results of both
    against the same reference): the top-1 agreement difference (engine minus llama.cpp) and the
    ratio of geometric-mean errors, each with a 95% percentile bootstrap interval over prompts
    (the prompts are resampled, a prompt's positions stay together)."""
    d_top1 = np.array([e["top1"] - ll["top1"] for e, ll in zip(engine, llama, strict=True)])
    d_log = np.array(
        [np.log(e["rel_l2"]) - np.log(ll["rel_l2"]) for e, ll in zip(engine, llama, strict=True)]
    )
    pick = np.random.default_rng(0).integers(0, len(d_top1), size=(draws, len(d_top1)))
    top1_lo, top1_hi = np.percentile(d_top1[pick].mean(axis=1), [2.5, 97.5])
    log_lo, log_hi = np.percentile(d_log[pick].mean(axis=1), [2.5, 97.5])
    return {
        "n_prompts": len(d_top1),
        "top1_diff": float(d_top1.mean()),
        "top1_diff_ci95": [float(top1_lo), float(top1_hi)],
        "rel_l2_ratio": float(np.exp(d_log.mean())),
        "rel_l2_ratio_ci95": [float(np.exp(log_lo)), float(np.exp(log_hi))],
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


def _hf_dims(arch: str, preset: str) -> Any:
    """The shapes of `arch`'s synthetic Hugging Face checkpoint (`f32_source`, `hf_quant`)."""
    import attrs

    from estream_layout import synth_dims

    extra = {**LLAMA_QUANT_DIMS, **HF_SOURCE_DIMS.get(arch, {})}
    return attrs.evolve(synth_dims(arch, preset), **extra)


def hf_quant(arch: str, preset: str, dst: Path, seed: int, work: Path) -> str:
    """`HF_QUANT`'s ``lmxfp4``: the F32 source's checkpoint with its experts in MXFP4 (as the
    published gpt-oss checkpoints), through llama.cpp's converter; returns how it was made."""
    hf = write_checkpoint(arch, _hf_dims(arch, preset), work / f"hf-{arch}-{preset}-mxfp4",
                          seed=seed, mxfp4=True)  # fmt: skip
    convert(hf, dst, "f32")
    return f"synthetic HF checkpoint ({HF_ARCH[arch]}), {HF_QUANT['lmxfp4']}"


def f32_source(arch: str, preset: str, dst: Path, seed: int, how: str, work: Path) -> str:
    """The F32 model the llama.cpp-quantized variants start from; returns how it was made.

    ``convert`` (``auto`` for the `HF_ARCH` ones): a synthetic Hugging Face checkpoint of the
    preset's shapes through llama.cpp's ``convert_hf_to_gguf.py``; ``synth`` (``auto`` for the
    others): estream-synth writing the converter's tensor names and metadata itself."""
    from estream_layout import synth_model

    if how == "auto":
        how = "convert" if arch in HF_ARCH else "synth"
    if how == "convert":
        hf = write_checkpoint(arch, _hf_dims(arch, preset), work / f"hf-{arch}-{preset}", seed=seed)
        convert(hf, dst, "f32")
        return f"synthetic HF checkpoint ({HF_ARCH[arch]}) -> llama.cpp converter F32"
    synth_model(arch, preset, dst, seed=seed, expert_type="F32", dense_type="F32",
                output_type="F32", **LLAMA_QUANT_DIMS)  # fmt: skip
    return "estream-synth F32 (the converter's tensor names and metadata)"


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


def tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """GGML type -> number of tensors, for the expert tensors and for the others."""
    from gguf import GGUFReader

    out: dict[str, dict[str, int]] = {"experts": {}, "other": {}}
    for t in GGUFReader(str(path)).tensors:
        group = out["experts" if "_exps." in t.name else "other"]
        group[t.tensor_type.name] = group.get(t.tensor_type.name, 0) + 1
    return out


def packed_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor the packer re-quantizes replaced by that re-quantization, with
    the packer's own rules (`EXPERT_TILE_FORMATS`, `dense_format`) and gguf-py's ggml reference
    quantizers: experts of a type without a tile format -> Q4_0 (``requantize="q4_0"``); other
    matrices the packer stores as Q8_0 tiles although they are not Q8_0 (quantized types without
    a tile format, e.g. Q2_K, Q3_K; F32, F16 and BF16 matrices are kept) -> Q8_0. Every other tensor is kept as it is. Its reference is what
    the engine computes on exactly, so engine (f32 activations) against it separates the
    engine's own error from the re-quantization's."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from estream_layout import ModelSpec
    from estream_layout.pack import EXPERT_TILE_FORMATS, dense_format

    spec = ModelSpec.from_gguf(src)

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or not field.types:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order
        qt = t.tensor_type
        target = None
        if t.name.endswith("_exps.weight"):
            if Q(qt).name not in EXPERT_TILE_FORMATS:
                target = Q.Q4_0
        elif (
            t.name in spec.tensors
            and qt != Q.Q8_0
            and dense_format(spec.tensors[t.name]) == "q8_0-t32r4"
        ):
            target = Q.Q8_0
        if target is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape,
                              raw_dtype=qt)  # fmt: skip
            continue
        values = dequantize(np.asarray(t.data), qt).astype(np.float32).reshape(shape)
        blocks = quantize(values, target)
        writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def requantized(packed: Path) -> list[str]:
    """The source tensors the packer re-quantized (from the pack's manifest)."""
    doc = json.loads((packed / "manifest.json").read_text())
    return list(doc.get("source", {}).get("requantized_tensors", []))


def engine_logits(
    gguf: Path,
    work: Path,
    tokens: list[int],
    mode: str = "stream",
    act: str = "",
    attention: str = "f32",
) -> tuple[np.ndarray | None, str]:
    """The engine's all-position logits, or ``(None, reason)`` when it is not available;
    `attention` is passed to ``estream.load`` as it is (the run says which precision it ran)."""
    try:
        import estream
    except ImportError as exc:
        return None, f"estream not importable ({exc})"
    packed = work / (gguf.stem + ".estream")
    try:
        from estream_layout import pack_model

        if not packed.exists():
            # types without a kernel (a Q4_K_M file's Q5_0 fallbacks) are re-quantized, and
            # the row reports them (engine_requantized)
            pack_model(gguf, packed, progress=False, requantize="q4_0")
    except Exception as exc:
        return None, f"packing failed: {type(exc).__name__}: {exc}"
    try:
        kw = {"act": act} if act else {}
        engine = estream.load(packed, mode=mode, attention=attention, **kw)
        try:
            result = engine.prefill(tokens, all_logits=True)
        finally:
            engine.close()
    except Exception as exc:
        return None, f"engine failed: {type(exc).__name__}: {exc}"
    return np.asarray(result.logits, dtype=np.float64), ""


ATTENTIONS = ("f32", "bf16", "bf16-pv")


def engine_runs(acts: str, attentions: str) -> list[tuple[str, str]]:
    """The engine runs of a row, (activation format, attention precision) pairs: every q8 act
    once per attention precision, every other act (f32) with f32 attention."""
    att = [a.strip() for a in attentions.split(",") if a.strip()]
    bad = [a for a in att if a not in ATTENTIONS]
    if bad or not att:
        raise ValueError(
            f"--engine-attention: {','.join(bad) or 'empty'} (choose from {', '.join(ATTENTIONS)})"
        )
    runs: list[tuple[str, str]] = []
    for act in [a.strip() for a in acts.split(",") if a.strip()] or [""]:
        for a in att if act in ("q8", "") else ["f32"]:
            if (act, a) not in runs:
                runs.append((act, a))
    return runs


def run_label(act: str, attention: str) -> str:
    """A run's label in the printed table: q8, q8+bf16a, q8+bf16pva, f32."""
    return act + {"bf16": "+bf16a", "bf16-pv": "+bf16pva"}.get(attention, "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="olmoe,qwen3moe,mixtral,deepseek2,lfm2moe")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=256, help="prompt length T")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="random prompts per row (seeds seed..seed+N-1); errors are geometric means over "
        "them, engine minus llama.cpp with a bootstrap interval over prompts",
    )
    ap.add_argument(
        "--variants",
        default="q4_0,f32,lf32,lq4_0,lq4_k_m,lq5_k_m,lq6_k,lq8_0",
        help="q4_0: the synthetic model; f32: it dequantized; yarn: f32 with YaRN RoPE; "
        "lf32: an F32 model made with llama.cpp's converter (see --lq-source); "
        "lq4_0 / lq4_k_m / lq5_k_m / lq6_k / lq8_0 / lmxfp4_moe: it quantized by llama.cpp to "
        "Q4_0 / Q4_K_M / Q5_K_M / Q6_K / Q8_0 / MXFP4_MOE; lmxfp4 (gpt-oss): its checkpoint "
        "with MXFP4 experts through llama.cpp's converter",
    )
    ap.add_argument(
        "--lq-source",
        choices=("auto", "convert", "synth"),
        default="auto",
        help="the F32 model behind lf32/lq4_0/lq4_k_m: llama.cpp's converter on a synthetic HF "
        "checkpoint (auto: deepseek2, lfm2moe, gpt-oss, smallthinker) or estream-synth's F32 "
        "GGUF (auto: the others)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--engine-mode", default="stream", help="stream | resident | naive | layer")
    ap.add_argument(
        "--engine-acts", default="q8,f32", help="engine activation formats to run (act=...)"
    )
    ap.add_argument(
        "--engine-attention",
        default="f32,bf16,bf16-pv",
        help="attention precisions the q8 rows run (attention=...; f32 activations always run "
        "f32 attention)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "parity.json"))
    ap.add_argument(
        "--keep-work",
        action="store_true",
        help="keep the work directory (GGUFs, packs, references); removed by default",
    )
    args = ap.parse_args(argv)
    try:
        engine_runs(args.engine_acts, args.engine_attention)
    except ValueError as exc:
        ap.error(str(exc))

    ensure_llama_cpp()
    version = llama_cpp_version()
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    work = Path(tempfile.mkdtemp(prefix="parity-"))
    try:
        return _run(args, version, archs, variants, work)
    finally:
        if args.keep_work:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(
    args: argparse.Namespace, version: str, archs: list[str], variants: list[str], work: Path
) -> int:
    """Every (architecture, variant) row of the table, its files made in `work`."""
    from estream_layout import synth_model

    rows: list[dict[str, Any]] = []
    print(f"llama-cpp-python {version}; preset {args.preset}; T={args.tokens}; work dir {work}")

    sources: dict[str, str] = {}  # arch -> how its F32 source was made
    for arch in archs:
        for variant in variants:
            row: dict[str, Any] = {"arch": arch, "preset": args.preset, "variant": variant}
            rows.append(row)
            base = work / f"{arch}-{args.preset}.gguf"
            gguf = base if variant == "q4_0" else work / f"{arch}-{args.preset}-{variant}.gguf"
            src32 = work / f"{arch}-{args.preset}-f32src.gguf"
            try:
                if variant in QUANTIZED or variant == "lf32":
                    if not src32.exists():
                        how = f32_source(arch, args.preset, src32, args.seed, args.lq_source, work)
                        sources[arch] = how
                        print(f"{arch}: F32 source: {how}", flush=True)
                    row["source"] = sources[arch]
                if variant == "lf32":
                    gguf = src32
                elif variant in LLAMA_QUANT:
                    t0 = time.perf_counter()
                    llama_quantize(src32, gguf, LLAMA_QUANT[variant], n_threads=args.threads)
                    row["t_quantize_s"] = time.perf_counter() - t0
                    row["source"] += f" -> llama.cpp quantizer {LLAMA_QUANT[variant]}"
                    row["tensor_types"] = tensor_types(gguf)
                    print(f"{arch}/{variant}: llama.cpp wrote {row['tensor_types']}", flush=True)
                elif variant in HF_QUANT:
                    row["source"] = hf_quant(arch, args.preset, gguf, args.seed, work)
                    row["tensor_types"] = tensor_types(gguf)
                    print(
                        f"{arch}/{variant}: the converter wrote {row['tensor_types']}", flush=True
                    )
                elif not base.exists():
                    synth_model(arch, args.preset, base, seed=args.seed)
                if variant == "f32":
                    f32_copy(base, gguf)
                elif variant == "yarn":
                    f32_copy(base, gguf, yarn_overrides(arch))
            except (LlamaCppError, ConverterError) as exc:
                row["error"] = f"llama.cpp's {type(exc).__name__[:-5].lower()} failed: {exc}"
                print(f"{arch}/{variant}: {row['error']}")
                note_issue(arch, args.preset, variant, str(exc))
                continue
            except Exception as exc:
                row["error"] = f"synth failed: {type(exc).__name__}: {exc}"
                print(f"{arch}/{variant}: {row['error']}")
                continue
            t_ref = t_lcpp = 0.0
            t_eng: dict[tuple[str, str], float] = {}
            per: dict[str, list[dict[str, float]]] = {}  # comparison key -> one per prompt
            acts = engine_runs(args.engine_acts, args.engine_attention)  # (act, attention)
            run_engine = (variant == "q4_0" or variant in QUANTIZED) and not args.no_engine
            eng_per: dict[tuple[str, str], dict[str, list[dict[str, float]]]] = {
                a: {} for a in acts
            }
            eng_note: dict[tuple[str, str], str] = {}
            lcpp_error = ""
            try:
                model = ReferenceModel(gguf)
            except Exception as exc:
                row["error"] = f"reference failed: {type(exc).__name__}: {exc}"
                traceback.print_exc()
                continue
            for p in range(args.prompts):  # prompt p: random ids from seed + p (p 0: --seed's)
                rng = np.random.default_rng(args.seed + p)
                tokens = rng.integers(0, model.config.n_vocab, size=args.tokens).tolist()
                t0 = time.perf_counter()
                try:
                    ref = model.forward(tokens)
                    yard = None
                    if variant in QUANTIZED or variant == "lf32":
                        # the F32 source's reference on this prompt, kept on disk for the
                        # architecture's other variants
                        src_file = work / f"{arch}-{args.preset}-srcref-{p}.npy"
                        if variant == "lf32":
                            np.save(src_file, ref)
                        elif not src_file.exists():
                            np.save(src_file, ReferenceModel(src32).forward(tokens))
                        if variant in QUANTIZED:
                            yard = np.load(src_file, mmap_mode="r")
                except Exception as exc:
                    row["error"] = f"reference failed: {type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    break
                t_ref += time.perf_counter() - t0
                row["n_vocab"] = int(ref.shape[1])
                if yard is not None:
                    per.setdefault("ref_vs_src", []).append(compare(ref, yard))
                packed_ref = None
                if variant in QUANTIZED and not args.no_engine and "packed_ref_error" not in row:
                    try:
                        pgguf = work / f"{gguf.stem}-as-packed.gguf"
                        if not pgguf.exists():
                            packed_copy(gguf, pgguf)
                        packed_ref = ReferenceModel(pgguf).forward(tokens)
                        per.setdefault("packed_ref_vs_ref", []).append(compare(packed_ref, ref))
                    except Exception as exc:
                        row["packed_ref_error"] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
                lcpp = None
                if not lcpp_error:
                    t0 = time.perf_counter()
                    try:
                        lcpp = llama_logits(gguf, tokens, n_threads=args.threads,
                                            kv_f32=variant in ("f32", "yarn", "lf32"))  # fmt: skip
                        t_lcpp += time.perf_counter() - t0
                        per.setdefault("llamacpp_vs_ref", []).append(compare(lcpp, ref))
                        if yard is not None:
                            per.setdefault("llamacpp_vs_src", []).append(compare(lcpp, yard))
                    except LlamaCppError as exc:
                        lcpp_error = str(exc)
                        print(f"\n{arch}/{variant}: llama.cpp refused the model:\n{exc}\n")
                        note_issue(arch, args.preset, variant, str(exc))
                for act in acts if run_engine else []:
                    if act in eng_note:
                        continue
                    t0 = time.perf_counter()
                    eng, why = engine_logits(gguf, work, tokens, args.engine_mode, *act)
                    if eng is None:
                        eng_note[act] = why
                        print(
                            f"{arch}/{variant}: engine ({run_label(*act)}) skipped: {why}",
                            flush=True,
                        )
                        continue
                    t_eng[act] = t_eng.get(act, 0.0) + time.perf_counter() - t0
                    e = eng_per[act]
                    e.setdefault("engine_vs_ref", []).append(compare(eng, ref))
                    if yard is not None:
                        e.setdefault("engine_vs_src", []).append(compare(eng, yard))
                    if packed_ref is not None:
                        e.setdefault("engine_vs_packed_ref", []).append(compare(eng, packed_ref))
                    if lcpp is not None:
                        e.setdefault("engine_vs_llamacpp", []).append(compare(eng, lcpp))
                del ref, yard, packed_ref, lcpp
            if "error" in row:
                continue
            row["t_reference_s"] = t_ref
            row["t_llamacpp_s"] = t_lcpp
            if lcpp_error:
                row["llamacpp_error"] = lcpp_error
            for key, cmps in per.items():
                row[key] = aggregate(cmps)
            if "llamacpp_vs_ref" in row:
                c = row["llamacpp_vs_ref"]
                print(
                    f"{arch}/{variant}: llama.cpp vs reference rel L2 {c['rel_l2']:.2e}, "
                    f"top-1 {c['top1']:.3f} ({args.prompts} prompts)",
                    flush=True,
                )
            for n, act in enumerate(acts if run_engine else []):
                if n:  # one row per engine run (activation format, attention precision)
                    row = {k: v for k, v in row.items() if not k.startswith("engine")}
                    rows.append(row)
                row["engine_act"], row["engine_attention"] = act
                if act in eng_note:
                    row["engine_note"] = eng_note[act]
                    continue
                row["t_engine_s"] = t_eng[act]
                row["engine_requantized"] = requantized(work / (gguf.stem + ".estream"))
                for key, cmps in eng_per[act].items():
                    row[key] = aggregate(cmps)
                if "llamacpp_vs_ref" in per and not lcpp_error:
                    row["engine_minus_llamacpp"] = paired(
                        eng_per[act]["engine_vs_ref"], per["llamacpp_vs_ref"]
                    )
                c = row["engine_vs_ref"]
                print(
                    f"{arch}/{variant}: engine ({run_label(*act)}) vs reference rel L2 "
                    f"{c['rel_l2']:.2e}, top-1 {c['top1']:.3f}",
                    flush=True,
                )

        _write(args, version, rows)  # after every architecture: a cut run keeps its rows
    _print_table(rows)
    out = _write(args, version, rows)
    print(f"wrote {out}")
    return 0


def _write(args: argparse.Namespace, version: str, rows: list[dict[str, Any]]) -> Path:
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
        "prompts": args.prompts,
        "targets": {"rel_l2": TARGET_REL_L2, "top1": TARGET_TOP1},
        "rows": rows,
    }
    tmp = out.with_name(out.name + ".part")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
    return out


def _fmt(cmp: dict[str, float] | None) -> str:
    if not cmp:
        return f"{'-':>9} {'-':>7}"
    return f"{cmp['rel_l2']:9.2e} {cmp['top1']:7.3f}"


def _label(r: dict[str, Any]) -> str:
    return run_label(str(r.get("engine_act", "")), str(r.get("engine_attention", "f32")))


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
        label = r["variant"] + (f"/{_label(r)}" if r.get("engine_act") else "")
        print(
            f"{r['arch']:<9} {label:<10} | {_fmt(r.get('llamacpp_vs_ref'))} | "
            f"{_fmt(r.get('engine_vs_ref'))} | {_fmt(r.get('engine_vs_llamacpp'))} | "
            f"{r.get('t_reference_s', float('nan')):6.1f} {r.get('t_llamacpp_s', float('nan')):6.1f}"
        )
        if "llamacpp_error" in r:
            print(f"{'':<20} | llama.cpp error: {r['llamacpp_error'].splitlines()[0][:120]}")
        if "engine_note" in r:
            print(f"{'':<20} | engine: {r['engine_note'][:120]}")
    src_rows = [r for r in rows if "ref_vs_src" in r]
    if src_rows:
        print(
            "\nllama.cpp-quantized models against the reference of their F32 original (engine vs"
            " packed: against the reference of the file as the packer re-quantized it):"
        )
        print(
            f"{'arch':<9} {'weights':<14} | {'quantized ref':^17} | {'llama.cpp':^17} | "
            f"{'engine':^17} | {'engine vs packed':^17} | engine re-quantized"
        )
        for r in src_rows:
            label = r["variant"] + (f"/{_label(r)}" if r.get("engine_act") else "")
            req = r.get("engine_requantized")
            print(
                f"{r['arch']:<9} {label:<14} | {_fmt(r.get('ref_vs_src'))} | "
                f"{_fmt(r.get('llamacpp_vs_src'))} | {_fmt(r.get('engine_vs_src'))} | "
                f"{_fmt(r.get('engine_vs_packed_ref'))} | "
                f"{'-' if req is None else len(req)} tensors"
            )
    print(f"targets (engine vs reference): rel L2 <= {TARGET_REL_L2:g}, top-1 >= {TARGET_TOP1:.0%}")
    print(
        "weights/act: the engine's activation format (q8: int8 blocks, f32: float); +bf16a: "
        "bf16 attention products; +bf16pva: bf16 P·V only"
    )
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
                label = r["variant"] + (f"/{_label(r)}" if "engine" in key else "")
                print(
                    f"  {r['arch']:<9} {label:<10} {key:<16} {c['top1_decisive']:.3f} "
                    f"of {c['n_decisive']} positions"
                )


if __name__ == "__main__":
    raise SystemExit(main())
