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
from collections.abc import Callable, Sequence
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
    "Gating",
    "Head",
    "MoE",
    "Ops",
    "Rope",
    "Segment",
    "SeqLayout",
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


# -- how the rows of a pass are sequences -------------------------------------------------------
@attrs.frozen
class Segment:
    """Rows ``start .. start + length`` of a pass: consecutive tokens of one sequence.

    A segment with ``parent = -1`` starts a sequence (positions from 0, no history); otherwise
    it *continues* segment ``parent`` (a branch after its shared prefix): it attends to all of
    its ancestors' rows and causally to its own, its positions follow theirs (``pos0`` = their
    total length) and a short convolution sees their last rows as its history."""

    start: int
    length: int
    parent: int = -1
    pos0: int = 0


@attrs.frozen
class SeqLayout:
    """The sequence structure of one forward pass over packed rows.

    ``segments`` in row order; ``requests`` the row range ``[start, end)`` of each request (a
    root segment and the segments that continue it, contiguous). Attention is block-diagonal
    over requests and causal within each sequence; every op whose per-row result could depend
    on how many rows it is given (BLAS f32 products) runs per request, so a request's numbers
    do not depend on what it was packed with."""

    segments: tuple[Segment, ...]
    requests: tuple[tuple[int, int], ...]

    @classmethod
    def pack(cls, requests: Sequence[Sequence[int]]) -> SeqLayout:
        """Requests given as segment lengths: ``[n]`` a plain sequence of ``n`` tokens;
        ``[p, n1, n2, ...]`` a prefix of ``p`` tokens and branches of ``n1, n2, ...`` that each
        continue it. Rows are laid out request after request, prefix before its branches."""
        segs: list[Segment] = []
        spans: list[tuple[int, int]] = []
        row = 0
        for lens in requests:
            if not lens or any(int(n) < 1 for n in lens):
                raise ValueError(f"segment lengths must be positive, got {list(lens)}")
            first = row
            root = len(segs)
            segs.append(Segment(row, int(lens[0])))
            row += int(lens[0])
            for n in lens[1:]:
                segs.append(Segment(row, int(n), root, int(lens[0])))
                row += int(n)
            spans.append((first, row))
        return cls(tuple(segs), tuple(spans))

    @property
    def n_rows(self) -> int:
        return self.requests[-1][1] if self.requests else 0

    @property
    def single(self) -> bool:
        """One plain sequence: the whole pass is one causal attention."""
        return len(self.segments) == 1

    def positions(self) -> np.ndarray:
        pos = np.empty(self.n_rows, dtype=np.int32)
        for s in self.segments:
            pos[s.start : s.start + s.length] = np.arange(s.pos0, s.pos0 + s.length)
        return pos

    def context(self, i: int) -> list[Segment]:
        """The ancestors of segment ``i``, root first (empty for a root)."""
        out = []
        j = self.segments[i].parent
        while j >= 0:
            out.append(self.segments[j])
            j = self.segments[j].parent
        return out[::-1]


