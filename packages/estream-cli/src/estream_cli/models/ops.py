"""Shared building blocks of the per-architecture forward passes.

The role of llama.cpp's graph builders (`build_norm`, `build_attn`, `build_ffn`,
`build_moe_ffn`): each architecture module (`olmoe.py`, `qwen3moe.py`, `llama.py`, …) binds its
weights into the typed blocks below and writes its layer as a few calls on an `Ops`. Everything
an architecture may vary is a parameter of a block, bound once from the model's `ModelSpec`
(RoPE style and scaling, q/k-norm kind, gating function, top-k renormalisation, selection bias),
never a flag the forward pass branches on per call.

`Ops` also owns the one side effect a layer has: routed experts run through the engine's
`ExpertSource`, and `Ops` notes when the expert phase of each layer ran so that the engine's loop,
not the layer, can turn it into spans and metrics. It also times every kernel call it makes
(`op_spans`: q/k/v projections, attention, output projection, norms, RoPE, router, dense FFN,
output head, ...) so a trace shows where a prefill spends its non-expert time.
"""

from __future__ import annotations

import math
import time
from typing import Generic, TypeVar

import attrs
import numpy as np

import estream_htp as htp
from estream_layout import ModelSpec, dequantize_tiles

from ..errors import PackError, UnsupportedModelError
from ..experts import ExpertSource
from ..packed import DenseTensor, ExpertLayer, PackedModel

