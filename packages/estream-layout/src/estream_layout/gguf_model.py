"""Read GGUF MoE models: architecture detection, a typed `ModelSpec`, and raw tensor access.

Keys and tensor names are llama.cpp's (taken from `gguf.Keys` / `gguf.TENSOR_NAMES`, which are
generated from the same tables as llama.cpp's `llama-arch.cpp`). Shapes here are in numpy
(row-major) order: a GGUF tensor with `ne = [ne0, ne1, ne2]` has `shape = (ne2, ne1, ne0)`, so a
2-D weight is `[rows (outputs), cols (reduction)]` and an expert stack is `[E, rows, cols]`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
from gguf import GGMLQuantizationType, Keys
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from .errors import (
    DenseModelError,
    InvalidGGUFError,
    InvalidMetadataError,
    NotGGUFError,
    PackFormatError,
    TruncatedGGUFError,
    UnalignedReductionError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from .families import BY_ARCH, BY_FAMILY, GATING_FUNCS, RECORDS, Family, Want
from .gguf_header import GGUFHeader, read_header
from .limits import (
    MAX_CONTEXT,
    MAX_CONV_CACHE,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_INT,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    MIN_CONTEXT,
)

__all__ = [
    "EXPERT_PROJECTIONS",
    "FAMILIES",
    "QK_NORM",
    "ModelSpec",
    "TensorInfo",
    "TensorReader",
    "dense_tensor_problems",
    "dequantize_tensor",
    "expert_tensor_name",
    "parse_expert_tensor_name",
    "tensor_memmap",
]

GGUF_MAGIC: Final = b"GGUF"
EXPERT_PROJECTIONS: Final = ("gate", "up", "down")

# The architecture facts are the family records' (`estream_layout.families`); these two views
# of them are public API.
# general.architecture -> model family (the unit the engine builds graphs for).
# `llama` is accepted only with experts ({arch}.expert_count > 0): that is Mixtral's GGUF form.
FAMILIES: Final = {f.gguf_arch: f.name for f in RECORDS}
# Where llama.cpp normalises q and k before RoPE, per family: "full" = one RMSNorm over the whole
# projected q/k, "head" = per head, "none" = no q/k norm.
QK_NORM: Final = {f.name: f.qk_norm for f in RECORDS}
_GATING_FUNCS: Final = GATING_FUNCS


# RoPE scaling types llama.cpp knows (llama_rope_scaling_type); the engine computes none,
# linear and yarn and refuses the others by name.
ROPE_SCALING_TYPES: Final = ("none", "linear", "yarn", "longrope")
# YaRN keys, spelled out: older gguf-py releases lack some of these constants.
_ROPE_ORIG_CTX: Final = "{arch}.rope.scaling.original_context_length"
_ROPE_ATTN_FACTOR: Final = "{arch}.rope.scaling.attn_factor"
_ROPE_YARN_LOG_MUL: Final = "{arch}.rope.scaling.yarn_log_multiplier"

_EXPERT_RE: Final = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_LEGACY_EXPERT_RE: Final = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def expert_tensor_name(layer: int, projection: str) -> str:
    """GGUF name of a layer's stacked expert tensor, e.g. `blk.3.ffn_gate_exps.weight`."""
    if projection not in EXPERT_PROJECTIONS:
        raise ValueError(f"projection must be one of {EXPERT_PROJECTIONS}, got {projection!r}")
    return f"blk.{layer}.ffn_{projection}_exps.weight"


def _layer_index(name: str) -> int | None:
    """`blk.3.attn_q.weight` -> 3; None for a tensor outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def parse_expert_tensor_name(name: str) -> tuple[int, str] | None:
    """`blk.3.ffn_up_exps.weight` -> (3, "up"); None for any other tensor."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@attrs.frozen
class TensorInfo:
    """One tensor of a GGUF file: type, numpy-order shape and where its bytes are."""

    name: str
    ggml_type: str  # GGMLQuantizationType name: "Q4_0", "F32", ...
    shape: tuple[int, ...]  # numpy order: (ne1, ne0) for 2-D, (ne2, ne1, ne0) for 3-D
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.ggml_type]

    @property
    def ne(self) -> tuple[int, ...]:
        """GGML order (ne0 first)."""
        return tuple(reversed(self.shape))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (`ne0` elements)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def n_rows(self) -> int:
        """Rows over all leading dimensions."""
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1


def _open_header(path: Path) -> GGUFHeader:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InvalidGGUFError(f"{path}: no such file") from None
    except OSError as e:
        raise InvalidGGUFError(f"{path}: cannot read ({e.strerror})") from None
    if path.is_dir():
        raise InvalidGGUFError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise NotGGUFError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py first"
        )
    try:
        header = read_header(path)
    except EOFError as e:
        raise TruncatedGGUFError(
            f"{path} ({size} bytes) is truncated inside its header ({e}); the download or "
            "copy was interrupted, fetch it again"
        ) from None
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError, RecursionError) as e:
        raise InvalidGGUFError(f"{path}: corrupt GGUF header ({e})") from None
    return header