def _rows(x: np.ndarray, segs: Sequence[Segment]) -> np.ndarray:
    parts = [x[s.start : s.start + s.length] for s in segs]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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
    """The operations of one forward pass: kernels, the sequence layout, the expert source.

    Made per pass by the engine. ``layout`` says which rows are which sequence (default: all
    rows one causal sequence); see `SeqLayout`. ``expert_phases`` collects the (start, end)
    time of every routed-expert phase, in order, for the engine's loop; ``op_spans`` the
    (op, start, end) of every other kernel call (leaf calls only: spans never nest, so their
    durations add up).

    ``attn_products`` is how the attention kernel multiplies: "f32" (exact) or "bf16" (q, k, v
    and the softmax weights rounded to bfloat16, fp32 sums; the engine uses it with q8
    activations).

    ``backend``: where the kernel ops run (None: this process's default backend). The weights
    they read are made visible to it once (`estream_htp.Backend.visible`: copied into shared
    memory for an executor the first time an op uses them), kept in ``shared`` (the engine's,
    across requests). With a ``pool`` (the backend's `estream_htp.ActivationArena`) *every* op
    of the pass runs on the backend ("full accelerator"): every activation is allocated in the
    pool, so operands are passed by reference and nothing is staged; residual adds, gates,
    slices, broadcasts, zeroing and the attention of continuing segments are kernel ops too.
    Without one, element-wise glue is numpy, as fast as it gets in-process."""

    def __init__(
        self,
        hp: ModelSpec,
        experts: ExpertSource,
        layout: SeqLayout | None = None,
        *,
        backend: htp.Backend | None = None,
        shared: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
        attn_products: str = "f32",
        pool: htp.ActivationArena | None = None,
    ) -> None:
        self.hp = hp
        self.experts = experts
        self.layout = layout
        self.expert_phases: list[tuple[float, float]] = []
        self.backend = backend if backend is not None else htp.default_backend()
        self._shared = shared if shared is not None else {}
        self.attn_products = attn_products
        self.op_spans: list[tuple[str, float, float]] = []
        self.pool = pool
        self._rows: htp.Q8Rows | None = None  # an MoE layer's input, quantized once

    def _span(self, name: str, t0: float) -> None:
        self.op_spans.append((name, t0, time.perf_counter()))

    def _w(self, a: np.ndarray | None) -> np.ndarray | None:
        """A weight array as the backend reads it (`estream_htp.Backend.visible`), made once."""
        if a is None:
            return a
        hit = self._shared.get(id(a))
        if hit is None or hit[0] is not a:
            hit = self._shared[id(a)] = (a, self.backend.visible(np.ascontiguousarray(a)))
        return hit[1]

    def _wt(self, key: object, make: Callable[[], np.ndarray]) -> np.ndarray:
        """A derived weight array (e.g. a transposed f32 matrix) as the backend reads it, made
        once."""
        hit = self._shared.get(id(key))
        if hit is None or hit[0] is not key:
            arr = self.backend.visible(np.ascontiguousarray(make(), dtype=np.float32))
            hit = self._shared[id(key)] = (key, arr)  # type: ignore[assignment]
        return hit[1]

    # activations
    def empty(self, shape: tuple[int, ...], dtype: object = np.float32) -> np.ndarray:
        """A new activation array: in the pool when there is one."""
        if self.pool is not None:
            return self.pool.empty(shape, dtype)
        return np.empty(shape, dtype=dtype)  # type: ignore[call-overload]

    def _out(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """``out=`` for a kernel: a pool array when there is a pool, else None (the wrapper
        allocates)."""
        return self.pool.empty(shape) if self.pool is not None else None

    def input(self, a: np.ndarray) -> np.ndarray:
        """A pass input made on the host (token ids, positions, row indices) as the ops read
        it: copied once into the pool's pass arena when there is a pool."""
        return self.pool.put_input(a) if self.pool is not None else a

    def begin_stage(self) -> None:
        """The engine starts the embedding, a layer or the head (see
        `estream_htp.ActivationArena`)."""
        if self.pool is not None:
            self.pool.begin_stage()

    # element-wise glue: kernel ops with a pool, numpy without. The public
    # methods are timed leaf ops; the underscored ones are for use inside another timed block.
    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a + b`` (residual adds)."""
        t0 = time.perf_counter()
        y = self._add(a, b)
        self._span("add", t0)
        return y

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a * b`` (gates; ``a``, ``b`` may be column slices ``x[:, i:j]``)."""
        t0 = time.perf_counter()
        y = self._mul(a, b)
        self._span("mul", t0)
        return y

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        t0 = time.perf_counter()
        y = self._zeros(shape)
        self._span("fill", t0)
        return y

    def cols(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
        """Columns ``a:b`` of ``x [T, N]`` as a contiguous array."""
        if self.pool is None:
            return np.ascontiguousarray(x[:, a:b])
        return self.copy(x[:, a:b], self.pool.empty((x.shape[0], b - a)))

    def copy(self, src: np.ndarray, dst: np.ndarray, rep: int = 1) -> np.ndarray:
        """``dst[r] = src[r // rep]`` over 2-D row views (slices, head re-orderings,
        broadcasts); returns ``dst``."""
        t0 = time.perf_counter()
        self._copy(src, dst, rep)
        self._span("copy", t0)
        return dst

    def _add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.pool is None:
            return a + b
        return htp.add(a, b, self.pool.empty(a.shape), backend=self.backend)

    def _mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.pool is None:
            return a * b
        return htp.mul(a, b, self.pool.empty(a.shape), backend=self.backend)

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.pool is None:
            return np.zeros(shape, dtype=np.float32)
        return htp.fill(self.pool.empty(shape), 0.0, backend=self.backend)

    def _copy(self, src: np.ndarray, dst: np.ndarray, rep: int = 1) -> None:
        if self.pool is None:
            dst[...] = src if rep == 1 else np.repeat(src, rep, axis=0)
        else:
            htp.copy_rows(src, dst, rep, backend=self.backend)

    def take_rows(self, x: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Rows ``rows`` of ``x [T, d]`` (all of it if None), contiguous."""
        if rows is None:
            return np.ascontiguousarray(x)
        if self.pool is None:
            return np.ascontiguousarray(x[rows])
        t0 = time.perf_counter()
        ids = self.input(np.ascontiguousarray(rows, dtype=np.int32))
        y = htp.get_rows(
            x, "f32", x.shape[0], x.shape[1], ids, self.pool.empty((ids.size, x.shape[1])),
            backend=self.backend,
        )  # fmt: skip
        self._span("rows", t0)
        return y

    # primitives
    def matmul(
        self,
        x: np.ndarray,
        w: DenseTensor,
        op: str = "matmul",
    ) -> np.ndarray:
        """`x @ w.T` for a resident matrix (tiled Q4_0/Q8_0 or f32, through the kernels);
        timed as ``op``.

        The kernels compute every row on its own (int8 quantization per row, one accumulator
        chain per row for any tile of tokens; f32 sums over k in order), so a request gives the
        same bits in any batch. No numpy/BLAS product runs here: BLAS worker threads left
        spinning after a call take cores from the kernels' pool."""
        t0 = time.perf_counter()
        out = self._out((x.shape[0], w.shape[0]))
        if w.fmt == "f32":
            wts = self._wt(w, lambda: w.f32().T)  # [in, out], made once
            y = htp.matmul_f32(np.ascontiguousarray(x, np.float32), wts, out, backend=self.backend)
        else:
            y = htp.gemm(x, self._w(w.data), w.shape[0], w.fmt, out, backend=self.backend)
        self._span(op, t0)
        return y

    def matmuls(
        self, x: np.ndarray, ws: Sequence[DenseTensor], op: str, rows: htp.Q8Rows | None = None
    ) -> list[np.ndarray]:
        """`x @ w.T` for each of several resident matrices that share the input (q/k/v,
        gate/up): the tiled ones of one format in one kernel op, ``x`` quantized once (or
        given quantized: ``rows``), each result bit-identical to `matmul` of its matrix alone;
        timed together as ``op``."""
        tiled = [w for w in ws if w.fmt != "f32"]
        fmts = {w.fmt for w in tiled}
        if rows is not None and (len(tiled) != len(ws) or len(fmts) != 1):
            rows = None  # mixed formats (rare): each matrix quantizes its input itself
        if len(fmts) != 1 or (rows is None and len(tiled) < 2):
            return [self.matmul(x, w, op) for w in ws]
        t0 = time.perf_counter()
        ys = htp.gemm_shared(
            x if rows is None else rows,
            [(self._w(w.data), w.shape[0]) for w in tiled],
            tiled[0].fmt,
            [self._out((x.shape[0], w.shape[0])) for w in tiled],  # type: ignore[misc]
            backend=self.backend,
        )
        self._span(op, t0)
        done = iter(ys)
        return [next(done) if w.fmt != "f32" else self.matmul(x, w, op) for w in ws]

    def linear_f32(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """`x @ w` for an f32 matrix stored [in, out] (the router), through the kernel op on
        every backend: in-order sums, so each row's bits do not depend on the batch."""
        return htp.matmul_f32(
            np.ascontiguousarray(x, np.float32), self._w(w),  # type: ignore[arg-type]
            self._out((x.shape[0], w.shape[1])), backend=self.backend,
        )  # fmt: skip

    def rms_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        y = htp.rms_norm(x, self._w(w), self.hp.rms_eps, self._out(x.shape), backend=self.backend)
        self._span("norm", t0)
        return y

    def rope(self, x: np.ndarray, pos: np.ndarray, r: Rope) -> None:
        """RoPE, in place, on the first ``r.n_rot`` dims of each head of ``x [T, H, D]``."""
        t0 = time.perf_counter()
        htp.rope(
            x, pos, r.n_rot, r.freq_base, r.freq_scale, r.kind,  # type: ignore[arg-type]
            ext_factor=r.ext_factor, attn_factor=r.attn_factor, corr_dims=r.corr_dims,
            backend=self.backend,
        )  # fmt: skip
        self._span("rope", t0)

    def embed(self, head: Head, ids: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        e = head.tok_embd
        ids = self.input(ids)
        y = htp.get_rows(
            self._w(e.data), e.fmt, self.hp.n_vocab, self.hp.n_embd, ids,
            self._out((ids.shape[0], self.hp.n_embd)), backend=self.backend,
        )  # fmt: skip
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
        q, k, v = self.matmuls(h, (w.wq, w.wk, w.wv), "attn_qkv")
        be = self.backend
        t0 = time.perf_counter()
        if w.qk_norm == "full":
            q = htp.rms_norm(q, self._w(w.q_norm), eps, self._out(q.shape), backend=be)
            k = htp.rms_norm(k, self._w(w.k_norm), eps, self._out(k.shape), backend=be)
        elif w.qk_norm == "head":
            assert w.q_norm is not None and w.k_norm is not None  # checked at construction
            q = htp.rms_norm_heads(
                q, self._w(w.q_norm), w.n_head, eps, self._out(q.shape), backend=be
            )  # type: ignore[arg-type]
            k = htp.rms_norm_heads(
                k, self._w(w.k_norm), w.n_head_kv, eps, self._out(k.shape), backend=be
            )  # type: ignore[arg-type]
        if w.qk_norm != "none":
            self._span("qk_norm", t0)
        q = np.ascontiguousarray(q.reshape(t, w.n_head, w.head_dim))
        k = np.ascontiguousarray(k.reshape(t, w.n_head_kv, w.head_dim))
        v = np.ascontiguousarray(v.reshape(t, w.n_head_kv, -1))
        self.rope(q, pos, w.rope)
        self.rope(k, pos, w.rope)
        a = self.attend(q, k, v, w.scale)
        return self.matmul(np.ascontiguousarray(a.reshape(t, -1)), w.wo, "attn_out")

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """softmax(q kᵀ · scale) v under the pass's layout: `q [T, H, D]`, `k, v [T, Hkv, ·]`.

        A sequence's first segment goes through the tiled causal kernel on its own rows (as if
        it were prefilled alone); a continuing segment attends to its ancestors' rows and
        causally to itself: with a pool the same kernel with the ancestors' rows as its context
        (their keys and values gathered with copy ops), without one `_continued_attention`
        (BLAS). Nothing crosses requests."""
        t0 = time.perf_counter()
        p = self.attn_products
        lay = self.layout
        be = self.backend
        shape = (q.shape[0], q.shape[1], v.shape[2])
        if lay is None or lay.single:
            a = htp.attention(q, k, v, scale, True, self._out(shape), products=p, backend=be)
            self._span("attention", t0)
            return a
        out = self.empty(shape)
        for i, s in enumerate(lay.segments):
            rows = slice(s.start, s.start + s.length)
            if s.parent < 0:
                htp.attention(
                    q[rows], k[rows], v[rows], scale, True, out[rows], products=p, backend=be
                )
            elif self.pool is None:
                ctx = lay.context(i)
                out[rows] = _continued_attention(
                    q[rows], _rows(k, [*ctx, s]), _rows(v, [*ctx, s]), scale, products=p
                )
            else:
                segs = [*lay.context(i), s]
                n_ctx = sum(c.length for c in segs[:-1])
                kk = self._gather(k, segs)
                vv = self._gather(v, segs)
                htp.attention(
                    q[rows], kk, vv, scale, True, out[rows], products=p, context=n_ctx,
                    backend=be,
                )  # fmt: skip
        self._span("attention", t0)
        return out

    def _gather(self, x: np.ndarray, segs: Sequence[Segment]) -> np.ndarray:
        """The rows of ``segs`` of ``x`` back to back, by copy ops (in the pool)."""
        n = sum(s.length for s in segs)
        out = self.empty((n, *x.shape[1:]))
        flat_x = x.reshape(x.shape[0], -1)
        flat_o = out.reshape(n, -1)
        r = 0
        for s in segs:
            htp.copy_rows(
                flat_x[s.start : s.start + s.length], flat_o[r : r + s.length],
                backend=self.backend,
            )  # fmt: skip
            r += s.length
        return out

    def short_conv(self, w: ShortConv, h: np.ndarray) -> np.ndarray:
        """B, C, x = in_proj(h); out_proj(C * conv(B * x)), the convolution causal per sequence."""
        d = w.out_proj.shape[0]
        bcx = self.matmul(h, w.in_proj, "conv_in")
        t0 = time.perf_counter()
        bx = self._mul(bcx[:, :d], bcx[:, 2 * d : 3 * d])
        y = self._mul(bcx[:, d : 2 * d], self.causal_conv(bx, w.kernel))
        self._span("short_conv", t0)
        return self.matmul(np.ascontiguousarray(y), w.out_proj, "conv_out")

    def causal_conv(self, x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
        """Depthwise causal convolution of ``x[T, C]`` along the tokens of each sequence.

        A sequence's first segment starts from zeros; a continuing segment (a branch) sees the
        last ``taps - 1`` rows of its ancestors (zeros before the first token), never another
        segment's or request's rows, exactly as if ``prefix + branch`` were prefilled alone."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        be, kernel_s = self.backend, self._w(kernel)
        lay = self.layout
        if lay is None or lay.single:
            return htp.conv1d_causal(x, kernel_s, None, self._out(x.shape), backend=be)  # type: ignore[arg-type]
        taps = kernel.shape[1]
        out = self.empty(x.shape)
        for i, s in enumerate(lay.segments):
            rows = slice(s.start, s.start + s.length)
            seg = x[rows]
            if s.parent < 0:
                htp.conv1d_causal(seg, kernel_s, None, out[rows], backend=be)  # type: ignore[arg-type]
                continue
            history = self._zeros((taps - 1, x.shape[1]))
            keep = taps - 1
            for c in reversed(lay.context(i)):  # the last rows before the branch, latest last
                if keep == 0:
                    break
                n = min(keep, c.length)
                self._copy(x[c.start + c.length - n : c.start + c.length], history[keep - n : keep])
                keep -= n
            htp.conv1d_causal(seg, kernel_s, history, out[rows], backend=be)  # type: ignore[arg-type]
        return out

    def dense_ffn(self, h: np.ndarray, w: FFN, rows: htp.Q8Rows | None = None) -> np.ndarray:
        """SwiGLU FFN; ``rows``: ``h`` already quantized (`quantize_input`), for gate/up."""
        g, u = self.matmuls(h, (w.gate, w.up), "ffn", rows)
        t0 = time.perf_counter()
        a = htp.swiglu(g, u, self._out(g.shape), backend=self.backend)
        self._span("ffn", t0)
        return self.matmul(a, w.down, "ffn")

    def quantize_input(self, h: np.ndarray) -> htp.Q8Rows | None:
        """With int8 products, ``h`` quantized once (`htp.quantize_q8`) for every op that
        reads it (the routed experts of every group, the shared experts); None with fp32
        products. With a pool (every op on the backend) the rows are an activation of it;
        otherwise one buffer per pass, in the memory the expert ops read (shared memory when
        they run in an executor), kept between layers."""
        be = self.backend
        if be.act != "q8":
            return None
        t0 = time.perf_counter()
        t, d = h.shape
        if self.pool is not None:  # a stage activation of the pool, like ids
            rows = htp.Q8Rows(t, d, data=self.pool.empty((htp.q8_rows_nbytes(t, d),), np.uint8))
        else:  # one buffer for the pass, reused by every layer, where the expert ops read it
            if self._rows is None or (self._rows.t, self._rows.d) != (t, d):
                graph = getattr(self.experts, "graph", None)  # an executor's: shared memory
                self._rows = None  # the old buffer goes before the new one is allocated
                self._rows = htp.Q8Rows(t, d, backend=graph.backend if graph else be)
            rows = self._rows
        rows = htp.quantize_q8(np.ascontiguousarray(h, np.float32), rows, backend=be)
        self._span("quantize", t0)
        return rows

    def moe(self, h: np.ndarray, w: MoE, shared: FFN | None = None) -> np.ndarray:
        """Route each token to its top-k experts and sum their SwiGLU outputs, weighted, plus
        the always-on ``shared`` experts' FFN if given; all read ``h`` quantized once.

        The router runs here (resident); the experts run through the expert source, which the
        engine's loop told at layer start to begin reading this layer's experts."""
        g = w.gating
        t0 = time.perf_counter()
        logits = self.linear_f32(h, w.router)
        out = None
        if self.pool is not None:
            out = (self.pool.empty((h.shape[0], g.n_used), np.int32),
                   self.pool.empty((h.shape[0], g.n_used)))  # fmt: skip
        ids, weights = htp.router_topk(
            logits, g.n_used, gating=g.func, norm=g.norm, scale=g.scale,
            bias=self._w(w.bias), out=out, backend=self.backend,
        )  # type: ignore[arg-type]  # fmt: skip
        self._span("router", t0)
        rows = self.quantize_input(h)
        y = self.zeros((h.shape[0], self.hp.n_embd))
        t0 = time.perf_counter()
        self.experts.run_layer(w.experts, h if rows is None else rows, ids, weights, y)
        self.expert_phases.append((t0, time.perf_counter()))
        if shared is not None:
            y = self.add(y, self.dense_ffn(h, shared, rows))
        return y


def _continued_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *, products: str = "f32"
) -> np.ndarray:
    """A continuing segment's attention: ``q [n, H, D]`` against ``k, v [C + n, Hkv, ·]``
    (``C`` context rows, all visible, then the segment's own rows, causal), with BLAS
    (float32): segments are short. With ``products`` "bf16", the kernel's rounding of
    ``q·scale``, ``k``, ``v`` and the softmax weights, so that a branch sees what a separate
    prefill of ``prefix + branch`` would."""
    n, n_head = q.shape[0], q.shape[1]
    n_ctx = k.shape[0] - n
    rep = n_head // k.shape[1]
    bf16 = products == "bf16"
    kk = np.repeat(k, rep, axis=1).transpose(1, 2, 0)  # [H, D, C+n]
    vv = np.repeat(v, rep, axis=1).transpose(1, 0, 2)  # [H, C+n, Dv]
    qq = q.transpose(1, 0, 2)  # [H, n, D]
    if bf16:
        kk, vv = htp.round_bf16(kk), htp.round_bf16(vv)
        sc = np.matmul(htp.round_bf16(qq * np.float32(scale)), kk)  # [H, n, C+n]
    else:
        sc = np.matmul(qq, kk) * np.float32(scale)  # [H, n, C+n]
    mask = np.triu(np.ones((n, n), dtype=bool), k=1)
    sc[:, :, n_ctx:][:, mask] = -np.inf
    sc -= sc.max(axis=-1, keepdims=True)
    np.exp(sc, out=sc)
    if bf16:
        sc = htp.round_bf16(sc)
    sc /= sc.sum(axis=-1, keepdims=True)
    return np.matmul(sc, vv).transpose(1, 0, 2)
