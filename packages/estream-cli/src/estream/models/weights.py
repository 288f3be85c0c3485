"""The typed weight records a layer is written over, and their binding from a packed model.

Everything an architecture may vary is a field of a record, bound once from the model's
`ModelSpec` (RoPE style and scaling, q/k-norm kind, gating function, top-k renormalisation,
selection bias), never a flag the forward pass branches on per call. The `bind_*` functions
read a layer's tensors from a `PackedModel` by their GGUF names.
"""

from __future__ import annotations

import math
from typing import Generic, TypeVar

import attrs
import numpy as np

import estream_htp as htp
from estream_layout import ModelSpec, dequantize_tiles

from ..errors import PackError, UnsupportedModelError
from ..packed import DenseTensor, ExpertLayer, PackedModel

__all__ = [
    "FFN",
    "Attention",
    "Gating",
    "Head",
    "MoE",
    "Rope",
    "ShortConv",
    "Weights",
    "bind_attention",
    "bind_ffn",
    "bind_head",
    "bind_moe",
    "bind_short_conv",
    "dequantize",
    "yarn_factor",
    "yarn_log_mul",
]

L = TypeVar("L")

# llama.cpp's rope type name -> the estream-htp kernel's name for the same rotation.
_HTP_ROPE = {"norm": "normal", "neox": "neox"}


# -- typed weights ------------------------------------------------------------------------------
@attrs.frozen
class Rope:
    """Rotary position embedding as llama.cpp applies it for a family (`ggml_rope_ext`).

    Under YaRN (``rope.scaling.type = yarn``) ``ext_factor`` is 1, ``corr_dims`` are the ramp
    limits and ``attn_factor`` the magnitude factor `llama_context` passes (see `yarn_factor`);
    otherwise they are 0, (0, 0) and 1 and the rotation is the plain one."""

    n_rot: int
    freq_base: float
    freq_scale: float
    kind: str  # "normal" (adjacent pairs, LLAMA_ROPE_TYPE_NORM) | "neox" (split halves)
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    corr_dims: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def from_spec(cls, hp: ModelSpec, n_rot: int | None = None) -> Rope:
        """The spec's RoPE over its first ``n_rot`` dims (default: ``rope.dimension_count``)."""
        n_rot = hp.rope_dims if n_rot is None else n_rot
        kind = _HTP_ROPE[hp.rope_type]
        if hp.rope_scaling_type in ("none", "linear"):
            return cls(n_rot, hp.rope_freq_base, hp.rope_freq_scale, kind, 0.0, hp.rope_attn_factor)
        if hp.rope_scaling_type != "yarn":
            raise UnsupportedModelError(
                f"RoPE scaling {hp.rope_scaling_type!r} is not implemented for {hp.arch!r} "
                "(only none, linear and yarn)"
            )
        if hp.rope_n_ctx_orig < 1:
            raise UnsupportedModelError(
                f"{hp.arch!r} uses YaRN RoPE but has no original context length "
                "(rope.scaling.original_context_length or context_length)"
            )
        corr = htp.rope_yarn_corr_dims(n_rot, hp.rope_n_ctx_orig, hp.rope_freq_base)
        return cls(n_rot, hp.rope_freq_base, hp.rope_freq_scale, kind, 1.0, yarn_factor(hp), corr)


def yarn_log_mul(hp: ModelSpec) -> float:
    """`rope.scaling.yarn_log_multiplier` the way llama.cpp uses it: the converter stores
    ``0.1 * mscale_all_dim`` and the formulas below take ``mscale_all_dim``."""
    return hp.rope_yarn_log_mul / 0.1


def yarn_factor(hp: ModelSpec) -> float:
    """The ``attn_factor`` llama.cpp's `llama_context` hands to RoPE under YaRN.

    It cancels the kernel's own ``1 + 0.1 ln(s)`` magnitude correction and applies
    DeepSeek's ``mscale(s, m) = 1 + 0.1 m ln(s)`` ratio instead (``s = 1/freq_scale``, ``m``
    the log multiplier; for deepseek2 the two mscales are equal, so RoPE leaves magnitudes
    alone and the correction goes into the attention scale), times ``rope.scaling.attn_factor``.
    """
    s = 1.0 / hp.rope_freq_scale

    def mscale(m: float) -> float:
        return 1.0 if s <= 1.0 else 1.0 + 0.1 * m * math.log(s)

    m_all = yarn_log_mul(hp)
    if m_all != 0.0:
        factor = mscale(m_all if hp.arch == "deepseek2" else 1.0) / mscale(m_all)
    else:
        factor = mscale(1.0)
    return factor / (1.0 + 0.1 * math.log(s)) * hp.rope_attn_factor