__all__ = [
    "FFN",
    "Attention",
    "Branches",
    "Gating",
    "Head",
    "MoE",
    "Ops",
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

# A shared prefix and its branches: (prefix length, [(start, length) of each branch]).
Branches = tuple[int, list[tuple[int, int]]]


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
    """Grouped-query self-attention with RoPE (and q/k RMSNorm where the family has it)."""

    wq: DenseTensor
    wk: DenseTensor
    wv: DenseTensor
    wo: DenseTensor
    n_head: int
    n_head_kv: int
    head_dim: int
    rope: Rope
    qk_norm: str = "none"  # "none" | "full" (whole projection) | "head" (per head)
    q_norm: np.ndarray | None = attrs.field(default=None, eq=False)
    k_norm: np.ndarray | None = attrs.field(default=None, eq=False)

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
    """One layer's routed experts: the router, its gating, and where the experts are stored."""

    experts: ExpertLayer
    router: np.ndarray = attrs.field(eq=False)  # [d, E], transposed for x @ W
    gating: Gating
    bias: np.ndarray | None = attrs.field(default=None, eq=False)  # selection-only (exp_probs_b)


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
        rope=Rope.from_spec(hp),
        qk_norm=hp.qk_norm,
        q_norm=q_norm,
        k_norm=k_norm,
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
    """Layer `i`'s router (`ffn_gate_inp`, optional `exp_probs_b`) and its packed experts."""
    experts = model.layers.get(i)
    if experts is None:
        raise PackError(f"{model.path}: layer {i} should have experts, the pack has none")
    router = model.dense(f"blk.{i}.ffn_gate_inp.weight").f32()
    bias_name = f"blk.{i}.exp_probs_b.bias"
    bias = model.dense(bias_name).f32() if model.has(bias_name) else None
    return MoE(
        experts=experts,
        router=np.ascontiguousarray(router.T),
        gating=Gating.from_spec(model.hparams),
        bias=bias,
    )


def dequantize(t: DenseTensor) -> np.ndarray:
    """A resident tensor's values as float32 in its logical shape (tiled formats exactly
    dequantized): for weights a layer needs in another orientation than the one packed."""
    if t.fmt == "f32":
        return t.f32()
    n, k = t.shape[-2], t.shape[-1]
    return dequantize_tiles(t.data, n, k, t.fmt).reshape(t.shape)


# -- the operations a layer is written with -----------------------------------------------------
class Ops:
    """The operations of one forward pass: kernels, the attention mask, the expert source.

    Made per request by the engine. ``branches`` switches attention from plain causal to a
    shared prefix plus branches (see `Engine.prefill_branches`). ``expert_phases`` collects the
    (start, end) time of every routed-expert phase, in order, for the engine's loop;
    ``op_spans`` the (op, start, end) of every other kernel call (leaf calls only: spans never
    nest, so their durations add up).

    ``attn_products`` is how the attention kernel multiplies: "f32" (exact) or "bf16" (q, k, v
    and the softmax weights rounded to bfloat16, fp32 sums; the engine uses it with q8
    activations)."""

    def __init__(
        self,
        hp: ModelSpec,
        experts: ExpertSource,
        branches: Branches | None = None,
        *,
        attn_products: str = "f32",
    ) -> None:
        self.hp = hp
        self.experts = experts
        self.branches = branches
        self.attn_products = attn_products
        self.expert_phases: list[tuple[float, float]] = []
        self.op_spans: list[tuple[str, float, float]] = []

    def _span(self, name: str, t0: float) -> None:
        self.op_spans.append((name, t0, time.perf_counter()))

    # primitives
    def matmul(self, x: np.ndarray, w: DenseTensor, op: str = "matmul") -> np.ndarray:
        """`x @ w.T` for a resident matrix (tiled Q4_0/Q8_0 through the kernels, or f32);
        timed as ``op``."""
        t0 = time.perf_counter()
        if w.fmt == "f32":
            y = x @ w.f32().T
        else:
            y = htp.gemm(x, w.data, w.shape[0], w.fmt)
        self._span(op, t0)
        return y

    def rms_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        y = htp.rms_norm(x, w, self.hp.rms_eps)
        self._span("norm", t0)
        return y

    def rope(self, x: np.ndarray, pos: np.ndarray, r: Rope) -> None:
        """RoPE, in place, on the first ``r.n_rot`` dims of each head of ``x [T, H, D]``."""
        t0 = time.perf_counter()
        htp.rope(
            x, pos, r.n_rot, r.freq_base, r.freq_scale, r.kind,  # type: ignore[arg-type]
            ext_factor=r.ext_factor, attn_factor=r.attn_factor, corr_dims=r.corr_dims,
        )  # fmt: skip
        self._span("rope", t0)

    def embed(self, head: Head, ids: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        e = head.tok_embd
        y = htp.get_rows(e.data, e.fmt, self.hp.n_vocab, self.hp.n_embd, ids)
        self._span("embed", t0)
        return y

    def output(self, head: Head, h: np.ndarray) -> np.ndarray:
        """Logits `[rows, n_vocab]` of final-normed hidden states `h`."""
        return self.matmul(h, head.output, "output_head")[:, : self.hp.n_vocab]

    # blocks
    def attention(self, w: Attention, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """q/k/v projections, q/k RMSNorm, RoPE, causal GQA attention, output projection."""
        t = h.shape[0]
        eps = self.hp.rms_eps
        q = self.matmul(h, w.wq, "attn_q")
        k = self.matmul(h, w.wk, "attn_k")
        v = self.matmul(h, w.wv, "attn_v")
        t0 = time.perf_counter()
        # in place: q and k are this call's own GEMM outputs
        if w.qk_norm == "full":
            q = htp.rms_norm(q, w.q_norm, eps, out=q)
            k = htp.rms_norm(k, w.k_norm, eps, out=k)
        elif w.qk_norm == "head":
            assert w.q_norm is not None and w.k_norm is not None  # checked at construction
            q = htp.rms_norm_heads(q, w.q_norm, w.n_head, eps, out=q)
            k = htp.rms_norm_heads(k, w.k_norm, w.n_head_kv, eps, out=k)
        if w.qk_norm != "none":
            self._span("qk_norm", t0)
        q = np.ascontiguousarray(q.reshape(t, w.n_head, w.head_dim))
        k = np.ascontiguousarray(k.reshape(t, w.n_head_kv, w.head_dim))
        v = np.ascontiguousarray(v.reshape(t, w.n_head_kv, -1))
        self.rope(q, pos, w.rope)
        self.rope(k, pos, w.rope)
        a = self.attend(q, k, v, w.scale)
        return self.matmul(a.reshape(t, -1), w.wo, "attn_out")

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """softmax(q kᵀ · scale) v under this request's mask: `q [T, H, D]`, `k, v [T, Hkv, ·]`."""
        t0 = time.perf_counter()
        if self.branches is None:
            a = htp.attention(q, k, v, scale, causal=True, products=self.attn_products)
        else:
            a = _branch_attention(q, k, v, scale, *self.branches, products=self.attn_products)
        self._span("attention", t0)
        return a

    def short_conv(self, w: ShortConv, h: np.ndarray) -> np.ndarray:
        """B, C, x = in_proj(h); out_proj(C * conv(B * x)), the convolution causal per sequence."""
        d = w.out_proj.shape[0]
        bcx = self.matmul(h, w.in_proj, "conv_in")
        t0 = time.perf_counter()
        bx = bcx[:, :d] * bcx[:, 2 * d : 3 * d]
        y = bcx[:, d : 2 * d] * self.causal_conv(bx, w.kernel)
        self._span("short_conv", t0)
        return self.matmul(y, w.out_proj, "conv_out")

    def causal_conv(self, x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
        """Depthwise causal convolution of ``x[T, C]`` along the tokens of each sequence.

        With branches, the prefix is one sequence and each branch continues it: a branch's
        first rows see the prefix's last ``taps - 1`` rows (zeros before the first token), never
        another branch's rows, exactly as if ``prefix + branch`` were prefilled alone."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.branches is None:
            return htp.conv1d_causal(x, kernel)
        n_prefix, segments = self.branches
        taps = kernel.shape[1]
        out = np.empty_like(x)
        if n_prefix:
            out[:n_prefix] = htp.conv1d_causal(np.ascontiguousarray(x[:n_prefix]), kernel)
        history = np.zeros((taps - 1, x.shape[1]), dtype=np.float32)
        keep = min(taps - 1, n_prefix)
        if keep:
            history[taps - 1 - keep :] = x[n_prefix - keep : n_prefix]
        for s, n in segments:
            out[s : s + n] = htp.conv1d_causal(np.ascontiguousarray(x[s : s + n]), kernel, history)
        return out

    def dense_ffn(self, h: np.ndarray, w: FFN) -> np.ndarray:
        g = self.matmul(h, w.gate, "ffn")
        u = self.matmul(h, w.up, "ffn")
        t0 = time.perf_counter()
        a = htp.swiglu(g, u)
        self._span("ffn", t0)
        return self.matmul(a, w.down, "ffn")

    def moe(self, h: np.ndarray, w: MoE) -> np.ndarray:
        """Route each token to its top-k experts and sum their SwiGLU outputs, weighted.

        The router runs here (resident); the experts run through the expert source, which the
        engine's loop told at layer start to begin reading this layer's experts."""
        g = w.gating
        t0 = time.perf_counter()
        ids, weights = htp.router_topk(
            h @ w.router, g.n_used, gating=g.func, norm=g.norm, scale=g.scale, bias=w.bias
        )  # type: ignore[arg-type]
        self._span("router", t0)
        y = np.zeros((h.shape[0], self.hp.n_embd), dtype=np.float32)
        t0 = time.perf_counter()
        self.experts.run_layer(w.experts, h, ids, weights, y)
        self.expert_phases.append((t0, time.perf_counter()))
        return y


def _branch_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    n_prefix: int,
    segments: list[tuple[int, int]],
    *,
    products: str = "f32",
) -> np.ndarray:
    """Shared prefix (causal) + branches that each see the prefix and themselves (causal).

    The prefix goes through the tiled kernel; each branch is short and attends to
    ``n_prefix + len`` keys, done with BLAS (float32) per branch — with the kernel's rounding
    of ``q·scale``, ``k``, ``v`` and the softmax weights when ``products`` is "bf16", so that a
    branch sees what a separate prefill of ``prefix + branch`` would."""
    n_head, n_head_kv = q.shape[1], k.shape[1]
    bf16 = products == "bf16"
    out = np.empty((q.shape[0], n_head, v.shape[2]), dtype=np.float32)
    P = n_prefix
    out[:P] = htp.attention(q[:P], k[:P], v[:P], scale, causal=True, products=products)
    rep = n_head // n_head_kv
    for s, n in segments:
        kk = np.concatenate((k[:P], k[s : s + n]))  # [P+n, Hkv, D]
        vv = np.concatenate((v[:P], v[s : s + n]))
        kk = np.repeat(kk, rep, axis=1).transpose(1, 2, 0)  # [H, D, P+n]
        vv = np.repeat(vv, rep, axis=1).transpose(1, 0, 2)  # [H, P+n, Dv]
        qq = q[s : s + n].transpose(1, 0, 2)  # [H, n, D]
        if bf16:
            kk, vv = htp.round_bf16(kk), htp.round_bf16(vv)
            sc = np.matmul(htp.round_bf16(qq * np.float32(scale)), kk)  # [H, n, P+n]
        else:
            sc = np.matmul(qq, kk) * np.float32(scale)  # [H, n, P+n]
        mask = np.triu(np.ones((n, n), dtype=bool), k=1)
        sc[:, :, P:][:, mask] = -np.inf
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        if bf16:
            sc = htp.round_bf16(sc)
        sc /= sc.sum(axis=-1, keepdims=True)
        out[s : s + n] = np.matmul(sc, vv).transpose(1, 0, 2)
    return out
