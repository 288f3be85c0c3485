"""The streamed prefill engine: one causal forward pass over a prompt, experts through the arena.

The forward pass of each architecture is its own module in `estream.models` (llama.cpp's
`src/models/<arch>.cpp`), written over the ops of `models.ops` and the weight records of
`models.weights`. This module holds the generic loop around it — embedding, for each layer
"the layer starts (its experts begin to load), run the layer", final norm and output head —
which calls a `recorder.PassRecorder` at its stage boundaries for spans, metrics and progress.
Dense weights are resident; experts come from an `ExpertSource`. `EngineOptions` are the
engine's options, checked once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import estream_arena as ea
import estream_htp as htp
import estream_sched as es

from . import memory
from .config import (
    DEFAULT_THREADS,
    OverBudgetWarning,
    StreamConfig,
    pass_bytes_per_token,
    profile_tokens,
    prompt_extra_rate,
    resolve_config,
    warn_stale,
)
from .errors import BadRequestError, EngineClosedError, NonFiniteError
from .experts import (
    SCHEDULES,
    ExpertSource,
    GLUGraph,
    GroupRecord,
    ResidentExperts,
    StreamedExperts,
)
from .models import architecture
from .models.layout import SeqLayout
from .models.ops import Ops, copy_bytes
from .packed import PackedModel
from .recorder import PassRecorder

__all__ = [
    "ACTS",
    "ATTENTION",
    "DEFAULT_ACTIVATION_BYTES",
    "MODES",
    "BranchRequest",
    "BranchResult",
    "Engine",
    "EngineOptions",
    "PrefillResult",
    "Request",
    "StreamConfig",
    "load",
    "pass_bytes_per_token",
    "resolve_attention",
]

MODES = ("stream", "resident", "naive", "layer")
# How activations meet the Q4_0/Q8_0 weights: "q8" (int8 per 32-block, like GGML's Q8_0: fast)
# or "f32" (dequantized weights, fp32 products: matches a float64 reference to ~1e-6).
ACTS = ("q8", "f32")
# How the attention kernel multiplies: "f32" (exact products), "bf16" (q·scale, k, v and the
# softmax weights rounded to bfloat16, fp32 sums: about twice the fp32 rate where the CPU
# multiplies bf16 natively, a few 1e-3 off per op), "bf16-pv" (fp32 scores; only the softmax
# weights and v rounded to bfloat16, so half the products at the bf16 rate and about half
# bf16's error) or "auto", the default: resolved at load by `resolve_attention`, under act "q8"
# where the dense ops' kernel set runs bf16 attention natively
# (`estream_htp.native_bf16_attention`) the architecture's ``ATTENTION_AUTO`` (bf16 where every
# row of docs/benchmarks.md's parity table shows its q8 error within 5 % of fp32 attention's,
# else f32), else f32 (always f32 under act "f32", which keeps to a float64 reference to ~1e-5).
ATTENTION = ("auto", "f32", "bf16", "bf16-pv")
# Where the dense kernel ops (GEMMs, norms, RoPE, attention, ...) run: this process's default
# backend, or the expert backend (its executor process: the DSP for `hexagon`).
DENSE_OPS = ("host", "backend")
#: Activation memory a pass of `Engine.prefill_many` may use when no budget says otherwise.
DEFAULT_ACTIVATION_BYTES = 256 << 20
MIN_BATCH_TOKENS, MAX_BATCH_TOKENS = 64, 8192
#: Most tokens one pass takes (what the expert op is sized for).
MAX_PASS_TOKENS = 1 << 16
#: Times in a row an engine starts a new executor after its executor process died (a pass
#: that completes resets the count); one more death closes the engine's backend for good.
MAX_EXECUTOR_RESTARTS = 2


def _arrays(obj: object) -> list[np.ndarray]:
    """The distinct numpy arrays held in bound weights (attrs records, tuples, lists, dicts)."""
    found: dict[int, np.ndarray] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, np.ndarray):
            found[id(o)] = o
        elif attrs.has(type(o)):
            stack.extend(getattr(o, f.name) for f in attrs.fields(type(o)))
        elif isinstance(o, tuple | list):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return list(found.values())


@attrs.frozen
class BranchRequest:
    """A shared prefix and its continuations as one request of `Engine.prefill_batch`."""

    prefix: Sequence[int] | np.ndarray
    branches: Sequence[Sequence[int] | np.ndarray]


#: What `Engine.prefill_batch` takes: a token sequence or a shared prefix with branches.
Request = Sequence[int] | np.ndarray | BranchRequest


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


def _one_of(choices: Sequence[str]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise BadRequestError(f"{attr.name} must be one of {', '.join(choices)}, got {value!r}")

    return check


def _count(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    _check_counts(**{attr.name: value})


def _budget_tokens(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BadRequestError(f"{attr.name} must be an int >= 1, got {value!r}")


def _read_margin(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        try:
            es.check_read_margin(value)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None


def _bytes(value: int | str | None) -> int | None:
    return None if value is None else memory.parse_bytes(value)


#: ``pin="auto"`` leaves this share of the budget unpinned beyond the predicted memory: the
#: prediction is a model (on the OLMoE-shaped pack at G=32, a 1K pass that pinned nothing peaked
#: at 683 MiB against 696 MiB predicted, the profile's measured memory per token included; with
#: 648 MiB pinned at 1K it peaked at 1.31 GiB under a 1.5 GiB budget).
PIN_AUTO_MARGIN = 0.10


def _pin(value: int | str | None) -> int | str | None:
    return value if value is None or value == "auto" else memory.parse_bytes(value)


@attrs.frozen(kw_only=True)
class EngineOptions:
    """How an `Engine` runs. Each option is checked when the options are made (a
    `BadRequestError` naming it, nothing opened yet); `Engine(path, **kw)` makes them from
    its keyword arguments.

    ``mode``: one of `MODES`; ``schedule``: when the streamed experts are read (`SCHEDULES`);
    ``budget``: memory for the run (bytes or "1.5GiB"; a stored profile picks ``G, Q, B`` for
    it, for prompts of ``budget_tokens``); ``G, Q, B``: group size, read queue depth, banks
    (explicit); ``n_threads``: the kernels' pool; ``verify``: check every checksum as it is
    read; ``direct``: O_DIRECT reads (None: where supported); ``progress``: a layer counter on
    a terminal; ``act``, ``attention``: how the kernels multiply (`ACTS`, `ATTENTION`; the
    engine's ``attention`` is the precision "auto" resolved to, `resolve_attention`);
    ``backend``: where the expert ops run (`estream_htp.BACKENDS`); ``dense_ops``: where the
    other ops run (`DENSE_OPS`; None: on the backend if it is an accelerator, else here);
    ``op_stats``: count every op's work and add the per-op table (`estream.opstats`) to each
    pass's metrics as ``op_table`` (off: nothing is counted); ``pin``: memory (bytes or
    "800MiB") for streamed experts read once at load and kept for every pass (whole groups:
    group 0 of every layer, then group 1, ...), or "auto": what ``budget`` leaves over the
    run's predicted memory for ``budget_tokens`` tokens less `PIN_AUTO_MARGIN` of the budget
    (`Engine.pin_bytes`); ``read_margin``: with ``budget``, ``G, Q, B`` are chosen for reads
    that much longer than the profile measured (None: `estream_sched.DEFAULT_READ_MARGIN`,
    0.5; 0: for the profiled disk exactly)."""

    dense_ops: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_one_of(DENSE_OPS))
    )
    act: str = attrs.field(default="q8", validator=_one_of(ACTS))
    attention: str = attrs.field(default="auto", validator=_one_of(ATTENTION))
    backend: str = attrs.field(default="host", validator=_one_of(htp.BACKENDS))
    mode: str = attrs.field(default="stream", validator=_one_of(MODES))
    schedule: str = attrs.field(default="early", validator=_one_of(SCHEDULES))
    G: int | None = attrs.field(default=None, validator=_count)
    Q: int | None = attrs.field(default=None, validator=_count)
    B: int | None = attrs.field(default=None, validator=_count)
    n_threads: int | None = attrs.field(default=None, validator=_count)
    budget_tokens: int | None = attrs.field(default=None, validator=_budget_tokens)
    budget: int | None = attrs.field(default=None, converter=_bytes)
    verify: bool = False
    direct: bool | None = None
    progress: bool = False
    op_stats: bool = False
    pin: int | str | None = attrs.field(default=None, converter=_pin)
    read_margin: float | None = attrs.field(default=None, validator=_read_margin)


class Engine:
    """A loaded packed model, ready to prefill prompts.

    An engine may be shared between threads: its passes are serialized by a lock (one pass
    runs at a time, the others wait their turn and get the results they would get alone), and
    `close` waits for a running pass to finish; a pass asked for after `close` raises
    `EngineClosedError`.

    >>> engine = load("model.estream", budget="1.5GiB")   # doctest: +SKIP
    >>> engine.prefill([1, 2, 3]).top_k(5)                 # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: EngineOptions | None = None,
        **kwargs: Any,
    ) -> None:
        """Load the pack at ``path`` with ``options``, or with the keyword arguments of
        `EngineOptions` (checked before anything is opened)."""
        if options is None:
            options = EngineOptions(**kwargs)
        elif kwargs:
            raise TypeError("Engine takes EngineOptions or keyword options, not both")
        o = self.options = options
        t0 = time.perf_counter()
        self._closed = False
        # one pass at a time: a pass owns the arena, the backend's buffers and the counters
        self._lock = threading.RLock()
        self._n_passes = 0  # passes run, numbering each pass's metrics ("pass_id")
        self._mem0 = memory.mem_available()
        memory.keep_freed_heap()  # per-op arrays reuse heap pages (see memory.keep_freed_heap)
        self.mode, self.schedule, self.progress = o.mode, o.schedule, o.progress
        self.act = o.act
        self.budget, self.budget_tokens = o.budget, o.budget_tokens
        self.model = PackedModel(path)
        self.hp = hp = self.model.hparams
        self.config = resolve_config(
            self.model,
            o.mode,
            o.budget,
            o.G,
            o.Q,
            o.B,
            o.budget_tokens,
            o.schedule,
            n_threads=int(o.n_threads or DEFAULT_THREADS),
            act=o.act,
            backend=o.backend,
            read_margin=o.read_margin,
        )
        warn_stale(self.config)  # a stale profile's choice not taken: say so
        #: with a budget: the pass length its configuration was chosen for, and the profile's
        #: pass length and memory per token beyond it (`predicted_bytes`), read once here
        self._budget_rows: int | None = None
        self._extra_rate = (0, 0)
        if o.budget is not None:
            self._extra_rate = prompt_extra_rate(self.model)
            self._budget_rows = int(o.budget_tokens or self._extra_rate[0])
        #: memory asked for pinned experts (0: none); whole groups of it are pinned
        self.pin_bytes = self._resolve_pin(o)
        self.arch = architecture(hp)
        htp.set_num_threads(int(o.n_threads or DEFAULT_THREADS))
        self._capacity = 4096
        self.max_pass_tokens = max(hp.n_ctx, MAX_PASS_TOKENS)
        self._restarts = 0  # executors started in a row after one died (MAX_EXECUTOR_RESTARTS)
        self._open_backend()
        self.dense_ops = o.dense_ops or ("backend" if self.backend.accelerator else "host")
        # what every pass runs and every result reports ("auto" resolved once, here)
        self.attention = resolve_attention(
            o.attention,
            o.act,
            self.backend if self.dense_ops == "backend" else htp.default_backend(),
            native=self.arch.ATTENTION_AUTO,
        )
        # every op of a pass on the expert backend (dense_ops="backend"): activations in its
        # arena (memory registered with its executor; private memory on the host)
        self._pool = self.backend.activations() if self.dense_ops == "backend" else None
        self.experts: ExpertSource | None = None  # type: ignore[assignment]
        try:
            self.experts = self._open_experts()
            # Streamed (schedule "early"): the first MoE layer's reads are running by now, so
            # the dense weights load and bind while they fill the arena.
            self.model.load_dense(verify=o.verify)
            self.weights = self.arch.bind(self.model)
        except BaseException:
            self._closed = True  # nothing for close()/__del__ to do twice
            if self.experts is not None:
                self.experts.close()
            self.graph.close()
            if self.backend is not htp.default_backend():
                self.backend.close()
            raise
        self.load_s = time.perf_counter() - t0

    def _resolve_pin(self, o: EngineOptions) -> int:
        """The bytes ``o.pin`` asks for, checked against the mode and the budget."""
        if o.pin is None:
            return 0
        c = self.config
        if c is None:
            raise BadRequestError(f"pin keeps streamed experts; mode {o.mode!r} streams none")
        room = None
        # the prediction holds the activations of a budget_tokens prompt (`configure_for_budget`)
        tokens = int(o.budget_tokens or profile_tokens(self.model))
        if o.budget is not None and c.memory_bytes is not None:
            room = o.budget - c.memory_bytes
        if o.pin == "auto":
            if room is None:
                raise BadRequestError(
                    'pin="auto" pins what the memory budget leaves over the run\'s predicted '
                    "memory: give a budget (and a pack with a fresh profile)"
                )
            return max(0, int(room) - int(PIN_AUTO_MARGIN * o.budget))
        pin = int(o.pin)
        if room is not None and pin > room:
            raise BadRequestError(
                f"pin {memory.format_bytes(pin)} does not fit the budget: "
                f"{memory.format_bytes(o.budget)} leaves {memory.format_bytes(max(room, 0))} "
                f"over the run's predicted memory ({memory.format_bytes(c.memory_bytes)} for "
                f"{tokens} tokens)"
            )
        return pin

    def _open_backend(self) -> None:
        """The backend (a new executor process unless "host") and the expert graph on it."""
        o, hp = self.options, self.hp
        # Expert ops run on the chosen backend; the other ops stay on this process's default one
        # unless it is an accelerator, which runs every op (the DSP: hexagon).
        self.backend = htp.open_backend(o.backend, n_threads=htp.get_num_threads(), act=o.act)
        # the experts' tile formats (gate, up, down); Q4_0 records use the graph's default
        fmts = self.model.expert_formats
        self.graph = htp.ExpertGraph(
            hp.n_embd,
            hp.n_ff_exp,
            self._capacity,
            self.max_pass_tokens,
            backend=self.backend,
            **({} if fmts == ("q4_0-t32r4",) * 3 else {"formats": fmts}),
        )
        # dense weights registered with the backend (dense_ops="backend"), on first use
        self._dense_shared: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _restart_executor(self) -> None:
        """After the executor process died: a new one, with the graph, the activation pool
        and the expert source on it (at most `MAX_EXECUTOR_RESTARTS` times in a row)."""
        if self._restarts >= MAX_EXECUTOR_RESTARTS:
            raise htp.ExecutorDiedError(
                f"the {self.options.backend} executor died {self._restarts + 1} times in a row; "
                "load the model again"
            )
        self._restarts += 1
        self.graph.close()
        if not self.backend.closed and self.backend is not htp.default_backend():
            self.backend.close()
        self._pool = None
        self._open_backend()
        try:
            if self.dense_ops == "backend":
                self._pool = self.backend.activations()
            self.experts = self._open_experts()
        except BaseException:
            self.backend.close()
            raise

    def _open_experts(self) -> ExpertSource:
        """The expert source of the configuration: resident (no arena) or streamed."""
        o, c = self.options, self.config
        if c is None:
            return ResidentExperts(self.model, self.graph, verify=o.verify)
        return StreamedExperts(
            self.model,
            self.graph,
            group_size=c.G,
            queue_depth=c.Q,
            n_banks=c.B,
            schedule=o.schedule,
            verify=o.verify,
            direct=o.direct,
            pin_bytes=self.pin_bytes,
        )

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

    def check_request(self, request: Request) -> list[np.ndarray]:
        """A request's token ids, checked: ``[ids]`` for a sequence, ``[prefix, *branches]``
        for a `BranchRequest`. Raises `BadRequestError` on a bad request (nothing runs)."""
        if not isinstance(request, BranchRequest):
            return [self._check_tokens(request)]
        pre = self._check_tokens(request.prefix)
        if isinstance(request.branches, str | bytes) or not len(request.branches):
            raise BadRequestError("need at least one continuation")
        brs = [self._check_tokens(b) for b in request.branches]
        longest = max(int(b.size) for b in brs)
        if pre.size + longest > self.hp.n_ctx:
            raise BadRequestError(
                f"prefix of {pre.size} tokens plus a continuation of {longest} is longer than "
                f"the model context ({self.hp.n_ctx})"
            )
        return [pre, *brs]

    def prefill(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        all_logits: bool = False,
        return_hidden: bool = False,
    ) -> PrefillResult:
        """Run one causal forward pass; return next-token logits (or all positions').

        ``return_hidden`` adds the final-normed hidden state of every position ``[T, d]``.
        The metrics are the pass's (see `prefill_batch` for a pass of several requests)."""
        (res,), _ = self._batch([self.check_request(tokens)], all_logits, return_hidden, False)
        return res  # type: ignore[return-value]

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
        parts = self.check_request(BranchRequest(prefix, branches))
        (res,), _ = self._batch([parts], False, return_hidden, False)
        return res  # type: ignore[return-value]

    def prefill_batch(
        self,
        requests: Sequence[Request],
        *,
        all_logits: bool = False,
        return_hidden: bool = False,
    ) -> list[Any]:
        """Several independent requests in ONE forward pass: each expert group is streamed
        once for all of them.

        A request is a token sequence (its result a `PrefillResult`: ``logits`` of the last
        position, or ``[T_i, n_vocab]`` with ``all_logits``; ``hidden [T_i, d]`` with
        ``return_hidden``) or a `BranchRequest` (its result a `BranchResult`, as
        `prefill_branches` gives). The tokens are packed one request after another; attention
        is block-diagonal over requests and causal within each, positions restart at 0 per
        request, and short convolutions never see another request's rows: each result equals
        that of the request run alone (to float rounding: every kernel computes a row by itself,
        BLAS products run per request).

        Every result's ``metrics`` holds the request's own ``tokens``, its ``index`` in the
        pass and ``pass``: the pass's metrics (one dict shared by all its results: time, bytes
        read, peak memory, ``requests``, ``tokens`` of the whole pass, …)."""
        if isinstance(requests, str | bytes | np.ndarray) or not len(requests):
            raise BadRequestError("need a non-empty list of requests")
        parts = [self.check_request(r) for r in requests]
        results, _ = self._batch(parts, all_logits, return_hidden, True)
        return results

    def prefill_many(
        self,
        requests: Iterable[Request],
        *,
        batch_tokens: int | None = None,
        all_logits: bool = False,
        return_hidden: bool = False,
        return_exceptions: bool = False,
    ) -> Iterator[Any]:
        """Results of ``requests`` in order, run as passes of `prefill_batch` formed in arrival
        order: a pass takes requests while their tokens fit in ``batch_tokens`` (default
        `default_batch_tokens`); a request longer than that runs alone.

        Each request is checked before any pass is formed. When a pass fails (a read error,
        NaN, …) its requests are run again one by one, so that one bad request cannot lose the
        others' results; a request that fails on its own raises — or, with
        ``return_exceptions``, its exception is yielded in its place (checking errors too).
        Ctrl-C is never retried."""
        requests = list(requests)
        if batch_tokens is None:  # a branch request returns logits for all its branch tokens
            rows = all_logits or any(isinstance(r, BranchRequest) for r in requests)
            batch_tokens = self.default_batch_tokens(all_logits=rows)
        _check_counts(batch_tokens=batch_tokens)
        limit = min(int(batch_tokens), self.max_pass_tokens)
        pending: list[tuple[list[np.ndarray] | None, BaseException | None]] = []
        total = 0

        def flush() -> Iterator[Any]:
            nonlocal total
            batch = [p for p, _ in pending if p is not None]
            results: list[Any] = []
            if batch:
                try:
                    results, _ = self._batch(batch, all_logits, return_hidden, True)
                except Exception as exc:
                    if len(batch) == 1:
                        results = [exc]
                    else:  # one by one: a request's failure must not lose the others'
                        results = []
                        for p in batch:
                            try:
                                results += self._batch([p], all_logits, return_hidden, True)[0]
                            except Exception as exc1:
                                results.append(exc1)
            it = iter(results)
            for p, err in list(pending):
                out = err if p is None else next(it)
                if isinstance(out, BaseException) and not return_exceptions:
                    pending.clear()
                    raise out
                yield out
            pending.clear()
            total = 0

        for req in requests:
            try:
                parts = self.check_request(req)
            except BadRequestError as exc:
                if not return_exceptions:
                    yield from flush()
                    raise
                pending.append((None, exc))
                continue
            n = sum(int(p.size) for p in parts)
            if pending and total + n > limit:
                yield from flush()
            pending.append((parts, None))
            total += n
        yield from flush()

    def predicted_bytes(self, tokens: int) -> int | None:
        """The configurator's predicted memory of a pass of ``tokens`` rows on this engine: its
        configuration's prediction with the activations of the rows beyond the profile's pass
        (`prompt_extra_bytes`) and the pinned experts; None when no memory budget chose the
        configuration from a profile."""
        c = self.config
        if self.budget is None or c is None or c.memory_bytes is None:
            return None
        pinned = getattr(self.experts, "pinned_bytes", 0)  # not in the prediction
        t0, per = self._extra_rate  # `prompt_extra_bytes` of the profile read at load
        extra = max(0, int(tokens) - t0) * per
        return int(c.memory_bytes - c.extra_bytes + pinned + extra)

    def _warn_over_budget(self, n_rows: int) -> None:
        """`OverBudgetWarning` for a pass longer than the budget's configuration was chosen
        for whose predicted memory is above the budget."""
        if self._budget_rows is None or n_rows <= self._budget_rows:
            return
        predicted = self.predicted_bytes(n_rows)
        if predicted is None or self.budget is None or predicted <= self.budget:
            return
        c = self.config
        assert c is not None
        w = OverBudgetWarning(n_rows, predicted, self.budget, self._budget_rows, (c.G, c.Q, c.B))
        warnings.warn(w, stacklevel=2)

    def default_batch_tokens(self, *, all_logits: bool = False) -> int:
        """Tokens per pass for `prefill_many` when none is given: the activation memory a
        pass may use divided by `pass_bytes_per_token` (README: "Batching"), clamped to
        ``[MIN_BATCH_TOKENS, MAX_BATCH_TOKENS]``.

        The allowance is `DEFAULT_ACTIVATION_BYTES`; with a memory budget whose configuration
        was chosen from a stored profile, it is the budget's headroom over that choice's
        predicted memory plus the activations of the profile's own pass (already counted in
        its measured non-arena memory)."""
        per_token = pass_bytes_per_token(self.hp, all_logits=all_logits)
        allowance = DEFAULT_ACTIVATION_BYTES
        t0 = self._extra_rate[0]
        # the predicted memory of the profile's own pass (not of the budget_tokens prompt's
        # longer one): the activations beyond it are what is allowed here
        predicted = self.predicted_bytes(t0)
        if predicted is not None and self.budget is not None:
            allowance = self.budget - predicted + t0 * per_token
        n = allowance // per_token
        return int(max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, n)))

    def _batch(
        self,
        parts: list[list[np.ndarray]],
        all_logits: bool,
        return_hidden: bool,
        nested: bool,
    ) -> tuple[list[Any], dict[str, Any]]:
        """One pass over checked requests (`check_request`); their results and the pass's
        metrics. ``nested``: per-request metrics with the pass's under ``pass`` (else, for a
        one-request pass, the pass's metrics themselves). Passes run one at a time (the
        engine's lock)."""
        with self._lock:
            return self._batch_locked(parts, all_logits, return_hidden, nested)

    def _batch_locked(
        self,
        parts: list[list[np.ndarray]],
        all_logits: bool,
        return_hidden: bool,
        nested: bool,
    ) -> tuple[list[Any], dict[str, Any]]:
        n_rows = sum(int(p.size) for ps in parts for p in ps)
        if n_rows > self.max_pass_tokens:
            raise BadRequestError(
                f"a pass of {n_rows} tokens is more than this engine takes ({self.max_pass_tokens})"
            )
        self._warn_over_budget(n_rows)
        layout = SeqLayout.pack([[int(p.size) for p in ps] for ps in parts])
        ids = np.concatenate([p for ps in parts for p in ps]).astype(np.int32)
        rows: list[np.ndarray] = []
        out_spans: list[tuple[int, int]] = []
        n_out = 0
        for ps, (a, b) in zip(parts, layout.requests, strict=True):
            if len(ps) > 1:  # a branch request: after the prefix, and every branch position
                P = int(ps[0].size)
                r = np.concatenate([[a + P - 1], np.arange(a + P, b)])
            elif all_logits:
                r = np.arange(a, b)
            else:
                r = np.array([b - 1])
            rows.append(r)
            out_spans.append((n_out, n_out + r.size))
            n_out += r.size
        every = n_out == n_rows  # every row's logits (plain requests, all_logits)
        out, hidden, metrics, extra = self._forward(
            ids, layout, None if every else np.concatenate(rows), return_hidden
        )
        metrics["requests"] = len(parts)
        metrics["pass_id"] = self._n_passes
        self._n_passes += 1
        results = []
        for i, (ps, (a, b), (o0, o1)) in enumerate(
            zip(parts, layout.requests, out_spans, strict=True)
        ):
            hid = hidden[a:b] if hidden is not None else None
            m = {"tokens": b - a, "index": i, "pass": metrics} if nested else metrics
            if len(ps) > 1:
                P = int(ps[0].size)
                segs, off, start = [], o0 + 1, P
                branch_logits = []
                for br in ps[1:]:
                    n = int(br.size)
                    branch_logits.append(out[off : off + n])
                    segs.append((start, n))
                    off += n
                    start += n
                results.append(BranchResult(out[o0], branch_logits, hid, segs, m))
            else:
                lg = out[o0:o1] if all_logits else out[o0]
                results.append(PrefillResult(logits=lg, hidden=hid, metrics=m, **extra))
        return results, metrics

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """One pass; if it fails half-way (read/checksum error, Ctrl-C, ...) the expert
        source is reset so that no layer stays open and no read or thread is left behind: the
        next request on this engine works."""
        try:
            out = self._forward_pass(*args, **kwargs)
        except BaseException:
            self._recover()
            raise
        self._restarts = 0
        return out

    def _recover(self) -> None:
        """After a pass failed half-way: wait for the ops it left in flight (they may still
        use the arena's banks and the activations), then reset the expert source. If the
        executor died, the expert source is closed and the next pass starts a new executor."""
        self.backend.trace = None  # the DSP queue of a failed pass is not kept
        if self._closed or self.experts is None:
            return
        if not self.backend.closed:
            with contextlib.suppress(htp.ExecutorDiedError):
                self.backend.drain()
        if self.backend.closed:  # the executor died: nothing of this backend can be reused
            experts, self.experts = self.experts, None
            experts.close()
            return
        self.experts.recover()

    def _forward_pass(
        self,
        ids: np.ndarray,
        layout: SeqLayout,
        rows: np.ndarray | None,
        return_hidden: bool,
    ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any], dict[str, Any]]:
        """One causal pass over packed rows: embedding, the layers, final norm, output head
        (the logits of ``rows``; every row's if None)."""
        ops, rec = self._begin_pass(layout)
        hp, head = self.hp, self.weights.head
        pos = ops.begin_pass(layout.positions())
        x = ops.embed(head, ids)
        for i, w in enumerate(self.weights.layers):
            rec.begin_layer(i)
            ops.begin_layer(self.model.layers.get(i))  # None: a dense layer, nothing to read
            x = self.arch.layer(ops, hp, w, x, pos)
            ops.end_layer()
            rec.end_layer(i)
        rec.begin_head()
        _check_finite(x)
        ops.begin_stage()
        hn = ops.rms_norm(ops.take_rows(x, rows), head.norm)
        out = ops.output(head, hn)
        hidden = (hn if rows is None else ops.rms_norm(x, head.norm)) if return_hidden else None
        out, hidden = ops.result(out), ops.result(hidden)
        metrics, extra = rec.finish(lambda: self._describe(int(ids.size)))  # after the clock
        return out, hidden, metrics, extra  # type: ignore[return-value]

    def _begin_pass(self, layout: SeqLayout) -> tuple[Ops, PassRecorder]:
        """The ops of a pass over ``layout`` and its recorder (the engine must be open)."""
        if self._closed:
            raise EngineClosedError("the engine is closed: load the model again to run a prompt")
        if self.experts is None or self.backend.closed:
            self._restart_executor()
        htp.set_activation_format(self.act)  # type: ignore[arg-type]
        memory.reset_peak()
        # Per-request bookkeeping only: a long-lived engine must not grow without bound.
        self.experts.reset()
        ops = Ops(
            self.hp,
            self.experts,
            layout,
            backend=self.backend if self.dense_ops == "backend" else None,
            shared=self._dense_shared,
            attn_products=self.attention,
            pool=self._pool,
            op_work=[] if self.options.op_stats else None,
        )
        rec = PassRecorder(
            ops,
            self.experts,
            self.backend,
            n_layers=self.hp.n_layers,
            mem_before=self._mem0,
            progress=self.progress,
        )
        return ops, rec

    @property
    def weight_copy_bytes(self) -> int:
        """Resident bytes of the weight copies the engine holds beside the dense blob
        (``dense_bytes``) and the experts (``expert_memory_bytes``): gpt-oss's expert biases
        laid out per layer for the expert op, the arrays bound outside the dense blob (the
        routers transposed, the expert order tables), and the dense matrices' derived arrays,
        made on a pass's first use (the transposed copy of a matrix stored as F32; weights
        copied into an executor's shared memory)."""
        graph = getattr(self.experts, "graph", None)
        biases = graph.bias_bytes if isinstance(graph, GLUGraph) else 0
        blob = self.model.dense_blob
        bound = sum(
            int(a.nbytes)
            for a in _arrays(self.weights)
            if blob is None or not np.may_share_memory(a, blob)
        )
        return biases + bound + copy_bytes(self._dense_shared)

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
            "attention": self.attention,
            "backend": self.backend.kind,
            "dense_ops": self.dense_ops,
            "load_s": self.load_s,
            "expert_memory_bytes": int(self.experts.memory_bytes),
            "dense_bytes": int(self.model.dense_bytes),
            "weight_copy_bytes": self.weight_copy_bytes,
        }
        if c is not None:
            d.update({"G": c.G, "Q": c.Q, "B": c.B, "config_source": c.source})
            d["pinned_bytes"] = int(getattr(self.experts, "pinned_bytes", 0))
        if self.budget is not None:
            d["budget_bytes"] = self.budget
        return d

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the arena, the graph and the backend (its executor), and return the freed heap
        to the system (`memory.trim_heap`). Waits for a pass another thread is running; later
        passes raise `EngineClosedError`. Calling it again does nothing."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.experts is not None:
                self.experts.close()
        finally:
            self.graph.close()
            if self.backend is not htp.default_backend():
                self.backend.close()
            memory.trim_heap()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()


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