def _tensor_infos(path: Path, header: GGUFHeader) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for t in header.tensors:
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
            block, size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise InvalidGGUFError(
                f"{path}: tensor {t.name} has unknown GGML type {t.ggml_type}"
            ) from None
        if not t.ne or any(int(n) < 1 for n in t.ne) or t.ne[0] % block:
            raise InvalidGGUFError(
                f"{path}: tensor {t.name} has shape ne={list(t.ne)}, impossible for "
                f"{qtype.name} (blocks of {block})"
            )
        if t.name in out:
            raise InvalidGGUFError(f"{path}: tensor {t.name} appears twice")
        rows = math.prod(int(n) for n in t.ne[1:])  # exact: a corrupt ne must not wrap
        out[t.name] = TensorInfo(
            name=t.name,
            ggml_type=qtype.name,
            shape=tuple(int(x) for x in reversed(t.ne)),
            offset=t.offset,
            nbytes=rows * (t.ne[0] // block) * size if t.ne else 0,
        )
    size = path.stat().st_size
    prev: TensorInfo | None = None
    for info in sorted(out.values(), key=lambda i: i.offset):
        if info.offset < header.data_offset:
            raise InvalidGGUFError(
                f"{path}: tensor {info.name} starts at byte {info.offset}, inside the header"
            )
        if prev is not None and info.offset < prev.offset + prev.nbytes:
            raise InvalidGGUFError(
                f"{path}: the data of tensors {prev.name} and {info.name} overlap; the file is "
                "corrupt"
            )
        prev = info
    end = max((i.offset + i.nbytes for i in out.values()), default=0)
    if end > size:
        raise TruncatedGGUFError(
            f"{path} is truncated: its tensors need {end} bytes but the file has {size}; "
            "the download or copy was interrupted, fetch it again"
        )
    return out


def _get(fields: Mapping[str, Any], key: str, arch: str, default: Any = None) -> Any:
    return fields.get(key.format(arch=arch), default)


def _gating(meta: _Meta, family: str) -> str:
    rule = BY_FAMILY[family].gating_key
    if rule == "fixed":  # llama.cpp's graph passes softmax whatever the file says
        return "softmax"
    key = Keys.LLM.EXPERT_GATING_FUNC
    if meta.fields.get(meta.key(key)) is None:
        if rule == "required":
            raise meta.fail(key, f"is missing ({family} needs it)")
        return "softmax"
    value = meta.integer(key, hi=1 << 31)
    func = _GATING_FUNCS.get(value)
    if func is None:
        raise meta.fail(
            key, f"= {value} is not one llama.cpp defines for {family} (1 = softmax, 2 = sigmoid)"
        )
    return func


def _span(layers: tuple[int, ...]) -> str:
    """A list of layers, short whatever its length: `[1, 2, 3]`, or `1..47` for a long run."""
    if len(layers) <= 8:
        return str(list(layers))
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return str(list(layers[:8]))[:-1] + (", ...]" if len(layers) > 8 else "]")


def _show(v: Any) -> str:
    """A metadata value for an error message: its repr, cut short (a value may be huge)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_vocabulary(meta: _Meta, tensors: Mapping[str, TensorInfo]) -> int:
    """The vocabulary size, consistent across `vocab_size`, the token list and the embedding
    (llama.cpp sizes token_embd by the token list), and every special token id inside it."""
    fields = meta.fields
    emb = tensors.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise InvalidGGUFError(
            f"{meta.path}: token_embd.weight is "
            + ("missing" if emb is None else f"of shape {emb.shape}, not [n_vocab, n_embd]")
        )
    n_vocab = emb.shape[0]
    tokens = fields.get(Keys.Tokenizer.LIST)
    if tokens is not None:
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise InvalidMetadataError(
                f"{meta.path}: metadata {Keys.Tokenizer.LIST} is not an array of strings"
            )
        if len(tokens) != n_vocab:
            raise InvalidMetadataError(
                f"{meta.path}: metadata {Keys.Tokenizer.LIST} has {len(tokens)} tokens, but "
                f"token_embd.weight has {n_vocab} rows"
            )
    size = meta.integer(Keys.LLM.VOCAB_SIZE, n_vocab, lo=1, hi=MAX_VOCAB)
    if size != n_vocab:
        raise meta.fail(Keys.LLM.VOCAB_SIZE, f"= {size}, but token_embd.weight has {n_vocab} rows")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        v = fields.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n_vocab):
            raise InvalidMetadataError(
                f"{meta.path}: metadata {key} must be an array of one entry per token "
                f"({n_vocab}), got {_show(v)}"
            )
    merges = fields.get("tokenizer.ggml.merges")
    if merges is not None and (
        not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)
    ):
        raise InvalidMetadataError(
            f"{meta.path}: metadata tokenizer.ggml.merges is not an array of strings"
        )
    for key in sorted(fields):
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            meta.integer(key, lo=0, hi=n_vocab - 1)  # a token of this vocabulary
        elif key.startswith("tokenizer.ggml.add_"):
            meta.boolean(key, False)
    return n_vocab


def dense_tensor_problems(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What is wrong with the non-expert tensors `shapes` (name -> numpy shape) for `spec`: every
    tensor the family's layers are built from must be there with the shape llama.cpp creates it
    with (where a family has two forms, e.g. DeepSeek's q LoRA, the form present decides).
    The one check both packing (against the GGUF's tensors) and loading (against the manifest's
    dense tensors) run. Returns messages, empty when everything is there."""
    rec = BY_FAMILY[spec.family]
    d = spec.n_embd
    w = Want(spec, shapes)
    w.required["token_embd.weight"] = (spec.n_vocab, d)
    w.required[rec.final_norm] = (d,)
    w.optional["output.weight"] = (spec.n_vocab, d)
    for i in range(spec.n_layers):
        rec.layer_tensors(w, i)
    want, optional = w.required, w.optional
    problems = []
    for name, shape in want.items():
        if name not in shapes:
            problems.append(f"tensor {name} is missing ({spec.family} needs it)")
        elif tuple(shapes[name]) != shape:
            problems.append(
                f"tensor {name} has shape {list(shapes[name])}, expected {list(shape)} from the "
                "model's dimensions"
            )
    for name, shape in optional.items():
        if name in shapes and tuple(shapes[name]) != shape:
            problems.append(f"tensor {name} has shape {list(shapes[name])}, expected {list(shape)}")
    return problems


def _check_spec_ranges(kw: Mapping[str, Any]) -> None:
    """A spec read back from a manifest must describe a model the engine can run: positive
    sizes, one entry per layer, layer indices inside the model (else an IndexError or a
    division by zero deep in the forward pass instead of an error naming the field)."""

    def bad(name: str, why: str) -> PackFormatError:
        return PackFormatError(f"model spec field {name!r}: {kw[name]!r} {why}")

    for name in ("n_layers", "n_embd", "n_head", "head_dim_k", "head_dim_v", "n_vocab"):
        if kw[name] < 1:
            raise bad(name, "must be >= 1")
    for name in ("n_experts", "n_ff_exp", "rope_dims"):
        if kw[name] < 1:
            raise bad(name, "must be >= 1")
    if not MIN_CONTEXT <= kw["n_ctx"] <= MAX_CONTEXT:
        raise bad("n_ctx", f"must be between {MIN_CONTEXT} and {MAX_CONTEXT} tokens")
    n = kw["n_layers"]
    if len(kw["n_head_kv"]) != n:
        raise bad("n_head_kv", f"must have one entry per layer ({n})")
    if any(h < 0 or (h and kw["n_head"] % h) for h in kw["n_head_kv"]):
        raise bad("n_head_kv", f"entries must divide n_head = {kw['n_head']}")
    if kw["sliding_window"] < 0 or (kw["swa_layers"] and kw["sliding_window"] < 1):
        raise bad("sliding_window", "must be >= 0, and >= 1 when a layer slides")
    for name in ("moe_layers", "attention_layers", "swa_layers", "nope_layers"):
        if any(not 0 <= i < n for i in kw[name]) or len(set(kw[name])) != len(kw[name]):
            raise bad(name, f"must be distinct layer indices below n_layers = {n}")
    if not 1 <= kw["n_experts_used"] <= kw["n_experts"]:
        raise bad("n_experts_used", f"must be between 1 and n_experts = {kw['n_experts']}")
    for name in ("rms_eps", "rope_freq_base", "rope_freq_scale"):
        if not (math.isfinite(kw[name]) and kw[name] > 0):
            raise bad(name, "must be a positive finite number")
    if kw["rope_dims"] > kw["head_dim_k"] or kw["rope_dims"] % 2:
        raise bad("rope_dims", f"must be even and at most head_dim_k = {kw['head_dim_k']}")
    for name in ("n_ff", "n_ff_shexp", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
                 "head_dim_k_mla", "head_dim_v_mla", "expert_group_count",
                 "expert_group_used_count", "rope_n_ctx_orig", "shortconv_l_cache"):  # fmt: skip
        if kw[name] < 0:
            raise bad(name, "must be >= 0")
    if not 0 <= kw["n_leading_dense"] <= n:
        raise bad("n_leading_dense", f"must be between 0 and n_layers = {n}")
    if BY_FAMILY[kw["family"]].attention == "mla":
        if kw["kv_lora_rank"] < 1 or kw["head_dim_v_mla"] < 1:
            raise bad("kv_lora_rank", "and head_dim_v_mla must be >= 1 for MLA attention")
        if not kw["rope_dims"] < kw["head_dim_k_mla"]:
            raise bad("head_dim_k_mla", f"must exceed rope_dims = {kw['rope_dims']} (nope + rope)")
    g, gu = kw["expert_group_count"], kw["expert_group_used_count"]
    if g > 1 and (kw["n_experts"] % g or not 1 <= gu <= g):
        raise bad("expert_group_count", f"must divide n_experts with 1 <= used ({gu}) <= it")
    for name in ("rope_attn_factor",):
        if not (math.isfinite(kw[name]) and kw[name] > 0):
            raise bad(name, "must be a positive finite number")
    if not math.isfinite(kw["rope_yarn_log_mul"]):
        raise bad("rope_yarn_log_mul", "must be a finite number")


def _check_spec_layer_kinds(kw: Mapping[str, Any]) -> None:
    """Which layers attend, convolve, or run experts, read back from a manifest: the facts the
    engine builds each layer from must agree with each other (as llama.cpp derives them)."""

    def bad(name: str, why: str) -> PackFormatError:
        return PackFormatError(f"model spec field {name!r}: {kw[name]!r} {why}")

    rec = BY_FAMILY[kw["family"]]
    n, kv = kw["n_layers"], kw["n_head_kv"]
    if not rec.conv_layers and 0 in kv:
        conv = ", ".join(f.name for f in RECORDS if f.conv_layers)
        raise bad("n_head_kv", f"has a layer without KV heads, which only {conv} allows")
    if tuple(kw["attention_layers"]) != tuple(i for i in range(n) if kv[i] > 0):
        raise bad("attention_layers", "must be exactly the layers with KV heads (n_head_kv > 0)")
    if 0 in kv and kw["shortconv_l_cache"] < 2:
        raise bad("shortconv_l_cache", "must be >= 2: layers without KV heads are convolutions")
    if rec.conv_layers:
        lead = kw["n_leading_dense"]
        if tuple(kw["moe_layers"]) != tuple(range(lead, n)):
            raise bad("moe_layers", f"must be layers {lead}..{n - 1} (n_leading_dense = {lead})")
        if lead and kw["n_ff"] < 1:
            raise bad("n_ff", "must be >= 1: the leading dense layers need a dense FFN width")


def _check_qk_norm(
    path: Path, kind: str, tensors: Mapping[str, TensorInfo], full: int, head: int
) -> None:
    """The family's q/k-norm kind must match the norm tensors in the file (the shapes llama.cpp
    creates them with), so that a converter change shows as an error, not as wrong numbers."""
    want = {"full": (full,), "head": (head,)}.get(kind)
    for name, info in tensors.items():
        if not name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            continue
        if want is None or info.shape != want:
            raise InvalidGGUFError(
                f"{path}: {name} has shape {info.shape}, but this architecture's q/k norm is "
                f"{kind!r}" + (f" (expected {want})" if want else "")
            )


class _Meta:
    """Typed, named access to a GGUF's metadata: a missing, mistyped or nonsensical value is an
    InvalidMetadataError naming the key (and never a ZeroDivisionError three layers later)."""

    def __init__(self, path: Path, fields: Mapping[str, Any], arch: str) -> None:
        self.path, self.fields, self.arch = path, fields, arch

    def key(self, key: str) -> str:
        return key.format(arch=self.arch)

    def fail(self, key: str, msg: str) -> InvalidMetadataError:
        return InvalidMetadataError(f"{self.path}: metadata {self.key(key)} {msg}")

    def integer(self, key: str, default: int | None = None, lo: int = 0, hi: int = MAX_INT) -> int:
        """An integer (the largest entry of a per-layer array) in `[lo, hi]`; `default` when
        the key is absent (missing and no default: an error)."""
        v = self.fields.get(self.key(key))
        if v is None:
            if default is None:
                raise self.fail(key, "is missing")
            return default
        items = list(v) if isinstance(v, list | tuple) else [v]
        if not items:
            raise self.fail(key, "is an empty array")
        for x in items:
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise self.fail(key, f"= {_show(v)} is not an integer")
            if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
                raise self.fail(key, f"= {_show(v)} is not an integer")
            if int(x) < lo:
                raise self.fail(key, f"= {int(x)} must be >= {lo}")
            if int(x) > hi:
                raise self.fail(key, f"= {int(x)} must be <= {hi}")
        return int(max(items))

    def number(
        self,
        key: str,
        default: float,
        *,
        positive: bool = True,
        lo: float = -math.inf,
        hi: float = math.inf,
    ) -> float:
        """A finite number (`positive`: > 0) in `[lo, hi]`; `default` when absent."""
        v = self.fields.get(self.key(key))
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(key, f"= {_show(v)} is not a number")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f) or (positive and f <= 0):
            raise self.fail(key, f"= {f:.6g} must be a finite number > 0")
        if not lo <= f <= hi:
            low = 0.0 if positive and lo == -math.inf else lo
            raise self.fail(key, f"= {f:.6g} must be between {low:g} and {hi:g}")
        return f

    def boolean(self, key: str, default: bool) -> bool:
        v = self.fields.get(self.key(key))
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, f"= {_show(v)} is not true/false")
        return v