@attrs.frozen
class Attention:
    """Grouped-query self-attention with RoPE (and q/k RMSNorm where the family has it).

    ``rope`` None: a NoPE layer (no rotation). ``window`` > 0: each query sees the last
    ``window`` positions only (a sliding layer)."""

    wq: DenseTensor
    wk: DenseTensor
    wv: DenseTensor
    wo: DenseTensor
    n_head: int
    n_head_kv: int
    head_dim: int
    rope: Rope | None
    qk_norm: str = "none"  # "none" | "full" (whole projection) | "head" (per head)
    q_norm: np.ndarray | None = attrs.field(default=None, eq=False)
    k_norm: np.ndarray | None = attrs.field(default=None, eq=False)
    window: int = 0

    def __attrs_post_init__(self) -> None:
        if self.qk_norm not in ("none", "full", "head"):
            raise ValueError(f"qk_norm must be none, full or head, got {self.qk_norm!r}")
        if self.qk_norm != "none" and (self.q_norm is None or self.k_norm is None):
            raise ValueError(f"qk_norm {self.qk_norm!r} needs both q_norm and k_norm weights")

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


@attrs.frozen
class ShortConv:
    """LFM2's gated short convolution (llama.cpp `build_shortconv_block`): ``in_proj`` makes
    three gates B, C, x; ``out_proj(C * conv(B * x))`` with a causal depthwise convolution of
    ``taps`` (`shortconv.l_cache`) over the tokens, the last tap on the current token."""

    in_proj: DenseTensor  # [3 d, d]: B, C, x in that order
    kernel: np.ndarray = attrs.field(eq=False)  # [d, taps] f32
    out_proj: DenseTensor  # [d, d]

    def __attrs_post_init__(self) -> None:
        d = self.out_proj.shape[0]
        if self.in_proj.shape[0] != 3 * d or self.kernel.ndim != 2 or self.kernel.shape[0] != d:
            raise ValueError(
                f"short convolution shapes disagree: in_proj {self.in_proj.shape}, kernel "
                f"{self.kernel.shape}, out_proj {self.out_proj.shape} (expected [3d, d], [d, taps], "
                "[d, d])"
            )


@attrs.frozen
class FFN:
    """A dense SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`."""

    gate: DenseTensor
    up: DenseTensor
    down: DenseTensor


@attrs.frozen
class Gating:
    """How the router turns logits into the top-k experts and their weights (`build_moe_ffn`).

    ``func`` is llama.cpp's gating function (softmax, or sigmoid for DeepSeek-V3-style and LFM2
    routers); ``norm`` renormalises the selected weights to sum to 1; ``scale`` multiplies
    them afterwards."""

    func: str  # "softmax" | "sigmoid"
    n_used: int
    norm: bool
    scale: float

    @classmethod
    def from_spec(cls, hp: ModelSpec) -> Gating:
        return cls(
            hp.expert_gating_func,
            hp.n_experts_used,
            hp.expert_weights_norm,
            hp.expert_weights_scale,
        )


@attrs.frozen
class MoE:
    """One layer's routed experts: the router, its gating, where the experts are stored, and
    their gated activation (``glu``: "swiglu", "reglu" or "swiglu_oai")."""

    experts: ExpertLayer
    router: np.ndarray = attrs.field(eq=False)  # [d, E], transposed for x @ W
    gating: Gating
    bias: np.ndarray | None = attrs.field(default=None, eq=False)  # selection-only (exp_probs_b)
    glu: str = "swiglu"
    # added to the router's logits (gpt-oss's ffn_gate_inp.bias)
    logit_bias: np.ndarray | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Head:
    """Token embedding, final norm and output projection (tied to the embedding if absent)."""

    tok_embd: DenseTensor
    norm: np.ndarray = attrs.field(eq=False)
    output: DenseTensor


