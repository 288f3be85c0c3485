"""The streamed prefill engine: one causal forward pass over a prompt, experts through the arena.

The forward pass of each architecture is its own module in `estream_cli.models` (llama.cpp's
`src/models/<arch>.cpp`), written over the shared blocks of `models.ops`. This module holds the
generic loop around it: embedding, for each layer "tell the expert source the layer starts, run
the layer", final norm and output head; and all the bookkeeping (spans, metrics, progress) that
the layer functions leave out. Dense weights are resident; experts come from an `ExpertSource`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import estream_arena as ea
import estream_htp as htp
import estream_sched as es

from . import memory
from .config import StreamConfig, resolve_config
from .errors import BadRequestError, NonFiniteError
from .experts import SCHEDULES, ExpertSource, GroupRecord, ResidentExperts, StreamedExperts
from .metrics import build_events, op_times, run_metrics
from .models import architecture
from .models.ops import Branches, Ops
from .packed import PackedModel

__all__ = ["ACTS", "MODES", "BranchResult", "Engine", "PrefillResult", "StreamConfig", "load"]

MODES = ("stream", "resident", "naive", "layer")
# How activations meet the Q4_0/Q8_0 weights: "q8" (int8 per 32-block, like GGML's Q8_0: fast)
# or "f32" (dequantized weights, fp32 products: matches a float64 reference to ~1e-6).
ACTS = ("q8", "f32")
DEFAULT_THREADS = max(1, min(os.cpu_count() or 1, 8))


@attrs.frozen
class PrefillResult:
    """Logits (last position, or all positions), optional hidden state, and the run's metrics."""

    logits: np.ndarray  # [n_vocab] or [T, n_vocab]
    hidden: np.ndarray | None  # final-normed hidden state [T, d] when asked for
    metrics: dict[str, Any]
    events: list[es.TraceEvent] = attrs.field(repr=False)
    records: list[GroupRecord] = attrs.field(repr=False, factory=list)
    reads: list[ea.ReadEvent] = attrs.field(repr=False, factory=list)

    def top_k(self, k: int = 5) -> list[tuple[int, float]]:
        """Next-token top-k (token id, probability) from the last position's logits."""
        last = self.logits if self.logits.ndim == 1 else self.logits[-1]
        z = last.astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        idx = np.argsort(-p, kind="stable")[:k]
        return [(int(i), float(p[i])) for i in idx]


