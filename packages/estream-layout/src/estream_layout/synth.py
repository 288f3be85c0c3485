"""Synthetic MoE models as GGUF files that llama.cpp itself would load.

Each architecture gets exactly the tensor names, shapes, types and metadata keys llama.cpp's
loader asks for (checked against `gguf.MODEL_TENSORS` and llama.cpp's `load_tensors`), filled
with random but well-scaled values: Q4_0 blocks whose scales keep activations O(1) through every
layer, RMS-norm weights near 1, and routers with a few hot experts so routing is uneven like in
real models. Tensor data is generated and written one tensor at a time, so the 4 GB
`olmoe-1b-7b` preset needs only ~100 MiB of memory.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
from gguf import (
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    Keys,
    LlamaFileType,
)
from gguf.constants import GGML_QUANT_SIZES

from .diskspace import check_disk_space
from .errors import InvalidArgumentError, InvalidGGUFError
from .families import BASE_PRESETS, BY_FAMILY, RECORDS, Plan, PlannedTensor
from .gguf_model import _open_header
from .pack import _Progress
from .tiles import quantize_mxfp4

__all__ = [
    "ARCHES",
    "DEFAULT_VOCABS",
    "PRESETS",
    "PRESET_ARCH",
    "VOCAB_DIR",
    "SynthDims",
    "find_vocab",
    "generate_bpe_vocab",
    "synth_dims",
    "synth_model",
]

# The families and their presets are the family records' (`estream_layout.families`).
ARCHES: Final = tuple(f.name for f in RECORDS)
PRESETS: Final = (*BASE_PRESETS, *(p for f in RECORDS for p in f.published))
# Presets that are the shape of one published model, hence of one architecture only.
PRESET_ARCH: Final = {p: f.name for f in RECORDS for p in f.published}
GGUF_ARCH: Final = {f.name: f.gguf_arch for f in RECORDS}
# Tokenizers of the real model families, copied from llama.cpp's models/ folder (MIT licence,
# beside them in VOCAB_DIR); they ship in this package so synthetic models behave the same
# wherever the package is installed.
VOCAB_DIR: Final = Path(__file__).resolve().parent / "data"
DEFAULT_VOCABS: Final = {f.name: f.vocab for f in RECORDS if f.vocab is not None}

Q4_0: Final = GGMLQuantizationType.Q4_0
Q8_0: Final = GGMLQuantizationType.Q8_0
F32: Final = GGMLQuantizationType.F32
F16: Final = GGMLQuantizationType.F16
Q4_K: Final = GGMLQuantizationType.Q4_K
Q5_K: Final = GGMLQuantizationType.Q5_K
Q6_K: Final = GGMLQuantizationType.Q6_K
MXFP4: Final = GGMLQuantizationType.MXFP4
IQ4_NL: Final = GGMLQuantizationType.IQ4_NL
Q4_1: Final = GGMLQuantizationType.Q4_1
Q5_0: Final = GGMLQuantizationType.Q5_0
Q5_1: Final = GGMLQuantizationType.Q5_1
IQ4_XS: Final = GGMLQuantizationType.IQ4_XS


@attrs.frozen
class SynthDims:
    """Shapes of a synthetic model (names follow llama.cpp's hparams)."""

    n_layers: int
    n_embd: int
    n_ff_exp: int
    n_ff: int  # dense FFN width (leading dense layers of deepseek2/lfm2moe)
    n_experts: int
    n_experts_used: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int  # size of a generated vocabulary (a vocab file overrides it)
    n_ctx: int = 4096
    n_shared_experts: int = 1  # deepseek2
    n_leading_dense: int = 1  # deepseek2, lfm2moe
    q_lora_rank: int = 32  # deepseek2
    kv_lora_rank: int = 32
    qk_rope_dim: int = 16
    qk_nope_dim: int = 32
    v_head_dim: int = 32
    l_cache: int = 3  # lfm2moe short convolution kernel
    # YaRN RoPE scaling (deepseek2): factor (0 = none), original context, log multiplier as
    # the converter writes it (0.1 * mscale_all_dim)
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_log_mul: float = 0.0

    # lfm2moe: the layers with attention (the others are short convolutions); None: the odd ones
    attention_layers: tuple[int, ...] | None = None
    # smallthinker: attention.sliding_window (0: none) and the router's gating function
    sliding_window: int = 0
    expert_gating: str = "sigmoid"

    def lfm2_is_attention(self, layer: int) -> bool:
        """Whether lfm2moe layer `layer` attends (else it is a short convolution)."""
        if self.attention_layers is None:
            return layer % 2 == 1
        return layer in self.attention_layers


#: `SynthDims` fields that count something (at least 1) and their largest accepted value.
_COUNT_DIMS: Final = {
    **dict.fromkeys(("n_layers", "n_experts", "n_experts_used", "n_head", "n_head_kv"), 1 << 12),
    **dict.fromkeys(("n_embd", "n_ff_exp", "n_ff", "head_dim", "l_cache"), 1 << 16),
    "n_vocab": 1 << 20,
    "n_ctx": 1 << 24,
}


def _check_dims(changes: Mapping[str, Any]) -> None:
    """Changed counts are integers from 1 to their bound (a 0 width divides by zero later, a
    billion layers never finishes)."""
    for name, v in changes.items():
        hi = _COUNT_DIMS.get(name)
        if hi is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
            raise InvalidArgumentError(f"{name} = {v!r}: must be an integer from 1 to {hi}")


def synth_dims(arch: str, preset: str) -> SynthDims:
    """The dimensions of a preset for an architecture (its family record's presets over the
    shared tiny/small/olmoe-1b-7b ones)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHES}")
    rec = BY_FAMILY[arch]
    if preset in BASE_PRESETS:
        return SynthDims(**{**BASE_PRESETS[preset], **rec.presets.get(preset, {})})
    if preset in PRESET_ARCH and arch != PRESET_ARCH[preset]:
        raise ValueError(
            f"preset {preset!r} is the shape of a {PRESET_ARCH[preset]} model; "
            f"use --arch {PRESET_ARCH[preset]}"
        )
    if preset in rec.published:
        return SynthDims(**rec.presets[preset])
    raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")


# ---------------------------------------------------------------------------------- vocab
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what tokenizer.ggml.tokens use)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def generate_bpe_vocab(n_tokens: int, seed: int = 0) -> dict[str, Any]:
    """A small valid GPT-2-style BPE vocabulary: 256 byte tokens, merges, two control tokens.

    Every merge `"a b"` joins two existing tokens into a new one that is in the vocabulary, so
    llama.cpp's BPE tokenizer accepts it. Returns tokenizer.ggml.* key -> value.
    """
    if n_tokens < 260:
        raise ValueError("a generated vocabulary needs at least 260 tokens")
    rng = np.random.default_rng([seed, 7])
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    have = set(tokens)
    merges: list[str] = []
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = np.array([12, 9, 8, 7.5, 7, 6.7, 6.3, 6, 5.9, 4.3, 4, 2.8, 2.8, 2.4, 2.2, 2.0, 2.0,
                        1.9, 1.5, 1.0, 0.8, 0.15, 0.1, 0.1, 0.1, 0.07])  # fmt: skip
    weights = weights / weights.sum()
    space = b2u[ord(" ")]
    n_words = n_tokens - 2
    attempts = 0
    while len(tokens) < n_words and attempts < 50 * n_tokens:
        attempts += 1
        length = int(rng.integers(2, 8))
        word = "".join(rng.choice(list(letters), size=length, p=weights))
        if rng.random() < 0.6:
            word = space + word
        for k in range(1, len(word)):
            left, right = word[:k], word[k]
            new = left + right
            if new not in have:
                merges.append(f"{left} {right}")
                tokens.append(new)
                have.add(new)
                if len(tokens) >= n_words:
                    break
    while len(tokens) < n_words:  # pragma: no cover - only for absurdly large requests
        tokens.append(f"<|unused_{len(tokens)}|>")
    n_normal = len(tokens)
    tokens += ["<|endoftext|>", "<|padding|>"]
    token_type = [1] * n_normal + [3, 3]
    eos = n_normal
    return {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "default",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: token_type,
        Keys.Tokenizer.MERGES: merges,
        Keys.Tokenizer.BOS_ID: eos,
        Keys.Tokenizer.EOS_ID: eos,
        Keys.Tokenizer.PAD_ID: eos + 1,
    }


def _vocab_dirs() -> Iterator[Path]:
    env = os.environ.get("ESTREAM_VOCAB_DIR")
    if env:
        yield Path(env)
    yield VOCAB_DIR


def find_vocab(arch: str) -> Path | None:
    """The real tokenizer GGUF for an architecture's family: from ``$ESTREAM_VOCAB_DIR`` if set
    and holding it, else the copy shipped in `VOCAB_DIR`; None for a family without one."""
    name = DEFAULT_VOCABS.get(arch)
    if name is None:
        return None
    for d in _vocab_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _read_vocab(path: Path) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """The tokenizer.ggml.* entries of a GGUF (an InvalidGGUFError if it is not one or has
    no token list)."""
    header = _open_header(path)
    tokens = header.kv.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InvalidGGUFError(
            f"vocabulary {path}: the GGUF has no tokenizer ({Keys.Tokenizer.LIST} is not a "
            "non-empty array of strings)"
        )
    return [
        (key, val, *header.kv_types[key])
        for key, val in header.kv.items()
        if key.startswith("tokenizer.ggml.")
    ]


# ---------------------------------------------------------------------------------- tensors
_T = PlannedTensor


def _tensor_plan(arch: str, d: SynthDims, n_vocab: int, expert_type: GGMLQuantizationType,
                 dense_type: GGMLQuantizationType, output_type: GGMLQuantizationType,
                 down_type: GGMLQuantizationType | None = None) -> list[_T]:  # fmt: skip
    """The tensors of a synthetic model in file order: the head, then each layer's as its
    family record plans them."""
    rec = BY_FAMILY[arch]
    plan = Plan(d, n_vocab, expert_type, dense_type, output_type, down_type)
    plan.head(rec.final_norm, tied=rec.final_norm == "token_embd_norm.weight")
    for i in range(d.n_layers):
        rec.synth_layer(plan, i)
    return plan.tensors


def _arch_keys(arch: str, d: SynthDims, n_vocab: int) -> list[tuple[str, Any, GGUFValueType]]:
    """The model's metadata: the keys every family has, then the family record's."""
    rec = BY_FAMILY[arch]
    U32, F32v, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    k = lambda key: key.format(arch=rec.gguf_arch)  # noqa: E731
    out: list[tuple[str, Any, GGUFValueType]] = [
        (k(Keys.LLM.VOCAB_SIZE), n_vocab, U32),
        (k(Keys.LLM.CONTEXT_LENGTH), d.n_ctx, U32),
        (k(Keys.LLM.EMBEDDING_LENGTH), d.n_embd, U32),
        (k(Keys.LLM.BLOCK_COUNT), d.n_layers, U32),
        (k(Keys.Attention.HEAD_COUNT), d.n_head, U32),
        (k(Keys.Attention.LAYERNORM_RMS_EPS), rec.rms_eps, F32v),
        (k(Keys.Rope.FREQ_BASE), rec.rope_base, F32v),
        (k(Keys.LLM.EXPERT_COUNT), d.n_experts, U32),
        (k(Keys.LLM.EXPERT_USED_COUNT), d.n_experts_used, U32),
    ]
    out += [(k(key), val, vtype) for key, val, vtype in rec.synth_keys(d)]
    out.append((Keys.General.NAME, f"estream-synth {arch}", STR))
    return out


# ---------------------------------------------------------------------------------- data
def _random_blocks(
    rng: np.random.Generator, t: _T, rows: int, qtype: GGMLQuantizationType
) -> np.ndarray:
    """Random valid Q4_0/Q8_0/IQ4_NL blocks for `rows` rows of `t`, scaled so that y = W x keeps the
    scale of x: per-element RMS ~ gain / sqrt(K)."""
    k = t.shape[-1]
    block, size = GGML_QUANT_SIZES[qtype]
    nb = rows * (k // block)
    n_words = -(-nb * size // 4)
    raw = rng.integers(0, 1 << 32, size=n_words, dtype=np.uint32).view(np.uint8)[: nb * size]
    blocks = raw.reshape(nb, size)
    # RMS of a uniform random nibble-8 / IQ4_NL table value / 4- or 5-bit q (Q4_1 / Q5_0, Q5_1,
    # their m kept small) / int8
    q_rms = {Q4_0: 4.64, IQ4_NL: 67.4, Q4_1: 9.0, Q5_0: 9.2, Q5_1: 18.3}.get(qtype, 73.9)
    d = t.gain / (q_rms * np.sqrt(k))
    # Signed scales, as llama.cpp's quantizer writes them (d = max / -8 takes the sign of the
    # largest-magnitude element): random nibbles have mean -0.5, and all-positive scales would
    # give every row the same offset, i.e. a rank-one component shared by all tokens.
    sign = rng.integers(0, 2, size=nb) * 2.0 - 1.0
    scales = (d * rng.uniform(0.75, 1.25, size=nb) * sign).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(nb, 2)
    if qtype in (Q4_1, Q5_1):  # m: minus half the block's range, so values centre on 0
        mins = (-scales.astype(np.float32) * (8.0 if qtype == Q4_1 else 16.0)).astype(np.float16)
        blocks[:, 2:4] = mins.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def _embedding(t: _T, rng: np.random.Generator, u: np.ndarray) -> np.ndarray:
    """Token embeddings `(z + u/2) / 2`: random rows sharing one common direction `u`.

    Trained models' hidden states share a few large directions; here `u` plays that role, and
    the routers' hot experts point along it (see `_router`), which is what makes routing skewed
    for real inputs. Generated and quantized in row chunks to bound memory.
    """
    n, k = t.shape
    block, size = GGML_QUANT_SIZES[t.qtype]
    out = np.empty((n, k // block * size), dtype=np.uint8)
    step = max(1, (8 << 20) // k)
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        # RMS ~0.5 per element: the residual stream starts at the scale the attention and
        # expert outputs add to it, so tokens stay distinguishable through the layers.
        w = (0.5 * (rng.standard_normal((rows, k)) + 0.5 * u)).astype(np.float32)
        if t.qtype == F32:
            out[r0 : r0 + rows] = w.view(np.uint8)
        elif t.qtype == F16:
            out[r0 : r0 + rows] = w.astype(np.float16).view(np.uint8)
        else:
            from gguf import quants as gguf_quants

            out[r0 : r0 + rows] = gguf_quants.quantize(w, t.qtype)
    if t.qtype == F32:
        return out.view(np.float32)
    if t.qtype == F16:
        return out.view(np.float16)
    return out


def _router(t: _T, rng: np.random.Generator, hot: np.ndarray | None, u: np.ndarray) -> np.ndarray:
    """Skewed router `[E, d]`: random rows (norm ~2, log-normal spread), plus, for the hot
    experts, a component along the common hidden direction `u` that lifts their logits by
    about half a standard deviation for typical inputs: they win the top-k more often than the
    others (a few times the mean load), while a prompt of a few hundred tokens still reaches
    nearly every expert — as in trained, load-balanced MoE models."""
    e, k = t.shape
    scale = np.exp(0.25 * rng.standard_normal(e))
    w = rng.standard_normal(t.shape) * (2.0 / np.sqrt(k)) * scale[:, None]
    u_hat = u / np.linalg.norm(u)
    # Rows orthogonal to the shared direction: otherwise every expert gets a large fixed offset
    # (w·u) and a handful of experts takes almost every route, unlike load-balanced models.
    w -= np.outer(w @ u_hat, u_hat)
    if hot is not None:
        # the normalised hidden state has a u-component of order sqrt(k/2)
        for rank, h in enumerate(hot):
            w[h] += (1.0 - 0.15 * rank) / np.sqrt(k / 2) * u_hat
    return w.astype(np.float32)


def _random_k_quant(
    rng: np.random.Generator, t: _T, rows: int, nbytes: int, q_max: int
) -> np.ndarray:
    """Random Q4_K / Q5_K super-blocks (``nbytes`` bytes: fp16 d, fp16 dmin, 12 B of 6-bit
    scales and mins, then the codes) whose values centre on 0: each sub-block's min equals its
    scale (``m_j = sc_j``) and ``dmin = d * q_max / 2``, so value = d·sc·(q − q_max/2), as a
    quantizer's block minimum sits about half a block's range below zero. (A random min puts
    every element's mean at ~0.7 of its RMS: the rows of every matrix then share one direction,
    all tokens' hidden states align with it and the router sends every token to the same
    experts.) d gives an element RMS of ~gain/sqrt(K): sc uniform in 0..63 has RMS 36.5."""
    k = t.shape[-1]
    nb = rows * (k // 256)
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    # the 12 scale bytes at 4..15: bytes 8..11 hold m_0..3 (low 6 bits) and m_4..7's top 2
    # bits as bytes 4..7 do for sc; bytes 12..15 hold sc_4..7's low 4 bits in the low nibble
    # and m_4..7's in the high one
    raw[:, 12:16] = (raw[:, 12:16] & 0x0F) | ((raw[:, 12:16] & 0x0F) << 4)
    raw[:, 8:12] = raw[:, 4:8]
    q_rms = np.sqrt(((q_max + 1) ** 2 - 1) / 12.0)
    d = (t.gain / (36.5 * q_rms * np.sqrt(k)) * rng.uniform(0.75, 1.25, size=nb)).astype(np.float16)
    dmin = (d.astype(np.float32) * (q_max / 2.0)).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    raw[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def _random_q4_k(rng: np.random.Generator, t: _T, rows: int) -> np.ndarray:
    """Random Q4_K super-blocks (144 B; q = 0..15), zero-centred (`_random_k_quant`)."""
    return _random_k_quant(rng, t, rows, 144, 15)


def _random_q5_k(rng: np.random.Generator, t: _T, rows: int) -> np.ndarray:
    """Random Q5_K super-blocks (176 B: Q4_K's fields, 32 B of fifth bits, 128 B of nibbles;
    q = 0..31), zero-centred (`_random_k_quant`)."""
    return _random_k_quant(rng, t, rows, 176, 31)


def _random_superblocks(
    rng: np.random.Generator, t: _T, rows: int, nbytes: int, rms: float, d_at: int
) -> np.ndarray:
    """Random super-blocks of 256 elements and ``nbytes`` bytes whose fp16 d (at byte ``d_at``)
    gives an element RMS of ~gain/sqrt(K); ``rms``: the RMS of the rest of an element's value
    (scale times code) for uniformly random bytes."""
    k = t.shape[-1]
    nb = rows * (k // 256)
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    d = (t.gain / (rms * np.sqrt(k)) * rng.uniform(0.75, 1.25, size=nb)).astype(np.float16)
    raw[:, d_at : d_at + 2] = d.view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def _random_q6_k(rng: np.random.Generator, t: _T, rows: int) -> np.ndarray:
    """Random Q6_K super-blocks (210 B: 128 B low nibbles, 64 B high bit pairs, 16 int8 scales,
    fp16 d); value = d * scale * (q - 32), scale any int8 (RMS ~74), q - 32 in -32..31 (RMS
    ~18.5)."""
    return _random_superblocks(rng, t, rows, 210, 1370.0, 208)


def _random_iq4_xs(rng: np.random.Generator, t: _T, rows: int) -> np.ndarray:
    """Random IQ4_XS super-blocks (136 B: fp16 d, 2 B scales_h, 4 B scales_l, 128 B of IQ4_NL
    codes); value = d * (ls - 32) * kv[code], ls - 32 in -32..31 (RMS ~18.5), kv RMS ~67.4."""
    return _random_superblocks(rng, t, rows, 136, 1246.0, 0)


def _random_mxfp4(rng: np.random.Generator, t: _T, rows: int) -> np.ndarray:
    """MXFP4 blocks (17 B: E8M0 exponent, 16 B of FP4 codes) of random weights with element RMS
    ~gain/sqrt(K), through this package's own quantizer (`tiles.quantize_mxfp4`), a few rows at
    a time."""
    k = t.shape[-1]
    out = np.empty((rows, k // 32 * 17), dtype=np.uint8)
    step = max(1, (1 << 18) // k)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        w = rng.standard_normal((n, k)) * (t.gain / np.sqrt(k))
        out[r0 : r0 + n] = quantize_mxfp4(w.astype(np.float32))
    return out


def _tensor_data(
    t: _T, rng: np.random.Generator, hot: np.ndarray | None, u: np.ndarray
) -> np.ndarray:
    rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
    k = t.shape[-1]
    if t.kind == "norm":
        return (1.0 + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)
    if t.kind == "bias":
        b = np.zeros(t.shape, dtype=np.float32)
        if hot is not None:
            b[hot] = 0.5  # selection bias towards the hot experts (sigmoid gating)
        return b
    if t.kind == "conv":
        return (rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])).astype(np.float32)
    if t.kind == "router":
        return _router(t, rng, hot, u)
    # gguf cannot quantize K-quants or IQ4_NL / IQ4_XS
    if t.kind == "embed" and t.qtype not in (Q4_K, Q5_K, Q6_K, IQ4_NL, Q4_1, Q5_0, Q5_1, IQ4_XS):
        return _embedding(t, rng, u)
    if t.qtype in (Q4_0, Q8_0, IQ4_NL, Q4_1, Q5_0, Q5_1):
        return _random_blocks(rng, t, rows, t.qtype)
    if t.qtype == Q4_K:
        return _random_q4_k(rng, t, rows)
    if t.qtype == Q5_K:
        return _random_q5_k(rng, t, rows)
    if t.qtype == Q6_K:
        return _random_q6_k(rng, t, rows)
    if t.qtype == IQ4_XS:
        return _random_iq4_xs(rng, t, rows)
    if t.qtype == MXFP4:
        return _random_mxfp4(rng, t, rows)
    w = (rng.standard_normal(t.shape) * (t.gain / np.sqrt(k))).astype(np.float32)
    if t.qtype == F16:
        return w.astype(np.float16)
    if t.qtype == F32:
        return w
    from gguf import quants as gguf_quants

    return np.asarray(gguf_quants.quantize(w, t.qtype), dtype=np.uint8)


def synth_model(
    arch: str,
    preset: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab: str | os.PathLike[str] | None = None,
    expert_type: str | None = None,
    dense_type: str = "Q4_0",
    output_type: str = "Q8_0",
    expert_down_type: str | None = None,
    dims: Mapping[str, int] | None = None,
    progress: bool = False,
    **overrides: int,
) -> Path:
    """Write a synthetic GGUF MoE model of `arch` at `preset` size to `path`; returns the path.

    `vocab`: a GGUF whose tokenizer.ggml.* keys are copied; by default the real tokenizer of the
    family (bundled in `VOCAB_DIR`) for the small and olmoe-1b-7b presets, and a generated GPT-2-style
    BPE vocabulary for tiny, when no file is found, or when `vocab` is "-". `expert_type`/`dense_type`/`output_type`
    are GGML type names (`expert_type` None: the family record's, Q4_0, or MXFP4 for gpt-oss;
    e.g. "Q8_0", "Q4_K", "Q6_K" experts, "F16" to exercise
    re-quantization); `expert_down_type` gives `ffn_down_exps` another type (Q4_K_M's mix:
    "Q4_K" experts with "Q6_K" down projections); `dims`
    (a mapping) and keyword `overrides` (any `SynthDims` field, e.g. `n_layers=12`) change preset dimensions.
    `progress` prints a progress line on stderr. Raises `InsufficientDiskSpaceError` before
    writing anything when the output's filesystem cannot hold the planned file.
    """
    # long: a third is the docstring of the synthesizer's options
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidArgumentError(f"seed {seed!r} must be an integer from 0 to 2**63 - 1")
    d = synth_dims(arch, preset)
    if expert_type is None:  # the family's own (gpt-oss: MXFP4, as published)
        expert_type = BY_FAMILY[arch].expert_type
    changes = {**(dims or {}), **overrides}
    if changes:
        unknown = set(changes) - {a.name for a in attrs.fields(SynthDims)}
        if unknown:
            raise TypeError(f"unknown synth dimension(s) {sorted(unknown)}")
        _check_dims(changes)
        d = attrs.evolve(d, **changes)
    vocab_path, vocab_kv, n_vocab = _vocabulary(arch, preset, vocab, d.n_vocab, seed)
    names = {expert_type, dense_type, output_type, expert_down_type or expert_type}
    qt = {n: GGMLQuantizationType[n] for n in names}
    plan = _tensor_plan(arch, d, n_vocab, qt[expert_type], qt[dense_type], qt[output_type],
                        qt[expert_down_type or expert_type])  # fmt: skip
    _check_blocks(plan)
    out = Path(path)
    data_bytes = sum(t.nbytes for t in plan)
    # header: the tokenizer (a few MiB for 152K tokens and their merges) plus tensor infos
    planned = data_bytes + 32 * len(plan) + (vocab_path.stat().st_size if vocab_path else 0)
    planned += 1 << 20
    # written beside `out` under a temporary name and renamed over it once complete: a run that
    # is killed leaves no partial GGUF under the name (an existing file stays until the rename)
    check_disk_space(out, planned, f"writing {out.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = _Progress(data_bytes, f"synthesizing {out.name}", progress)
    # the name first, the file made under it inside the `try` that removes it: an interrupt at
    # any moment leaves nothing behind
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(6)}"
    made: Path | None = tmp  # what the handler below removes (None: nothing made here)
    try:
        try:  # the mode a plain new file gets (the umask's)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        except OSError:
            made = None
            raise
        writer = GGUFWriter(tmp, GGUF_ARCH[arch])
    except BaseException:
        if made is not None:
            made.unlink(missing_ok=True)
        raise
    try:
        _add_header(writer, arch, d, n_vocab, expert_type, vocab_kv, plan)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # the common hidden-state direction shared by the embeddings and the hot router rows
        u = np.random.default_rng([seed, 3]).standard_normal(d.n_embd)
        u *= np.sqrt(d.n_embd) / np.linalg.norm(u)
        for i, t in enumerate(plan):
            rng = np.random.default_rng([seed, 100 + i])
            hot = None
            if t.kind in ("router", "bias"):  # same hot experts for a layer's router and bias
                layer_rng = np.random.default_rng([seed, 2, _layer_of(t.name)])
                hot = layer_rng.permutation(d.n_experts)[: min(4, max(1, d.n_experts // 8))]
            data = _tensor_data(t, rng, hot, u)
            assert data.nbytes == t.nbytes, (t.name, data.nbytes, t.nbytes)
            writer.write_tensor_data(np.ascontiguousarray(data))
            del data
            bar.update(t.nbytes)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    bar.close()
    return out


def _vocabulary(
    arch: str, preset: str, vocab: str | os.PathLike[str] | None, n_vocab: int, seed: int
) -> tuple[Path | None, list[tuple[str, Any, GGUFValueType, GGUFValueType | None]], int]:
    """The tokenizer keys `synth_model` writes (see its ``vocab``), the file they come from
    (None: generated) and the vocabulary size."""
    vocab_path: Path | None
    if vocab == "-":  # asked for explicitly: a generated vocabulary, whatever the preset
        vocab_path = None
    elif vocab is not None:
        vocab_path = Path(vocab)
        if not vocab_path.exists():  # asked for by name: never silently substitute another
            raise InvalidGGUFError(f"vocabulary {vocab}: no such file")
        if not vocab_path.is_file():
            raise InvalidGGUFError(f"vocabulary {vocab}: not a regular file")
    else:
        vocab_path = find_vocab(arch) if preset != "tiny" else None
    if vocab_path is not None:
        vocab_kv = _read_vocab(vocab_path)
        return (
            vocab_path,
            vocab_kv,
            next(len(v) for k, v, _, _ in vocab_kv if k == Keys.Tokenizer.LIST),
        )
    gen = generate_bpe_vocab(n_vocab, seed)
    kv: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = []
    for key, val in gen.items():
        if isinstance(val, list):
            sub = GGUFValueType.STRING if isinstance(val[0], str) else GGUFValueType.INT32
            kv.append((key, val, GGUFValueType.ARRAY, sub))
        elif isinstance(val, str):
            kv.append((key, val, GGUFValueType.STRING, None))
        else:
            kv.append((key, val, GGUFValueType.UINT32, None))
    return None, kv, len(gen[Keys.Tokenizer.LIST])


def _check_blocks(plan: list[_T]) -> None:
    """Every tensor's rows are whole blocks of its type."""
    for t in plan:
        block = GGML_QUANT_SIZES[t.qtype][0]
        if t.shape[-1] % block:
            raise ValueError(
                f"{t.name}: row length {t.shape[-1]} is not a multiple of the {t.qtype.name} "
                f"block size {block}; choose other dimensions or types"
            )


def _add_header(
    writer: GGUFWriter,
    arch: str,
    d: SynthDims,
    n_vocab: int,
    expert_type: str,
    vocab_kv: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]],
    plan: list[_T],
) -> None:
    """The model's metadata (architecture keys, file type, tokenizer) and tensor infos."""
    for key, val, vtype in _arch_keys(arch, d, n_vocab):
        writer.add_key_value(key, val, vtype)
    rec = BY_FAMILY[arch]
    if rec.synth_kv_array:  # per layer, 0 for a convolution
        kv = [d.n_head_kv if d.lfm2_is_attention(i) else 0 for i in range(d.n_layers)]
        writer.add_key_value(
            Keys.Attention.HEAD_COUNT_KV.format(arch=rec.gguf_arch),
            kv,
            GGUFValueType.ARRAY,
            GGUFValueType.UINT32,
        )
    file_type = {
        "Q4_0": LlamaFileType.MOSTLY_Q4_0,
        "Q8_0": LlamaFileType.MOSTLY_Q8_0,
        "F16": LlamaFileType.MOSTLY_F16,
        "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
    }.get(expert_type, LlamaFileType.GUESSED)
    writer.add_key_value(Keys.General.FILE_TYPE, int(file_type), GGUFValueType.UINT32)
    writer.add_key_value(Keys.General.QUANTIZATION_VERSION, 2, GGUFValueType.UINT32)
    for key, val, vtype, sub in vocab_kv:
        writer.add_key_value(key, val, vtype, sub)
    for t in plan:
        if t.qtype in (F32, F16):
            dtype = np.float32 if t.qtype == F32 else np.float16
            writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), t.nbytes)
        else:
            block, size = GGML_QUANT_SIZES[t.qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, t.qtype)


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else -1
