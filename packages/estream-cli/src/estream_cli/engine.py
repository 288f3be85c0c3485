"""The streamed prefill engine: one causal forward pass over a prompt, experts through the arena.

Model graphs follow llama.cpp's conventions per architecture (see `hparams.py`): token embedding,
per layer RMSNorm → attention (q/k-norm where the model has it, RoPE, grouped-KV causal
attention) → residual → RMSNorm → router softmax/top-k → routed experts → residual; final norm
and output head. Dense weights are resident; experts come from an `ExpertSource`.
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

import estream_htp as htp

from . import memory
from .errors import BadRequestError, PackError
from .experts import SCHEDULES, GroupRecord, ResidentExperts, StreamedExperts
from .packed import PackedModel

__all__ = ["ACTS", "MODES", "BranchResult", "Engine", "PrefillResult", "StreamConfig", "load"]

MODES = ("stream", "resident", "naive", "layer")
# How activations meet the Q4_0/Q8_0 weights: "q8" (int8 per 32-block, like GGML's Q8_0: fast)
# or "f32" (dequantized weights, fp32 products: matches a float64 reference to ~1e-6).
ACTS = ("q8", "f32")
DEFAULT_THREADS = max(1, min(os.cpu_count() or 1, 8))


@attrs.frozen
class StreamConfig:
    G: int
    Q: int
    B: int
    source: str  # where it came from: explicit | manifest | budget | mode | default

    def arena_bytes(self, model: PackedModel) -> int:
        return self.B * self.G * sum(size for _, size in model.plane_extents)


@attrs.frozen
class PrefillResult:
    """Logits (last position, or all positions), optional hidden state, and the run's metrics."""

    logits: np.ndarray  # [n_vocab] or [T, n_vocab]
    hidden: np.ndarray | None  # final-normed hidden state [T, d] when asked for
    metrics: dict[str, Any]
    events: list[Any] = attrs.field(repr=False)  # estream_sched.TraceEvent
    records: list[GroupRecord] = attrs.field(repr=False, factory=list)
    reads: list[Any] = attrs.field(repr=False, factory=list)

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