@attrs.frozen
class Weights(Generic[L]):
    """All resident weights of a model: the head and one typed block per layer."""

    head: Head
    layers: tuple[L, ...]


# -- binding ------------------------------------------------------------------------------------
def bind_head(model: PackedModel, norm: str = "output_norm.weight") -> Head:
    tok_embd = model.dense("token_embd.weight")
    output = model.dense("output.weight") if model.has("output.weight") else tok_embd
    return Head(tok_embd, model.dense(norm).f32(), output)


def bind_attention(model: PackedModel, i: int) -> Attention:
    """Layer `i`'s `attn_q/k/v/output` (and q/k norms when the spec says the family has them)."""
    hp = model.hparams
    p = f"blk.{i}."
    q_norm = k_norm = None
    if hp.qk_norm != "none":
        q_norm = model.dense(p + "attn_q_norm.weight").f32()
        k_norm = model.dense(p + "attn_k_norm.weight").f32()
    return Attention(
        wq=model.dense(p + "attn_q.weight"),
        wk=model.dense(p + "attn_k.weight"),
        wv=model.dense(p + "attn_v.weight"),
        wo=model.dense(p + "attn_output.weight"),
        n_head=hp.n_head,
        n_head_kv=hp.n_head_kv[i],
        head_dim=hp.head_dim_k,
        rope=None if i in hp.nope_layers else Rope.from_spec(hp),
        qk_norm=hp.qk_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        window=hp.sliding_window if i in hp.swa_layers else 0,
    )


def bind_ffn(model: PackedModel, i: int, tag: str = "") -> FFN:
    """Layer `i`'s dense SwiGLU `ffn_{gate,up,down}{tag}` (tag "_shexp" for shared experts)."""
    p = f"blk.{i}.ffn_"
    return FFN(
        model.dense(f"{p}gate{tag}.weight"),
        model.dense(f"{p}up{tag}.weight"),
        model.dense(f"{p}down{tag}.weight"),
    )


def bind_short_conv(model: PackedModel, i: int) -> ShortConv:
    """Layer `i`'s `shortconv.{in_proj,conv,out_proj}` (an lfm2moe layer with no KV heads)."""
    p = f"blk.{i}.shortconv."
    kernel = model.dense(p + "conv.weight").f32()
    taps = model.hparams.shortconv_l_cache
    if kernel.ndim != 2 or kernel.shape[1] != taps:
        raise PackError(
            f"{model.path}: {p}conv.weight has shape {kernel.shape}, expected "
            f"[n_embd, shortconv.l_cache = {taps}]"
        )
    return ShortConv(
        in_proj=model.dense(p + "in_proj.weight"),
        kernel=np.ascontiguousarray(kernel),
        out_proj=model.dense(p + "out_proj.weight"),
    )


def bind_moe(model: PackedModel, i: int) -> MoE:
    """Layer `i`'s router (`ffn_gate_inp`, optional `exp_probs_b` and logit bias
    `ffn_gate_inp.bias`) and its packed experts."""
    experts = model.layers.get(i)
    if experts is None:
        raise PackError(f"{model.path}: layer {i} should have experts, the pack has none")
    router = model.dense(f"blk.{i}.ffn_gate_inp.weight").f32()
    bias_name = f"blk.{i}.exp_probs_b.bias"
    bias = model.dense(bias_name).f32() if model.has(bias_name) else None
    logit_name = f"blk.{i}.ffn_gate_inp.bias"
    return MoE(
        experts=experts,
        router=np.ascontiguousarray(router.T),
        gating=Gating.from_spec(model.hparams),
        bias=bias,
        glu=model.hparams.expert_glu,
        logit_bias=model.dense(logit_name).f32() if model.has(logit_name) else None,
    )


def dequantize(t: DenseTensor) -> np.ndarray:
    """A resident tensor's values as float32 in its logical shape (tiled formats exactly
    dequantized): for weights a layer needs in another orientation than the one packed."""
    if t.fmt == "f32":
        return t.f32()
    n, k = t.shape[-2], t.shape[-1]
    return dequantize_tiles(t.data, n, k, t.fmt).reshape(t.shape)