@attrs.frozen(eq=False)
class ModelSpec:
    """What the packer and the engine need to know about a GGUF MoE model.

    Built with `ModelSpec.from_gguf(path)`. Dimensions follow llama.cpp's hparams; `tensors`
    indexes every tensor (numpy-order shapes). `n_head_kv` is per layer (lfm2moe marks its
    short-convolution layers with 0 heads).
    """

    path: str
    file_bytes: int
    arch: str  # general.architecture
    family: str  # olmoe | qwen3moe | mixtral | deepseek2 | lfm2moe
    name: str
    n_layers: int
    n_embd: int
    n_ff: int  # dense FFN width (feed_forward_length); 0 when the model has none
    n_ff_exp: int  # expert FFN width (from the expert tensors)
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx: int
    rope_dims: int
    rope_freq_base: float
    rope_freq_scale: float
    rope_scaling_type: str
    rms_eps: float
    n_experts: int
    n_experts_used: int
    n_shared_experts: int
    n_leading_dense: int
    expert_weights_norm: bool
    expert_weights_scale: float
    expert_gating_func: str  # "softmax" | "sigmoid"
    moe_layers: tuple[int, ...]
    attention_layers: tuple[int, ...]
    expert_type: str  # GGML type of the source expert tensors ("mixed:Q4_0,Q6_K" if several)
    q_lora_rank: int = 0  # deepseek2: 0 = no q LoRA (attn_q), else attn_q_a -> norm -> attn_q_b
    kv_lora_rank: int = 0  # deepseek2: width of the compressed KV (attn_kv_a_norm)
    head_dim_k_mla: int = 0  # deepseek2: q/k head dim after decompression (nope + rope)
    head_dim_v_mla: int = 0  # deepseek2: v head dim after decompression
    shortconv_l_cache: int = 0
    n_ff_shexp: int = 0  # width of the shared-expert FFN (ffn_*_shexp); 0 without one
    expert_group_count: int = 0  # DeepSeek group-limited routing (0/1: none)
    expert_group_used_count: int = 0
    rope_n_ctx_orig: int = 0  # rope.scaling.original_context_length (YaRN's ramp), else n_ctx
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor
    rope_yarn_log_mul: float = (
        0.0  # rope.scaling.yarn_log_multiplier as stored (0.1*mscale_all_dim)
    )
    rope_type: str = "neox"  # "norm" | "neox", as llama.cpp applies RoPE for this family
    qk_norm: str = "none"  # "none" | "full" | "head": q/k RMSNorm before RoPE (see QK_NORM)
    sliding_window: int = 0  # tokens a sliding layer attends to (0: no sliding layers)
    swa_layers: tuple[int, ...] = ()  # the layers with a sliding window
    nope_layers: tuple[int, ...] = ()  # the layers whose attention takes no RoPE
    tensors: Mapping[str, TensorInfo] = attrs.field(factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Read a GGUF file's header (no tensor data) and describe the MoE model in it.

        Raises NotGGUFError / TruncatedGGUFError for unreadable files,
        UnsupportedArchitectureError, DenseModelError (no experts), UnalignedReductionError.
        """
        p = Path(path)
        header = _open_header(p)
        tensors = _tensor_infos(p, header)
        fields = header.kv
        return cls._from_fields(p, fields, tensors)

    @classmethod
    def _from_fields(
        cls, p: Path, fields: Mapping[str, Any], tensors: Mapping[str, TensorInfo]
    ) -> ModelSpec:
        # long: the GGUF metadata validator, one check per key a supported family reads
        arch = fields.get(Keys.General.ARCHITECTURE)
        if arch is None:
            raise InvalidGGUFError(f"{p} has no general.architecture key")
        if not isinstance(arch, str):
            raise InvalidMetadataError(
                f"{p}: metadata general.architecture = {_show(arch)} is not a string"
            )
        rec: Family | None = BY_ARCH.get(arch)
        if rec is None:
            raise UnsupportedArchitectureError(
                f"{p}: architecture {arch!r} is not supported; estream-layout packs "
                f"{', '.join(sorted(FAMILIES))} (llama only with experts, i.e. Mixtral)"
            )
        family = rec.name
        g = lambda key, default=None: _get(fields, key, arch, default)  # noqa: E731
        meta = _Meta(p, fields, arch)

        n_experts = meta.integer(Keys.LLM.EXPERT_COUNT, 0, hi=MAX_EXPERTS)
        experts: dict[int, dict[str, TensorInfo]] = {}
        for name, info in tensors.items():
            parsed = parse_expert_tensor_name(name)
            if parsed:
                experts.setdefault(parsed[0], {})[parsed[1]] = info
        legacy = [n for n in tensors if _LEGACY_EXPERT_RE.match(n)]
        if legacy and not experts:
            raise UnsupportedArchitectureError(
                f"{p}: experts are stored as separate per-expert tensors ({legacy[0]}, ...), the "
                "pre-2024 GGUF layout; convert the model again with a current llama.cpp "
                "(convert_hf_to_gguf.py), which stacks them as blk.N.ffn_*_exps.weight"
            )
        if n_experts == 0 or not experts:
            raise DenseModelError(
                f"{p}: {arch!r} model has no experts ({arch}.expert_count="
                f"{g(Keys.LLM.EXPERT_COUNT)}, {sum(len(v) for v in experts.values())} "
                "ffn_*_exps tensors); EStream streams MoE experts, a dense model needs no packing"
            )
        for layer, projs in sorted(experts.items()):
            missing = [j for j in EXPERT_PROJECTIONS if j not in projs]
            if missing:
                raise InvalidGGUFError(f"{p}: layer {layer} lacks expert tensors {missing}")
        moe_layers = tuple(sorted(experts))
        gate0 = experts[moe_layers[0]]["gate"]
        if len(gate0.shape) != 3:
            raise InvalidGGUFError(
                f"{gate0.name} should be 3-D [E, ff, d], has shape {gate0.shape}"
            )
        _, n_ff_exp, n_embd_t = gate0.shape
        for layer in moe_layers:
            want = {
                "gate": (n_experts, n_ff_exp, n_embd_t),
                "up": (n_experts, n_ff_exp, n_embd_t),
                "down": (n_experts, n_embd_t, n_ff_exp),
            }
            for j, info in experts[layer].items():
                if info.shape != want[j]:
                    raise InvalidGGUFError(
                        f"{p}: {info.name} has shape {info.shape}, expected {want[j]} "
                        f"([E, rows, cols] with E={n_experts})"
                    )
                if info.shape[-1] % 32:
                    raise UnalignedReductionError(
                        f"{p}: expert tensor {info.name} has reduction dimension "
                        f"{info.shape[-1]}, not a multiple of 32; the tile format needs K % 32 == 0"
                    )

        n_layers = meta.integer(Keys.LLM.BLOCK_COUNT, lo=1, hi=MAX_LAYERS)
        # Against the tensors first, before anything is sized by n_layers.
        blocks = {b for b in map(_layer_index, tensors) if b is not None}
        beyond = sorted(b for b in blocks if b >= n_layers)
        if beyond:
            raise meta.fail(
                Keys.LLM.BLOCK_COUNT,
                f"= {n_layers}, but the file has tensors of layer {beyond[0]} (blk.{beyond[0]}.*); "
                "the model would silently run fewer layers",
            )
        if len(blocks) != n_layers:
            first = min(set(range(n_layers)) - blocks)
            raise meta.fail(
                Keys.LLM.BLOCK_COUNT,
                f"= {n_layers}, but the file has no tensors for layer {first}",
            )
        lead = meta.integer(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0, hi=n_layers)
        if rec.leading_dense:
            if moe_layers != tuple(range(lead, n_layers)):
                raise meta.fail(
                    Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
                    f"= {lead}, but the expert tensors are in layers {_span(moe_layers)}; "
                    f"llama.cpp runs experts in every layer from {lead} on",
                )
        elif lead:
            raise meta.fail(
                Keys.LLM.LEADING_DENSE_BLOCK_COUNT,
                f"= {lead}: {family} has no leading dense layers (every layer is a mixture of "
                "experts)",
            )
        elif moe_layers != tuple(range(n_layers)):
            dense = min(set(range(n_layers)) - set(moe_layers))
            raise InvalidGGUFError(
                f"{p}: layer {dense} has no expert tensors (blk.{dense}.ffn_*_exps.weight); "
                f"every layer of a {family} model is a mixture of experts"
            )
        n_embd = meta.integer(Keys.LLM.EMBEDDING_LENGTH, lo=1, hi=MAX_WIDTH)
        if n_embd != n_embd_t:
            raise meta.fail(
                Keys.LLM.EMBEDDING_LENGTH,
                f"= {n_embd}, but the expert tensors are {n_embd_t} wide",
            )
        n_ff_exp_key = meta.integer(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0, lo=1, hi=MAX_WIDTH)
        if n_ff_exp_key and n_ff_exp_key != n_ff_exp:
            raise meta.fail(
                Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
                f"= {n_ff_exp_key}, but the expert tensors are {n_ff_exp} wide",
            )
        n_ff = meta.integer(Keys.LLM.FEED_FORWARD_LENGTH, 0, lo=1, hi=MAX_WIDTH)
        n_head = meta.integer(Keys.Attention.HEAD_COUNT, lo=1, hi=MAX_HEADS)
        meta.integer(Keys.Attention.HEAD_COUNT_KV, n_head, hi=MAX_HEADS)  # type and range check
        kv = g(Keys.Attention.HEAD_COUNT_KV, n_head)
        if isinstance(kv, list | tuple):
            n_head_kv = tuple(int(x) for x in kv)
            if len(n_head_kv) != n_layers:
                raise meta.fail(
                    Keys.Attention.HEAD_COUNT_KV,
                    f"has {len(n_head_kv)} entries for block_count={n_layers}",
                )
        else:
            n_head_kv = (int(kv),) * n_layers
        for h in n_head_kv:
            if h > n_head or (h and n_head % h) or (h == 0 and not rec.conv_layers):
                raise meta.fail(
                    Keys.Attention.HEAD_COUNT_KV,
                    f"= {h} must divide head_count = {n_head}",
                )
        has_key_length = fields.get(meta.key(Keys.Attention.KEY_LENGTH)) is not None
        if not has_key_length and n_embd % n_head:
            raise meta.fail(
                Keys.Attention.HEAD_COUNT,
                f"= {n_head} does not divide embedding_length = {n_embd} (and there is no "
                "attention.key_length)",
            )
        head_dim = n_embd // n_head
        head_dim_k = meta.integer(Keys.Attention.KEY_LENGTH, head_dim, lo=1, hi=MAX_WIDTH)
        head_dim_v = meta.integer(Keys.Attention.VALUE_LENGTH, head_dim, lo=1, hi=MAX_WIDTH)
        if (n_head * head_dim_k) % 32 or head_dim_k % 2:
            raise meta.fail(
                Keys.Attention.KEY_LENGTH,
                f"= {head_dim_k}: head_count x key_length = {n_head * head_dim_k} must be a "
                "multiple of 32 (the tile) and key_length even (RoPE rotates pairs)",
            )
        n_experts_used = meta.integer(Keys.LLM.EXPERT_USED_COUNT, lo=1)
        if n_experts_used > n_experts:
            raise meta.fail(
                Keys.LLM.EXPERT_USED_COUNT, f"= {n_experts_used} exceeds expert_count = {n_experts}"
            )
        rms_eps = meta.number(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6, hi=1.0)
        rope_base = meta.number(Keys.Rope.FREQ_BASE, 10000.0, hi=1e12)
        rope_dims = meta.integer(Keys.Rope.DIMENSION_COUNT, head_dim_k, lo=1, hi=MAX_WIDTH)
        if rope_dims > head_dim_k or rope_dims % 2:
            raise meta.fail(
                Keys.Rope.DIMENSION_COUNT,
                f"= {rope_dims} must be even and at most key_length = {head_dim_k}",
            )
        n_ctx = meta.integer(Keys.LLM.CONTEXT_LENGTH, lo=MIN_CONTEXT, hi=MAX_CONTEXT)
        n_vocab = _check_vocabulary(meta, tensors)
        scaling_type = g(Keys.Rope.SCALING_TYPE, "none")
        if scaling_type not in ROPE_SCALING_TYPES:
            raise meta.fail(
                Keys.Rope.SCALING_TYPE,
                f"= {_show(scaling_type)} is not one of llama.cpp's "
                f"{', '.join(ROPE_SCALING_TYPES)}",
            )
        # llama.cpp: rope_freq_scale = 1 / rope.scaling.factor (or the legacy rope.scale_linear);
        # a factor of 0 means none
        factor = meta.number(Keys.Rope.SCALING_FACTOR, 0.0, positive=False, lo=0.0, hi=1e4)
        factor = factor or meta.number(
            "{arch}.rope.scale_linear", 0.0, positive=False, lo=0.0, hi=1e4
        )
        if 0 < factor < 1e-4:
            raise meta.fail(Keys.Rope.SCALING_FACTOR, f"= {factor:.6g} must be 0 (none) or >= 1e-4")
        freq_scale = 1.0 / factor if factor else 1.0
        if rec.norm_topk is None:
            norm_w = meta.boolean(Keys.LLM.EXPERT_WEIGHTS_NORM, False)
        else:
            norm_w = rec.norm_topk
        gating = _gating(meta, family)
        qk_norm = rec.qk_norm
        _check_qk_norm(p, qk_norm, tensors, n_head * head_dim_k, head_dim_k)
        if rec.check is not None:
            rec.check(meta, tensors, n_head_kv, moe_layers, n_experts, n_embd, n_head * head_dim_k)
        if rec.conv_layers:
            attention_layers = tuple(i for i in range(n_layers) if n_head_kv[i] > 0)
        else:
            attention_layers = tuple(range(n_layers))
        q_lora = meta.integer(Keys.Attention.Q_LORA_RANK, 0, hi=MAX_WIDTH)
        kv_lora = meta.integer(Keys.Attention.KV_LORA_RANK, 0, hi=MAX_WIDTH)
        k_mla = meta.integer(Keys.Attention.KEY_LENGTH_MLA, 0, hi=MAX_WIDTH)
        v_mla = meta.integer(Keys.Attention.VALUE_LENGTH_MLA, 0, hi=MAX_WIDTH)
        if rec.attention == "mla":
            # llama.cpp: without key/value_length_mla (early converters, attn_kv_b) the MLA head
            # dims are key/value_length themselves.
            k_mla, v_mla = k_mla or head_dim_k, v_mla or head_dim_v
            if kv_lora < 1:
                raise meta.fail(Keys.Attention.KV_LORA_RANK, "is missing (MLA needs it)")
            if not rope_dims < k_mla:
                raise meta.fail(
                    Keys.Rope.DIMENSION_COUNT,
                    f"= {rope_dims} must be below the MLA key head dim {k_mla} (nope + rope)",
                )
        n_groups = meta.integer(Keys.LLM.EXPERT_GROUP_COUNT, 0, hi=n_experts)
        n_groups_used = meta.integer(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0, hi=n_experts)
        if n_groups > 1 and (n_experts % n_groups or not 1 <= n_groups_used <= n_groups):
            raise meta.fail(
                Keys.LLM.EXPERT_GROUP_COUNT,
                f"= {n_groups} must divide expert_count = {n_experts}, with "
                f"expert_group_used_count = {n_groups_used} between 1 and it",
            )
        n_shared = meta.integer(Keys.LLM.EXPERT_SHARED_COUNT, 0, hi=n_experts)
        shexp = tensors.get(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight")
        n_ff_shexp = shexp.shape[0] if shexp is not None and shexp.shape else 0
        if rec.shared_experts and n_ff_shexp != n_ff_exp * n_shared:
            raise meta.fail(
                Keys.LLM.EXPERT_SHARED_COUNT,
                f"= {n_shared}: the shared experts must be {n_shared} x {n_ff_exp} = "
                f"{n_ff_exp * n_shared} wide, but ffn_gate_shexp is "
                + (f"{n_ff_shexp} wide" if shexp is not None else "missing"),
            )
        window, swa_layers, nope_layers = 0, (), ()
        if rec.attention_pattern is not None:
            window, swa_layers, nope_layers = rec.attention_pattern(meta, n_layers, rope_base)
        types = sorted({experts[la][j].ggml_type for la in moe_layers for j in EXPERT_PROJECTIONS})
        expert_type = types[0] if len(types) == 1 else "mixed:" + ",".join(types)
        spec = cls(
            path=str(p),
            file_bytes=p.stat().st_size,
            arch=arch,
            family=family,
            name=str(fields.get(Keys.General.NAME, p.stem))[:256],
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=n_ff,
            n_ff_exp=int(n_ff_exp),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_vocab=n_vocab,
            n_ctx=n_ctx,
            rope_dims=rope_dims,
            rope_freq_base=rope_base,
            rope_freq_scale=freq_scale,
            rope_scaling_type=scaling_type,
            rms_eps=rms_eps,
            n_experts=n_experts,
            n_experts_used=n_experts_used,
            n_shared_experts=n_shared,
            n_leading_dense=lead,
            expert_weights_norm=norm_w,
            expert_weights_scale=meta.number(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0, hi=1e4),
            expert_gating_func=gating,
            moe_layers=moe_layers,
            attention_layers=attention_layers,
            expert_type=expert_type,
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            head_dim_k_mla=k_mla,
            head_dim_v_mla=v_mla,
            shortconv_l_cache=meta.integer(Keys.ShortConv.L_CACHE, 0, hi=MAX_CONV_CACHE),
            n_ff_shexp=n_ff_shexp,
            expert_group_count=n_groups,
            expert_group_used_count=n_groups_used,
            rope_n_ctx_orig=meta.integer(_ROPE_ORIG_CTX, 0, hi=MAX_CONTEXT) or n_ctx,
            rope_attn_factor=meta.number(_ROPE_ATTN_FACTOR, 1.0, hi=1e4),
            rope_yarn_log_mul=meta.number(_ROPE_YARN_LOG_MUL, 0.0, positive=False, lo=-1e4, hi=1e4),
            rope_type=rec.rope_type,
            qk_norm=qk_norm,
            sliding_window=window,
            swa_layers=swa_layers,
            nope_layers=nope_layers,
            tensors=dict(tensors),
        )
        problems = dense_tensor_problems(spec, {n: t.shape for n, t in tensors.items()})
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise InvalidGGUFError(f"{p}: {problems[0]}{more}")
        return spec

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        """The spec as `summary()` wrote it (a packed model's `manifest.json` "spec"), without the
        tensor index: what the engine reads instead of deriving architecture facts again.

        Raises PackFormatError when a field is missing (a pack made by an older estream-layout:
        pack the model again) or has the wrong kind of value."""
        fields = attrs.fields(cls)
        names = [f.name for f in fields if f.name not in ("path", "tensors")]
        missing = [n for n in names if n not in d]
        if missing:
            raise PackFormatError(
                f"model spec lacks {', '.join(missing)}: the model was packed by an older "
                "estream-layout; pack it again"
            )
        kw: dict[str, Any] = {}
        for f in fields:
            if f.name in ("path", "tensors"):
                continue
            v = d[f.name]
            try:
                if f.type in ("tuple[int, ...]",):
                    if not isinstance(v, list | tuple):
                        raise TypeError(f"expected a list, got {type(v).__name__}")
                    v = tuple(int(x) for x in v)
                elif f.type == "int":
                    if isinstance(v, bool) or int(v) != v:
                        raise TypeError(f"expected an integer, got {v!r}")
                    v = int(v)
                elif f.type == "float":
                    v = float(v)
                elif f.type == "bool":
                    if not isinstance(v, bool):
                        raise TypeError(f"expected true/false, got {v!r}")
                elif f.type == "str" and not isinstance(v, str):
                    raise TypeError(f"expected a string, got {v!r}")
            except (TypeError, ValueError) as e:
                raise PackFormatError(f"model spec field {f.name!r}: {e}") from None
            kw[f.name] = v
        for name, allowed in (
            ("rope_type", ("norm", "neox")),
            ("qk_norm", ("none", "full", "head")),
            ("expert_gating_func", tuple(_GATING_FUNCS.values())),
            ("rope_scaling_type", ROPE_SCALING_TYPES),
        ):
            if kw[name] not in allowed:
                raise PackFormatError(
                    f"model spec field {name!r} is {kw[name]!r}, expected one of {allowed}"
                )
        if kw["family"] not in FAMILIES.values():
            raise PackFormatError(f"model spec family {kw['family']!r} is unknown")
        _check_spec_ranges(kw)
        _check_spec_layer_kinds(kw)
        return cls(path="", tensors={}, **kw)

    # ------------------------------------------------------------------ queries
    def expert_tensor(self, layer: int, projection: str) -> TensorInfo:
        """The stacked `[E, rows, cols]` tensor of one projection of one MoE layer."""
        return self.tensors[expert_tensor_name(layer, projection)]

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def record(self) -> Family:
        """The family record this model's architecture facts come from."""
        return BY_FAMILY[self.family]

    @property
    def router_input(self) -> str:
        """What the router reads: "ffn_norm" (the experts' input) or "layer" (the layer's
        input, before attention: the routes are known when the layer starts)."""
        return self.record.router_input

    @property
    def expert_glu(self) -> str:
        """The experts' gated activation: "swiglu", "reglu" or "swiglu_oai" (gpt-oss: clamped,
        with expert biases)."""
        return self.record.expert_glu

    @property
    def dense_tensor_names(self) -> tuple[str, ...]:
        """Every tensor that is not a routed-expert stack, in file order."""
        return tuple(n for n in self.tensors if parse_expert_tensor_name(n) is None)

    @property
    def expert_bytes(self) -> int:
        """Source bytes of all routed-expert tensors."""
        return sum(
            self.expert_tensor(layer, j).nbytes
            for layer in self.moe_layers
            for j in EXPERT_PROJECTIONS
        )

    def summary(self) -> dict[str, Any]:
        """JSON-able description (everything but the tensor index and the path)."""
        d = attrs.asdict(self, filter=lambda a, _v: a.name not in ("tensors", "path"))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


class TensorReader:
    """Reads tensor rows with `pread` into caller-owned buffers.

    Unlike a memory map, the pages read do not stay in this process's resident set, which is
    what keeps packing a 4 GB model under a few hundred MiB of RSS.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.path = str(path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefetch(self, info: TensorInfo) -> None:
        """Ask the kernel to start reading a tensor now (asynchronously), so a later `rows` or
        `expert` call finds it in the page cache: overlaps disk reads with conversion."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, info.offset, info.nbytes, os.POSIX_FADV_WILLNEED)

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        """Fill the contiguous uint8 buffer `out` from the file at `offset`."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise TruncatedGGUFError(
                    f"{self.path}: unexpected end of file at byte {offset + done}"
                )
            done += n
        return out

    def rows(
        self,
        info: TensorInfo,
        start: int = 0,
        count: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows `[start, start+count)` of a tensor (rows counted over all leading dims) as
        uint8 `[count, row_bytes]`."""
        rb = info.row_bytes
        if count is None:
            count = info.n_rows - start
        if out is None:
            out = np.empty((count, rb), dtype=np.uint8)
        else:
            out = out.reshape(-1)[: count * rb].reshape(count, rb)
        return self.read_into(info.offset + start * rb, out)

    def expert(self, info: TensorInfo, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """One expert's `[rows, row_bytes]` slice of a stacked `[E, rows, cols]` tensor."""
        rows = info.shape[-2]
        return self.rows(info, expert * rows, rows, out)


def tensor_memmap(spec: ModelSpec, name: str) -> np.ndarray:
    """Zero-copy read-only view of a tensor's raw bytes, shaped `[..., rows, row_bytes]`."""
    info = spec.tensors[name]
    mm = np.memmap(spec.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    return mm.reshape(*info.shape[:-1], info.row_bytes) if len(info.shape) > 1 else mm


def dequantize_rows(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Raw rows of `info`'s type -> float32 (any type gguf can dequantize)."""
    qt = info.qtype
    if qt == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(*raw.shape[:-1], -1)
    if qt == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(*raw.shape[:-1], -1)
    try:
        return np.asarray(gguf_quants.dequantize(raw, qt), dtype=np.float32)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise UnsupportedTensorTypeError(
            f"{info.name}: gguf cannot dequantize tensor type {info.ggml_type} ({e})"
        ) from None


def dequantize_tensor(spec: ModelSpec, name: str) -> np.ndarray:
    """A whole tensor as float32 in numpy order (loads it: meant for small tensors and tests)."""
    info = spec.tensors[name]
    raw = np.array(tensor_memmap(spec, name))
    if len(info.shape) == 1:
        raw = raw.reshape(1, -1)
        return dequantize_rows(raw, info).reshape(info.shape)
    return dequantize_rows(raw, info).reshape(info.shape)