def _resolve_config(
    model: PackedModel,
    mode: str,
    budget: int | None,
    G: int | None,
    Q: int | None,
    B: int | None,
) -> StreamConfig | None:
    hp = model.hparams
    if mode == "resident":
        return None
    if mode == "naive":
        return StreamConfig(1, 1, 3, "mode")
    if mode == "layer":
        return StreamConfig(hp.n_experts, 2, 2, "mode")
    if G or Q or B:
        g = G or 4
        q = Q or 2
        b = B or max(q, 2)
        return StreamConfig(min(g, hp.n_experts), q, b, "explicit")
    if budget is not None:
        from .profiling import configure_for_budget

        choice = configure_for_budget(model, budget)
        return StreamConfig(int(choice.G), int(choice.Q), int(choice.B), "budget")
    cfg = model.manifest.get("config")
    if cfg:
        return StreamConfig(int(cfg["G"]), int(cfg["Q"]), int(cfg["B"]), "manifest")
    g = min(4, hp.n_experts)
    return StreamConfig(g, 2, 4, "default")


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
        t0 = time.perf_counter()
        self._closed = False
        self._mem0 = memory.mem_available()
        self.mode, self.schedule = mode, schedule
        self.progress = progress
        self.model = PackedModel(path)
        self.hp = self.model.hparams
        self.budget = memory.parse_bytes(budget) if budget is not None else None
        self.config = _resolve_config(self.model, mode, self.budget, G, Q, B)
        htp.set_num_threads(int(n_threads or DEFAULT_THREADS))
        self.model.load_dense()
        self._bind_weights()
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
            if self.config is None:
                self.experts: Any = ResidentExperts(self.model, self.graph)
            else:
                c = self.config
                if c.G < 1 or c.Q < 1 or c.B < 1:
                    raise BadRequestError(f"G, Q and B must be ≥ 1 (got G={c.G}, Q={c.Q}, B={c.B})")
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

    # -- weights ---------------------------------------------------------------------------
    def _bind_weights(self) -> None:
        m = self.model
        hp = self.hp
        self.tok_embd = m.dense("token_embd.weight")
        self.output_norm = m.dense("output_norm.weight").f32()
        self.output = m.dense("output.weight") if m.has("output.weight") else self.tok_embd
        self.blocks: list[dict[str, Any]] = []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            b: dict[str, Any] = {
                "attn_norm": m.dense(p + "attn_norm.weight").f32(),
                "wq": m.dense(p + "attn_q.weight"),
                "wk": m.dense(p + "attn_k.weight"),
                "wv": m.dense(p + "attn_v.weight"),
                "wo": m.dense(p + "attn_output.weight"),
                "ffn_norm": m.dense(p + "ffn_norm.weight").f32(),
            }
            if hp.qk_norm:
                b["q_norm"] = m.dense(p + "attn_q_norm.weight").f32()
                b["k_norm"] = m.dense(p + "attn_k_norm.weight").f32()
            if i in m.layers:
                router = m.dense(p + "ffn_gate_inp.weight").f32()
                b["router_t"] = np.ascontiguousarray(router.T)  # [d, E] for x @ W
            else:
                raise PackError(f"layer {i} has no experts: dense FFN layers are not supported yet")
            self.blocks.append(b)

    # -- ops -------------------------------------------------------------------------------
    @staticmethod
    def _matmul(x: np.ndarray, w: Any) -> np.ndarray:
        if w.fmt == "f32":
            return x @ w.f32().T
        return htp.gemm(x, w.data, w.shape[0], w.fmt)

    def _attention(
        self,
        b: dict[str, Any],
        h: np.ndarray,
        pos: np.ndarray,
        branches: tuple[int, list[tuple[int, int]]] | None = None,
    ) -> np.ndarray:
        hp = self.hp
        t = h.shape[0]
        q = self._matmul(h, b["wq"])
        k = self._matmul(h, b["wk"])
        v = self._matmul(h, b["wv"])
        if hp.qk_norm == "full":
            q = htp.rms_norm(q, b["q_norm"], hp.rms_eps)
            k = htp.rms_norm(k, b["k_norm"], hp.rms_eps)
        elif hp.qk_norm == "head":
            q = htp.rms_norm_heads(q, b["q_norm"], hp.n_head, hp.rms_eps)
            k = htp.rms_norm_heads(k, b["k_norm"], hp.n_head_kv, hp.rms_eps)
        q = np.ascontiguousarray(q.reshape(t, hp.n_head, hp.head_dim))
        k = np.ascontiguousarray(k.reshape(t, hp.n_head_kv, hp.head_dim))
        v = np.ascontiguousarray(v.reshape(t, hp.n_head_kv, -1))
        htp.rope(q, pos, hp.n_rot, hp.rope_base, hp.rope_scale, hp.rope)
        htp.rope(k, pos, hp.n_rot, hp.rope_base, hp.rope_scale, hp.rope)
        if branches is None:
            a = htp.attention(q, k, v, hp.attn_scale, causal=True)
        else:
            a = self._branch_attention(q, k, v, *branches)
        return self._matmul(np.ascontiguousarray(a.reshape(t, -1)), b["wo"])

    def _branch_attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        n_prefix: int,
        segments: list[tuple[int, int]],
    ) -> np.ndarray:
        """Shared prefix (causal) + branches that each see the prefix and themselves (causal).

        The prefix goes through the tiled kernel; each branch is short and attends to
        ``n_prefix + len`` keys, done with BLAS (float32) per branch."""
        hp = self.hp
        out = np.empty((q.shape[0], hp.n_head, v.shape[2]), dtype=np.float32)
        P = n_prefix
        out[:P] = htp.attention(q[:P], k[:P], v[:P], hp.attn_scale, causal=True)
        rep = hp.n_head // hp.n_head_kv
        for s, n in segments:
            kk = np.concatenate((k[:P], k[s : s + n]))  # [P+n, Hkv, D]
            vv = np.concatenate((v[:P], v[s : s + n]))
            kk = np.repeat(kk, rep, axis=1).transpose(1, 2, 0)  # [H, D, P+n]
            vv = np.repeat(vv, rep, axis=1).transpose(1, 0, 2)  # [H, P+n, Dv]
            qq = q[s : s + n].transpose(1, 0, 2)  # [H, n, D]
            sc = np.matmul(qq, kk) * np.float32(hp.attn_scale)  # [H, n, P+n]
            mask = np.triu(np.ones((n, n), dtype=bool), k=1)
            sc[:, :, P:][:, mask] = -np.inf
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(axis=-1, keepdims=True)
            out[s : s + n] = np.matmul(sc, vv).transpose(1, 0, 2)
        return out

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

    def _forward(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        branches: tuple[int, list[tuple[int, int]]] | None,
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
        self.experts.records.clear()
        if self.config is not None:
            self.experts.loader.reset_stats()
        spans: list[tuple[str, int, float, float]] = []
        t_start = time.perf_counter()
        x = htp.get_rows(self.tok_embd.data, self.tok_embd.fmt, hp.n_vocab, hp.n_embd, ids)
        y = np.empty((T, hp.n_embd), dtype=np.float32)
        show = self.progress and sys.stderr.isatty()
        for i, b in enumerate(self.blocks):
            layer = self.model.layers[i]
            t0 = time.perf_counter()
            self.experts.begin_layer(layer)
            h = htp.rms_norm(x, b["attn_norm"], hp.rms_eps)
            x += self._attention(b, h, pos, branches)
            h = htp.rms_norm(x, b["ffn_norm"], hp.rms_eps)
            logits = h @ b["router_t"]
            top_ids, top_w = htp.router_topk(
                logits,
                hp.n_experts_used,
                gating="softmax",
                norm=hp.norm_topk,
                scale=hp.expert_weights_scale,
            )
            t1 = time.perf_counter()
            spans.append(("non-expert", i, t0, t1))
            y.fill(0.0)
            self.experts.run_layer(layer, h, top_ids, top_w, y)
            self.experts.end_layer()
            x += y
            spans.append(("layer", i, t0, time.perf_counter()))
            if show:
                print(f"\r  layer {i + 1}/{hp.n_layers}", end="", file=sys.stderr, flush=True)
        if show:
            print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        xs = x if rows is None else x[rows]
        hn = htp.rms_norm(np.ascontiguousarray(xs), self.output_norm, hp.rms_eps)
        out = self._matmul(hn, self.output)[:, : hp.n_vocab]
        hidden = None
        if return_hidden:
            hidden = hn if rows is None else htp.rms_norm(x, self.output_norm, hp.rms_eps)
        t_end = time.perf_counter()
        spans.append(("output", -1, t0, t_end))
        records = list(self.experts.records)
        reads = self._reads_so_far()
        bytes_read = self.experts.bytes_read if self.config is not None else 0
        from .metrics import build_events, run_metrics

        metrics = run_metrics(
            t_start=t_start,
            t_end=t_end,
            spans=spans,
            records=records,
            reads=reads,
            bytes_read=bytes_read,
            mem_before=self._mem0,
        )
        metrics.update(self._describe(T))
        metrics["layer_t_ne_s"] = [t1 - t0 for name, _, t0, t1 in spans if name == "non-expert"]
        events = build_events(t_start, spans, records, reads)
        return PrefillResult(
            logits=out[0] if single else out,
            hidden=hidden,
            metrics=metrics,
            events=events,
            records=list(records),
            reads=list(reads),
        )

    def _reads_so_far(self) -> list[Any]:
        if self.config is None:
            return []
        return list(self.experts.loader.stats.events)

    def _describe(self, T: int) -> dict[str, Any]:
        c = self.config
        d: dict[str, Any] = {
            "tokens": T,
            "mode": self.mode,
            "schedule": self.schedule if c is not None else None,
            "arch": self.hp.arch,
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


def load(path: str | Path, **kwargs: Any) -> Engine:
    """Load a packed model (`NAME.estream`) for prefill. See `Engine` for the options."""
    return Engine(path, **kwargs)