@attrs.frozen
class BranchResult:
    """Logits of a shared-prefix, many-continuation pass (see `Engine.prefill_branches`).

    ``prefix_logits``: next-token logits after the prefix (they predict each branch's first
    token); ``branch_logits[i][j]``: logits after token ``j`` of branch ``i``."""

    prefix_logits: np.ndarray  # [n_vocab]
    branch_logits: list[np.ndarray]  # [n_i, n_vocab] each
    hidden: np.ndarray | None  # [P + Σ n_i, d] final-normed, packed order, when asked for
    segments: list[tuple[int, int]]  # (start, length) of each branch in the packed order
    metrics: dict[str, Any]

    def continuation_logprobs(self, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """log P(token j of branch i | prefix, earlier tokens of branch i), float64."""
        out = []
        for i, toks in enumerate(branches):
            lg = np.vstack([self.prefix_logits[None, :], self.branch_logits[i][:-1]])
            lg = lg.astype(np.float64)
            lg -= lg.max(axis=1, keepdims=True)
            lse = np.log(np.exp(lg).sum(axis=1))
            out.append(lg[np.arange(len(toks)), np.asarray(toks)] - lse)
        return out


class Engine:
    """A loaded packed model, ready to prefill prompts.

    >>> engine = load("model.estream", budget="1.5GiB")   # doctest: +SKIP
    >>> engine.prefill([1, 2, 3]).top_k(5)                 # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: str = "stream",
        schedule: str = "early",
        budget: int | str | None = None,
        G: int | None = None,
        Q: int | None = None,
        B: int | None = None,
        n_threads: int | None = None,
        verify: bool = False,
        direct: bool | None = None,
        progress: bool = False,
        act: str = "q8",
        backend: str = "host",
    ) -> None:
        if act not in ACTS:
            raise BadRequestError(f"act must be one of {', '.join(ACTS)}, got {act!r}")
        self.act = act
        if backend not in htp.BACKENDS:
            raise BadRequestError(
                f"backend must be one of {', '.join(htp.BACKENDS)}, got {backend!r}"
            )
        if mode not in MODES:
            raise BadRequestError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if schedule not in SCHEDULES:
            raise BadRequestError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
            )
        _check_counts(G=G, Q=Q, B=B, n_threads=n_threads)
        t0 = time.perf_counter()
        self._closed = False
        self._mem0 = memory.mem_available()
        memory.keep_freed_heap()  # per-op arrays reuse heap pages (see memory.keep_freed_heap)
        self.mode, self.schedule = mode, schedule
        self.progress = progress
        self.model = PackedModel(path)
        self.hp = self.model.hparams
        self.budget = memory.parse_bytes(budget) if budget is not None else None
        self.config = resolve_config(self.model, mode, self.budget, G, Q, B)
        self.arch = architecture(self.hp)
        htp.set_num_threads(int(n_threads or DEFAULT_THREADS))
        self.model.load_dense(verify=verify)
        self.weights = self.arch.bind(self.model)
        hp = self.hp
        self._capacity = 4096
        # Expert ops run on the chosen backend; the other ops stay on this process's default one.
        self.backend = (
            htp.default_backend()
            if backend == "host"
            else htp.Backend(backend, n_threads=htp.get_num_threads(), act=act)
        )
        self.graph = htp.ExpertGraph(
            hp.n_embd, hp.n_ff_exp, self._capacity, hp.n_ctx, backend=self.backend
        )
        try:
            self.experts: ExpertSource
            if self.config is None:
                self.experts = ResidentExperts(self.model, self.graph, verify=verify)
            else:
                c = self.config
                self.experts = StreamedExperts(
                    self.model,
                    self.graph,
                    group_size=c.G,
                    queue_depth=c.Q,
                    n_banks=c.B,
                    schedule=schedule,
                    verify=verify,
                    direct=direct,
                )
        except BaseException:
            self.graph.close()
            if self.backend is not htp.default_backend():
                self.backend.close()
            raise
        self.load_s = time.perf_counter() - t0

    # -- the forward pass ------------------------------------------------------------------
    def _check_tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise BadRequestError("need a non-empty 1-D sequence of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise BadRequestError(f"token ids must be integers, got {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.hp.n_vocab)]
        if bad.size:
            raise BadRequestError(
                f"token id {int(bad[0])} is out of the vocabulary (0..{self.hp.n_vocab - 1})"
            )
        if ids.size > self.hp.n_ctx:
            raise BadRequestError(
                f"prompt of {ids.size} tokens is longer than the model context ({self.hp.n_ctx})"
            )
        return ids.astype(np.int32)

    def prefill(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        all_logits: bool = False,
        return_hidden: bool = False,
    ) -> PrefillResult:
        """Run one causal forward pass; return next-token logits (or all positions').

        ``return_hidden`` adds the final-normed hidden state of every position ``[T, d]``."""
        ids = self._check_tokens(tokens)
        T = int(ids.size)
        pos = np.arange(T, dtype=np.int32)
        rows = None if all_logits else np.array([T - 1])
        return self._forward(ids, pos, None, rows, return_hidden, single=not all_logits)

    def prefill_branches(
        self,
        prefix: Sequence[int] | np.ndarray,
        branches: Sequence[Sequence[int] | np.ndarray],
        *,
        return_hidden: bool = False,
    ) -> BranchResult:
        """One forward pass over a shared prefix and several continuations ("branches").

        Each branch attends to the whole prefix and causally to itself, at positions
        ``len(prefix) ..``, exactly as if ``prefix + branch`` were prefilled alone — but the
        prefix is computed once and the experts are streamed once for all branches."""
        pre = self._check_tokens(prefix)
        P = int(pre.size)
        brs = [self._check_tokens(b) for b in branches]
        if not brs:
            raise BadRequestError("need at least one continuation")
        longest = max(int(b.size) for b in brs)
        if P + longest > self.hp.n_ctx:
            raise BadRequestError(
                f"prefix of {P} tokens plus a continuation of {longest} is longer than the "
                f"model context ({self.hp.n_ctx})"
            )
        ids = np.concatenate([pre, *brs]).astype(np.int32)
        pos_parts = [np.arange(P, dtype=np.int32)]
        segments: list[tuple[int, int]] = []
        start = P
        for b in brs:
            n = int(b.size)
            pos_parts.append(np.arange(P, P + n, dtype=np.int32))
            segments.append((start, n))
            start += n
        pos = np.concatenate(pos_parts)
        rows = np.concatenate([[P - 1], np.arange(P, ids.size)])
        res = self._forward(ids, pos, (P, segments), rows, return_hidden, single=False)
        branch_logits = []
        off = 1
        for _, n in segments:
            branch_logits.append(res.logits[off : off + n])
            off += n
        return BranchResult(
            prefix_logits=res.logits[0],
            branch_logits=branch_logits,
            hidden=res.hidden,
            segments=segments,
            metrics=res.metrics,
        )

    def _forward(self, *args: Any, **kwargs: Any) -> PrefillResult:
        """One request; if it fails half-way (read/checksum error, Ctrl-C, ...) the expert
        source is reset so that no layer stays open and no read or thread is left behind: the
        next request on this engine works."""
        try:
            return self._forward_pass(*args, **kwargs)
        except BaseException:
            if not self._closed:
                self.experts.recover()
            raise

    def _forward_pass(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        branches: Branches | None,
        rows: np.ndarray | None,
        return_hidden: bool,
        *,
        single: bool,
    ) -> PrefillResult:
        if self._closed:
            raise RuntimeError("engine is closed")
        htp.set_activation_format(self.act)  # type: ignore[arg-type]
        hp = self.hp
        T = int(ids.size)
        memory.reset_peak()
        # Per-request bookkeeping only: a long-lived engine must not grow without bound.
        self.experts.reset()
        # q8 activations are the fast, approximate path: attention products run in bfloat16
        # there too; f32 keeps every product exact-ish.
        ops = Ops(hp, self.experts, branches, attn_products="bf16" if self.act == "q8" else "f32")
        spans: list[tuple[str, int, float, float]] = []
        op_spans: list[tuple[str, int, float, float]] = []
        show = self.progress and sys.stderr.isatty()
        t_start = time.perf_counter()
        x = ops.embed(self.weights.head, ids)
        op_spans += [(name, -1, s0, s1) for name, s0, s1 in ops.op_spans]
        ops.op_spans.clear()
        for i, w in enumerate(self.weights.layers):
            moe_layer = self.model.layers.get(i)  # None: a dense layer, nothing to read
            t0 = time.perf_counter()
            if moe_layer is not None:
                self.experts.begin_layer(moe_layer)  # reads start before attention
            x = self.arch.layer(ops, hp, w, x, pos)
            if moe_layer is not None:
                self.experts.end_layer()
            t1 = time.perf_counter()
            spans += _non_expert_spans(i, t0, t1, ops.expert_phases)
            op_spans += [("experts", i, s0, s1) for s0, s1 in ops.expert_phases]
            op_spans += [(name, i, s0, s1) for name, s0, s1 in ops.op_spans]
            ops.expert_phases.clear()
            ops.op_spans.clear()
            spans.append(("layer", i, t0, t1))
            if show:
                print(f"\r  layer {i + 1}/{hp.n_layers}", end="", file=sys.stderr, flush=True)
        if show:
            print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        head = self.weights.head
        _check_finite(x)
        hn = ops.rms_norm(np.ascontiguousarray(x if rows is None else x[rows]), head.norm)
        out = ops.output(head, hn)
        hidden = None
        if return_hidden:
            hidden = hn if rows is None else ops.rms_norm(x, head.norm)
        t_end = time.perf_counter()
        spans.append(("output", -1, t0, t_end))
        op_spans += [(name, -1, s0, s1) for name, s0, s1 in ops.op_spans]
        records = list(self.experts.records)
        reads = self.experts.reads()
        metrics = run_metrics(
            t_start=t_start,
            t_end=t_end,
            spans=spans,
            records=records,
            reads=reads,
            bytes_read=self.experts.bytes_read,
            mem_before=self._mem0,
        )
        metrics.update(self._describe(T))
        # Non-expert time of every layer, indexed by layer (dense layers included).
        t_ne = [0.0] * hp.n_layers
        for name, layer, s0, s1 in spans:
            if name == "non-expert":
                t_ne[layer] += s1 - s0
        metrics["layer_t_ne_s"] = t_ne
        metrics["op_time_s"] = op_times(op_spans)
        events = build_events(t_start, spans, records, reads, op_spans)
        return PrefillResult(
            logits=out[0] if single else out,
            hidden=hidden,
            metrics=metrics,
            events=events,
            records=records,
            reads=list(reads),
        )

    def _describe(self, T: int) -> dict[str, Any]:
        c = self.config
        d: dict[str, Any] = {
            "tokens": T,
            "mode": self.mode,
            "schedule": self.schedule if c is not None else None,
            "arch": self.hp.family,
            "threads": htp.get_num_threads(),
            "simd": htp.simd_level(),
            "act": self.act,
            "backend": self.backend.kind,
            "load_s": self.load_s,
            "expert_memory_bytes": int(self.experts.memory_bytes),
            "dense_bytes": int(self.model.dense_bytes),
        }
        if c is not None:
            d.update({"G": c.G, "Q": c.Q, "B": c.B, "config_source": c.source})
        if self.budget is not None:
            d["budget_bytes"] = self.budget
        return d

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.experts.close()
        finally:
            self.graph.close()
            if self.backend is not htp.default_backend():
                self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()


def _non_expert_spans(
    layer: int, t0: float, t1: float, expert_phases: list[tuple[float, float]]
) -> list[tuple[str, int, float, float]]:
    """The parts of a layer's time `[t0, t1]` outside its routed-expert phases."""
    out = []
    start = t0
    for p0, p1 in expert_phases:
        out.append(("non-expert", layer, start, p0))
        start = p1
    out.append(("non-expert", layer, start, t1))
    return out


def _check_counts(**counts: Any) -> None:
    """G, Q, B and the thread count are positive integers when given (never silently a
    default: 0 is an error, and so is 2.5)."""
    for name, v in counts.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise BadRequestError(f"{name} must be a positive integer, got {v!r}")


def _check_finite(x: np.ndarray) -> None:
    """The residual stream after the last layer must be finite. NaN/Inf anywhere upstream stays
    in it (the residual only adds), while int8 activations would turn it into finite garbage
    logits: check once here (O(T·d), cheap) and fail instead of answering wrongly."""
    if not np.isfinite(x).all():
        raise NonFiniteError(
            "the forward pass produced NaN or infinite activations; the model's weights are "
            "corrupt or overflow in this model (try `estream-pack --verify`)"
        )


def load(path: str | Path, **kwargs: Any) -> Engine:
    """Load a packed model (`NAME.estream`) for prefill. See `Engine` for the options."""
    return Engine(path, **kwargs)