def resolve_attention(
    attention: str, act: str, dense: htp.Backend | None = None, *, native: str = "f32"
) -> str:
    """The attention precision an engine runs for option ``attention`` (`ATTENTION`): "f32",
    "bf16" and "bf16-pv" as they are; "auto" is ``native`` (the architecture's
    ``ATTENTION_AUTO``: "bf16" where its parity rows keep bf16's error within 5 % of fp32
    attention's, else "bf16-pv" where they keep that mode's, else "f32") when ``act`` is "q8"
    and ``dense``, the backend running the dense
    ops (default: this process's), multiplies bf16 attention natively at about twice the fp32
    rate (`estream_htp.native_bf16_attention`: an AVX-512 or AMX kernel set on a CPU with
    AVX512_BF16), else "f32" (emulated bf16, and NEON's native FEAT_BF16 kernel, are slower
    than fp32 products; act "f32" keeps fp32 attention so that it stays within ~1e-5 of a
    float64 reference)."""
    if attention not in ATTENTION:
        raise BadRequestError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if native not in ("bf16", "bf16-pv", "f32"):
        raise ValueError(
            f"an architecture's ATTENTION_AUTO is bf16, bf16-pv or f32, not {native!r}"
        )
    if attention != "auto":
        return attention
    if act != "q8" or native == "f32":
        return "f32"
    return native if htp.native_bf16_attention(dense) else "f32"


def load(path: str | Path, **kwargs: Any) -> Engine:
    """Load a packed model (`NAME.estream`) for prefill. See `EngineOptions` for the options."""
    return Engine(path, **kwargs)
