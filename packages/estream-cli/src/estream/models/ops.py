"""The operations a layer is written with: the math of a forward pass, on a backend.

The role of llama.cpp's graph builders (`build_norm`, `build_attn`, `build_ffn`,
`build_moe_ffn`): each architecture module (`olmoe.py`, `qwen3moe.py`, `llama.py`, …) binds its
weights into the typed records of `models.weights` and writes its layer as a few calls on an
`Ops`; `models.layout` says which rows of the pass are which sequence.

`Ops` also owns the one side effect a layer has: routed experts run through the engine's
`ExpertSource`. Every kernel call it makes is timed by one context manager (`Ops.timed`) into
`op_spans` — q/k/v projections, attention, output projection, norms, RoPE, router, the routed
experts ("experts"), dense FFN, output head, ... — which the engine's recorder turns into spans
and metrics, so a trace shows where a prefill spends its time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

import estream_htp as htp
from estream_layout import ModelSpec

from ..experts import ExpertSource
from ..opstats import attention_macs
from ..packed import DenseTensor, ExpertLayer
from .layout import Segment, SeqLayout, segment_rows
from .weights import FFN, Attention, Head, MoE, Rope, ShortConv

__all__ = ["Ops", "copy_bytes"]


def copy_bytes(shared: dict[int, tuple[object, np.ndarray]]) -> int:
    """Bytes of the weight copies in an `Ops` ``shared`` cache: the derived arrays (`Ops._wt`:
    the transposed f32 matrices) and the weights made visible to an executor by copying
    (`Ops._w`); an array that is its weight's own memory, as the host backend reads it, is
    not a copy."""
    n = 0
    for key, arr in shared.values():
        src = key.data if isinstance(key, DenseTensor) else key
        if not isinstance(src, np.ndarray) or not np.may_share_memory(src, arr):
            n += int(arr.nbytes)
    return n


# -- the operations a layer is written with -----------------------------------------------------
class Ops:
    """The operations of one forward pass: kernels, the sequence layout, the expert source.

    Made per pass by the engine. ``layout`` says which rows are which sequence (default: all
    rows one causal sequence); see `SeqLayout`. ``op_spans`` collects the (op, start, end) of
    every kernel call (`timed`; leaf calls only: spans never nest, so their durations add up),
    the routed-expert phases among them as "experts".

    ``attn_products`` is how the attention kernel multiplies: "f32" (exact), "bf16" (q, k, v
    and the softmax weights rounded to bfloat16, fp32 sums) or "bf16-pv" (fp32 scores, v and
    the softmax weights rounded to bfloat16); the engine uses the bf16 modes with q8
    activations.

    ``op_work``: a list to count each call's work into (`count`; None: nothing is counted,
    the default), for the per-op table of `estream.opstats`.

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
        op_work: list[tuple[str, str, int]] | None = None,
    ) -> None:
        self.hp = hp
        self.experts = experts
        self.layout = layout
        self.backend = backend if backend is not None else htp.default_backend()
        self._shared = shared if shared is not None else {}
        self.attn_products = attn_products
        self.op_spans: list[tuple[str, float, float]] = []
        self.pool = pool
        self.op_work = op_work
        self._rows: htp.Q8Rows | None = None  # an MoE layer's input, quantized once
        self._layer: ExpertLayer | None = None  # the routed experts of the running layer

    def timed(self, name: str) -> _Timed:
        """``with ops.timed(name): ...``: the block's (name, start, end) goes to ``op_spans``
        when it completes (the one clock of the ops)."""
        return _Timed(self.op_spans, name)

    def count(self, name: str, precision: str, macs: int) -> None:
        """Op ``name`` did ``macs`` multiply-adds in ``precision`` ("int8", "fp32", "bf16"):
        2 operations each, into ``op_work`` when work is counted."""
        if self.op_work is not None:
            self.op_work.append((name, precision, 2 * int(macs)))

    def _gemm_precision(self, w: DenseTensor) -> str:
        """What a GEMM on ``w`` multiplies in: int8 for a quantized tiled matrix under int8
        activations; fp32 for f32 matrices and F16/BF16 tiles (`htp.FLOAT_TILE_FORMATS`, which
        the kernels multiply in fp32 under either activation format)."""
        fp32 = w.fmt == "f32" or w.fmt in htp.FLOAT_TILE_FORMATS
        return "int8" if not fp32 and self.backend.act == "q8" else "fp32"

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

    # the stages of a pass
    def begin_pass(self, pos: np.ndarray) -> np.ndarray:
        """The pass starts (its first stage, the embedding, too): the positions ``pos`` as
        the ops read them."""
        if self.pool is not None:
            self.pool.begin_pass()
        pos = self.input(pos)
        self.begin_stage()
        return pos

    def begin_layer(self, experts: ExpertLayer | None) -> None:
        """A layer starts: its routed ``experts`` (None: a dense layer) begin to load — the
        reads start before attention — and its activations get their stage."""
        self._layer = experts
        if experts is not None:
            self.experts.begin_layer(experts)
        self.begin_stage()

    def end_layer(self) -> None:
        if self._layer is not None:
            self.experts.end_layer()
        self._layer = None

    def result(self, a: np.ndarray | None) -> np.ndarray | None:
        """An array the caller keeps after the pass: copied out of the pool, which the next
        pass reuses."""
        return np.array(a) if a is not None and self.pool is not None else a

    # element-wise glue: kernel ops with a pool, numpy without. The public
    # methods are timed leaf ops; the underscored ones are for use inside another timed block.
    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a + b`` (residual adds)."""
        with self.timed("add"):
            return self._add(a, b)

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a * b`` (gates; ``a``, ``b`` may be column slices ``x[:, i:j]``)."""
        with self.timed("mul"):
            return self._mul(a, b)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        with self.timed("fill"):
            return self._zeros(shape)

    def cols(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
        """Columns ``a:b`` of ``x [T, N]`` as a contiguous array."""
        if self.pool is None:
            return np.ascontiguousarray(x[:, a:b])
        return self.copy(x[:, a:b], self.pool.empty((x.shape[0], b - a)))

    def copy(self, src: np.ndarray, dst: np.ndarray, rep: int = 1) -> np.ndarray:
        """``dst[r] = src[r // rep]`` over 2-D row views (slices, head re-orderings,
        broadcasts); returns ``dst``."""
        with self.timed("copy"):
            self._copy(src, dst, rep)
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

    def add_row(self, x: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``x [T, N] + b [N]`` (a bias on every row)."""
        with self.timed("add"):
            return self._add_row(x, b)

    def _add_row(self, x: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.pool is None:
            return x + b
        rows = self.pool.empty(x.shape)
        self._copy(self._w(b).reshape(1, -1), rows, x.shape[0])  # type: ignore[union-attr]
        return self._add(x, rows)

    def take_rows(self, x: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Rows ``rows`` of ``x [T, d]`` (all of it if None), contiguous."""
        if rows is None:
            return np.ascontiguousarray(x)
        if self.pool is None:
            return np.ascontiguousarray(x[rows])
        with self.timed("rows"):
            ids = self.input(np.ascontiguousarray(rows, dtype=np.int32))
            y = htp.get_rows(
                x, "f32", x.shape[0], x.shape[1], ids, self.pool.empty((ids.size, x.shape[1])),
                backend=self.backend,
            )  # fmt: skip
        return y

    # primitives
    def matmul(
        self,
        x: np.ndarray,
        w: DenseTensor,
        op: str = "matmul",
    ) -> np.ndarray:
        """`x @ w.T` for a resident matrix (tiled, F16/BF16 tiles or f32, through the kernels);
        timed as ``op``.

        The kernels compute every row on its own (int8 quantization per row, one accumulator
        chain per row for any tile of tokens; f32 sums over k in order), so a request gives the
        same bits in any batch. No numpy/BLAS product runs here: BLAS worker threads left
        spinning after a call take cores from the kernels' pool."""
        with self.timed(op):
            out = self._out((x.shape[0], w.shape[0]))
            if w.fmt == "f32":
                wts = self._wt(w, lambda: w.f32().T)  # [in, out], made once
                y = htp.matmul_f32(
                    np.ascontiguousarray(x, np.float32), wts, out, backend=self.backend
                )
            else:
                y = htp.gemm(x, self._w(w.data), w.shape[0], w.fmt, out, backend=self.backend)
        if self.op_work is not None:
            self.count(op, self._gemm_precision(w), x.shape[0] * w.shape[0] * x.shape[1])
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
        if rows is not None and (
            len(tiled) != len(ws) or len(fmts) != 1 or fmts <= set(htp.FLOAT_TILE_FORMATS)
        ):
            # mixed formats (rare): each matrix quantizes its input itself; F16/BF16 tiles
            # take the fp32 input (their products are fp32)
            rows = None
        if len(fmts) != 1 or (rows is None and len(tiled) < 2):
            return [self.matmul(x, w, op) for w in ws]
        with self.timed(op):
            ys = htp.gemm_shared(
                x if rows is None else rows,
                [(self._w(w.data), w.shape[0]) for w in tiled],
                tiled[0].fmt,
                [self._out((x.shape[0], w.shape[0])) for w in tiled],  # type: ignore[misc]
                backend=self.backend,
            )
        if self.op_work is not None:
            for w in tiled:
                self.count(op, self._gemm_precision(w), x.shape[0] * w.shape[0] * x.shape[1])
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
        with self.timed("norm"):
            y = htp.rms_norm(
                x, self._w(w), self.hp.rms_eps, self._out(x.shape), backend=self.backend
            )
        return y

    def rope(self, x: np.ndarray, pos: np.ndarray, r: Rope) -> None:
        """RoPE, in place, on the first ``r.n_rot`` dims of each head of ``x [T, H, D]``."""
        with self.timed("rope"):
            htp.rope(
                x, pos, r.n_rot, r.freq_base, r.freq_scale, r.kind,  # type: ignore[arg-type]
                ext_factor=r.ext_factor, attn_factor=r.attn_factor, corr_dims=r.corr_dims,
                backend=self.backend,
            )  # fmt: skip

    def embed(self, head: Head, ids: np.ndarray) -> np.ndarray:
        with self.timed("embed"):
            e = head.tok_embd
            ids = self.input(ids)
            y = htp.get_rows(
                self._w(e.data), e.fmt, self.hp.n_vocab, self.hp.n_embd, ids,
                self._out((ids.shape[0], self.hp.n_embd)), backend=self.backend,
            )  # fmt: skip
        return y

    def output(self, head: Head, h: np.ndarray) -> np.ndarray:
        """Logits `[rows, n_vocab]` of final-normed hidden states `h`."""
        return self.matmul(h, head.output, "output_head")[:, : self.hp.n_vocab]

    # blocks
    def attention(self, w: Attention, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """q/k/v projections, q/k RMSNorm, RoPE, causal GQA attention (``w.window`` > 0: each
        query sees the last ``w.window`` positions of its own request), output projection."""
        t = h.shape[0]
        q, k, v = self.matmuls(h, (w.wq, w.wk, w.wv), "attn_qkv")
        if w.qk_norm != "none":
            with self.timed("qk_norm"):
                q, k = self._qk_norm(w, q, k)
        q = np.ascontiguousarray(q.reshape(t, w.n_head, w.head_dim))
        k = np.ascontiguousarray(k.reshape(t, w.n_head_kv, w.head_dim))
        v = np.ascontiguousarray(v.reshape(t, w.n_head_kv, -1))
        if w.rope is not None:  # None: a NoPE layer
            self.rope(q, pos, w.rope)
            self.rope(k, pos, w.rope)
        a = self.attend(q, k, v, w.scale, window=w.window)
        return self.matmul(np.ascontiguousarray(a.reshape(t, -1)), w.wo, "attn_out")

    def _qk_norm(self, w: Attention, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """q and k RMSNormed: the whole projection ("full") or each head ("head")."""
        eps, be = self.hp.rms_eps, self.backend
        if w.qk_norm == "full":
            q = htp.rms_norm(q, self._w(w.q_norm), eps, self._out(q.shape), backend=be)
            k = htp.rms_norm(k, self._w(w.k_norm), eps, self._out(k.shape), backend=be)
            return q, k
        assert w.q_norm is not None and w.k_norm is not None  # checked at construction
        q = htp.rms_norm_heads(
            q, self._w(w.q_norm), w.n_head, eps, self._out(q.shape), backend=be
        )  # type: ignore[arg-type]  # fmt: skip
        k = htp.rms_norm_heads(
            k, self._w(w.k_norm), w.n_head_kv, eps, self._out(k.shape), backend=be
        )  # type: ignore[arg-type]
        return q, k

    def attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        scale: float,
        *,
        window: int = 0,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        """softmax(q kᵀ · scale) v under the pass's layout: `q [T, H, D]`, `k, v [T, Hkv, ·]`;
        ``window`` > 0: each query sees its last ``window`` positions of its own sequence;
        ``sinks`` ``[H]``: a logit per query head in every row's denominator (gpt-oss).

        A sequence's first segment goes through the tiled causal kernel on its own rows (as if
        it were prefilled alone); a continuing segment attends to its ancestors' rows and
        causally to itself: with a pool the same kernel with the ancestors' rows as its context
        (their keys and values gathered with copy ops), without one `_continued_attention`
        (BLAS). Nothing crosses requests."""
        if self.op_work is not None:
            self._count_attention(q, v, window)
        with self.timed("attention"):
            return self._attend(q, k, v, scale, window=window, sinks=sinks)

    def _count_attention(self, q: np.ndarray, v: np.ndarray, window: int) -> None:
        """The attention's multiply-adds under the pass's layout (`opstats.attention_macs`)."""
        lay = self.layout
        if lay is None or lay.single:
            segs = [(0, q.shape[0])]
        else:
            segs = [
                (sum(c.length for c in lay.context(i)) if s.parent >= 0 else 0, s.length)
                for i, s in enumerate(lay.segments)
            ]
        n_head, d_k, d_v = q.shape[1], q.shape[2], v.shape[2]
        if self.attn_products == "bf16-pv":  # the scores in fp32, the weighted sum in bf16
            self.count("attention", "fp32", attention_macs(segs, n_head, d_k, 0, window))
            self.count("attention", "bf16", attention_macs(segs, n_head, 0, d_v, window))
        else:
            macs = attention_macs(segs, n_head, d_k, d_v, window)
            self.count("attention", "bf16" if self.attn_products == "bf16" else "fp32", macs)

    def _attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        scale: float,
        *,
        window: int = 0,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        p = self.attn_products
        lay = self.layout
        be = self.backend
        shape = (q.shape[0], q.shape[1], v.shape[2])
        mask = {"window": window, "sinks": self._w(sinks)} if window or sinks is not None else {}
        if lay is None or lay.single:
            return htp.attention(
                q, k, v, scale, True, self._out(shape), products=p, backend=be, **mask
            )
        out = self.empty(shape)
        for i, s in enumerate(lay.segments):
            rows = slice(s.start, s.start + s.length)
            if s.parent < 0:
                htp.attention(
                    q[rows], k[rows], v[rows], scale, True, out[rows], products=p, backend=be,
                    **mask,
                )  # fmt: skip
            elif self.pool is None:
                ctx = lay.context(i)
                out[rows] = _continued_attention(
                    q[rows],
                    segment_rows(k, [*ctx, s]),
                    segment_rows(v, [*ctx, s]),
                    scale,
                    products=p,
                    window=window,
                    sinks=sinks,
                )
            else:
                segs = [*lay.context(i), s]
                n_ctx = sum(c.length for c in segs[:-1])
                kk = self._gather(k, segs)
                vv = self._gather(v, segs)
                htp.attention(
                    q[rows], kk, vv, scale, True, out[rows], products=p, context=n_ctx,
                    backend=be, **mask,
                )  # fmt: skip
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
        if self.op_work is not None:  # the depthwise convolution: taps per channel and row
            self.count("short_conv", "fp32", h.shape[0] * d * w.kernel.shape[1])
        with self.timed("short_conv"):
            bx = self._mul(bcx[:, :d], bcx[:, 2 * d : 3 * d])
            y = self._mul(bcx[:, d : 2 * d], self.causal_conv(bx, w.kernel))
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

    def dense_ffn(
        self, h: np.ndarray, w: FFN, rows: htp.Q8Rows | None = None, op: str = "ffn"
    ) -> np.ndarray:
        """SwiGLU FFN; ``rows``: ``h`` already quantized (`quantize_input`), for gate/up. Its
        GEMMs are timed as ``op`` ("ffn": a dense layer's; "shared_ffn": shared experts), the
        SwiGLU between them as "glu"."""
        g, u = self.matmuls(h, (w.gate, w.up), op, rows)
        with self.timed("glu"):  # in place: g is this op's own; no fresh [T, d_ff] to fault in
            a = htp.swiglu(g, u, g, backend=self.backend)
        return self.matmul(a, w.down, op)

    def quantize_input(self, h: np.ndarray) -> htp.Q8Rows | None:
        """With int8 products, ``h`` quantized once (`htp.quantize_q8`) for every op that
        reads it (the routed experts of every group, the shared experts); None with fp32
        products. With a pool (every op on the backend) the rows are an activation of it;
        otherwise one buffer per pass, in the memory the expert ops read (shared memory when
        they run in an executor), kept between layers."""
        be = self.backend
        if be.act != "q8":
            return None
        with self.timed("quantize"):
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
        return rows

    def route(
        self, x: np.ndarray, w: MoE, *, before_attention: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The router on ``x``: each token's top-k expert ids and weights ``[T, k]``.
        ``before_attention``: a pre-attention router (SmallThinker's): the expert source learns
        the routes now (`ExpertSource.routes_known`) and may read the routed groups while
        attention runs."""
        g = w.gating
        if self.op_work is not None:
            self.count("router", "fp32", x.shape[0] * w.router.shape[0] * w.router.shape[1])
        with self.timed("router"):
            logits = self.linear_f32(x, w.router)
            if w.logit_bias is not None:  # gpt-oss: a bias on the logits themselves
                logits = self._add_row(logits, w.logit_bias)
            out = None
            if self.pool is not None:
                out = (self.pool.empty((x.shape[0], g.n_used), np.int32),
                       self.pool.empty((x.shape[0], g.n_used)))  # fmt: skip
            ids, weights = htp.router_topk(
                logits, g.n_used, gating=g.func, norm=g.norm, scale=g.scale,
                bias=self._w(w.bias), out=out, backend=self.backend,
            )  # type: ignore[arg-type]  # fmt: skip
        if before_attention and self._layer is w.experts:
            self.experts.routes_known(w.experts, ids)
        return ids, weights

    def moe(
        self,
        h: np.ndarray,
        w: MoE,
        shared: FFN | None = None,
        routes: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Route each token to its top-k experts and sum their gated (SwiGLU, ReGLU or
        gpt-oss's SwiGLU-OAI) outputs, weighted, plus the always-on ``shared`` experts' FFN if
        given; all read ``h`` quantized once.

        The router runs here on ``h`` unless ``routes`` (ids, weights) were computed before
        (`route`, on another input: SmallThinker routes the layer's input); the experts run
        through the expert source, which the engine's loop told at layer start to begin reading
        this layer's experts (the fused expert op, whatever the activation)."""
        ids, weights = self.route(h, w) if routes is None else routes
        rows = self.quantize_input(h)
        y = self.zeros((h.shape[0], self.hp.n_embd))
        if self.op_work is not None:  # gate, up and down of every route
            macs = ids.size * 3 * self.hp.n_embd * self.hp.n_ff_exp
            self.count("experts", "int8" if self.backend.act == "q8" else "fp32", macs)
        with self.timed("experts"):  # the routed experts: the engine's expert phase
            self.experts.run_layer(w.experts, h if rows is None else rows, ids, weights, y)
        if shared is not None:
            y = self.add(y, self.dense_ffn(h, shared, rows, "shared_ffn"))
        return y


def _continued_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    *,
    products: str = "f32",
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """A continuing segment's attention: ``q [n, H, D]`` against ``k, v [C + n, Hkv, ·]``
    (``C`` context rows, all visible, then the segment's own rows, causal), with BLAS
    (float32): segments are short. With ``products`` "bf16", the kernel's rounding of
    ``q·scale``, ``k``, ``v`` and the softmax weights ("bf16-pv": of ``v`` and the weights), so
    that a branch sees what a separate prefill of ``prefix + branch`` would. ``window`` and
    ``sinks`` as `htp.attention`'s."""
    n, n_head = q.shape[0], q.shape[1]
    n_ctx = k.shape[0] - n
    rep = n_head // k.shape[1]
    bf16, pv16 = products == "bf16", products in ("bf16", "bf16-pv")
    kk = np.repeat(k, rep, axis=1).transpose(1, 2, 0)  # [H, D, C+n]
    vv = np.repeat(v, rep, axis=1).transpose(1, 0, 2)  # [H, C+n, Dv]
    qq = q.transpose(1, 0, 2)  # [H, n, D]
    if pv16:
        vv = htp.round_bf16(vv)
    if bf16:
        kk = htp.round_bf16(kk)
        sc = np.matmul(htp.round_bf16(qq * np.float32(scale)), kk)  # [H, n, C+n]
    else:
        sc = np.matmul(qq, kk) * np.float32(scale)  # [H, n, C+n]
    mask = np.triu(np.ones((n, n), dtype=bool), k=1)
    sc[:, :, n_ctx:][:, mask] = -np.inf
    if window:  # query i sits at key position n_ctx + i and sees keys j > n_ctx + i - window
        j = np.arange(n_ctx + n)
        sc[:, j[None, :] <= (n_ctx + np.arange(n))[:, None] - window] = -np.inf
    sink = None if sinks is None else np.asarray(sinks, np.float32)[:, None, None]
    m = sc.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    sc -= m
    np.exp(sc, out=sc)
    if pv16:
        sc = htp.round_bf16(sc)
    den = sc.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink - m)
    sc /= den
    return np.matmul(sc, vv).transpose(1, 0, 2)


class _Timed:
    """The context manager of `Ops.timed`: a span only for a block that completed."""

    __slots__ = ("name", "spans", "t0")

    def __init__(self, spans: list[tuple[str, float, float]], name: str) -> None:
        self.spans, self.name = spans, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.spans.append((self.name, self.t0, time.perf_counter()))
