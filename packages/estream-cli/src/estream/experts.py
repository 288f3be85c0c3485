"""Where the experts come from during a prefill: resident memory or the streamed arena.

Both sources run every expert through the same `estream_htp.ExpertGraph`, bound at call time to
the routes and to the weight addresses of the slots the experts sit in. The streamed source is
the pipeline of docs/design.md §6: reads start when the layer starts (schedule ``early``), unrouted
groups are dropped after routing, routed groups execute as their banks become ready and banks
are recycled as soon as their group has run. With ``early``, the first MoE layer's reads start
as soon as the source opens its loader — while the engine loads its dense weights (and again
after `StreamedExperts.recover`) — and the first pass takes that layer over instead of
starting it.

The arena's planes are buffers of the expert backend (`Backend.expose`): on an executor
backend they are memfds the executor maps itself. Each routed group's expert op is *submitted*
and its bank stays InUse until the op's completion fence, while the loader fills other banks (at
most B-1 banks wait on fences, so the loader always has one to fill); a backend that runs ops in
this process completes the fence as the op is submitted.

Pinned experts (``pin_bytes``): whole groups read once when the source opens, into an arena of
their own, and kept there for every pass (`pinned_groups` says which: the first groups of every
layer, a round over the layers at a time). Their layers never read them again, and their ops
start at once, while the loader reads the layer's other groups; the results are bit for bit
those of a source that pins nothing (groups still run in group order).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

import estream_arena as ea
import estream_htp as htp
from estream_layout import ChecksumError
from estream_layout.verify import check_record_checksums

from .errors import InsufficientMemoryError, PackError
from .packed import ExpertLayer, PackedModel, read_whole

__all__ = [
    "SCHEDULES",
    "ExpertSource",
    "GLUGraph",
    "GroupRecord",
    "ResidentExperts",
    "StreamedExperts",
    "flatten_routes",
    "pinned_groups",
]

SCHEDULES = ("early", "after-routing", "ondemand")
ACQUIRE_TIMEOUT_S = float(os.environ.get("ESTREAM_ACQUIRE_TIMEOUT", "300"))
#: The loader reads groups queued one after another whose extents follow each other in
#: experts.bin with one preadv while it stays within this many bytes (0: one read per group).
#: Small groups (G·record below it) then reach the disk's large-block O_DIRECT bandwidth.
READ_MERGE_BYTES = int(os.environ.get("ESTREAM_READ_MERGE_BYTES", str(16 << 20)))


def pinned_groups(model: PackedModel, group_size: int, pin_bytes: int) -> list[tuple[int, int]]:
    """The ``(layer index, group)`` pairs that ``pin_bytes`` pins: a bank of ``group_size`` slots
    each, group 0 of every MoE layer first, then group 1 of every layer, and so on, while a
    whole bank fits. Pinning the first groups spreads the pins over all layers and lets each
    layer's first ops start before its first read has landed."""
    bank = int(group_size) * sum(size for _, size in model.plane_extents)
    n = max(0, int(pin_bytes)) // bank if bank else 0
    layers = [model.layers[i] for i in sorted(model.layers)]
    out: list[tuple[int, int]] = []
    k = 0
    while len(out) < n and any(k * group_size < lay.n_experts for lay in layers):
        for lay in layers:
            if len(out) < n and k * group_size < lay.n_experts:
                out.append((lay.index, k))
        k += 1
    return out


@attrs.define
class GroupRecord:
    """What happened to one routed group of one layer (for profiles, metrics and traces)."""

    layer: int
    group: int
    n_routes: int
    t_wait: float  # executor started waiting for the bank
    t_start: float  # bank acquired, kernel starts
    t_end: float  # kernel done, bank released


def flatten_routes(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
    """`[T, k]` top-k ids/weights → flat (token, expert, weight) route arrays."""
    t, k = ids.shape
    tokens = np.repeat(np.arange(t, dtype=np.int32), k)
    return (
        tokens,
        np.ascontiguousarray(ids, dtype=np.int32).ravel(),
        np.ascontiguousarray(weights, dtype=np.float32).ravel(),
    )


class ExpertSource(Protocol):
    """Where the routed experts of a forward pass come from (resident memory or the arena).

    Per request: `reset`, then for each MoE layer `begin_layer` (at layer start, before
    attention: a streaming source starts its reads there, or has started them already for the
    first MoE layer), `run_layer` once routing is known, `end_layer`. `records`, `reads()` and
    `bytes_read` describe the current request (reads started before it for its first layer
    included)."""

    records: list[GroupRecord]

    @property
    def memory_bytes(self) -> int:
        """Bytes the experts occupy in memory (the whole pool, or the arena)."""
        ...

    @property
    def bytes_read(self) -> int:
        """Expert bytes read from storage during the current request."""
        ...

    def reads(self) -> list[ea.ReadEvent]:
        """The reads of the current request, in completion order (none when resident)."""
        ...

    def reset(self) -> None:
        """Start a request: forget the previous request's records and reads."""
        ...

    def recover(self) -> None:
        """After a request failed half-way: close whatever it left open (layer, reads, threads)
        so that the next request starts clean."""
        ...

    def begin_layer(self, layer: ExpertLayer) -> None: ...

    def routes_known(self, layer: ExpertLayer, ids: np.ndarray) -> None:
        """The started layer's routes (top-k expert ids ``[T, k]``, those `run_layer` will
        get) are known before its experts are due: a router that reads the layer's input
        runs before attention. A source may start the routed reads now."""
        ...

    def run_layer(
        self,
        layer: ExpertLayer,
        x: np.ndarray | htp.Q8Rows,
        ids: np.ndarray,
        weights: np.ndarray,
        y: np.ndarray,
    ) -> None:
        """Add ``Σ_k weights[t, k] · expert_{ids[t, k]}(x[t])`` to ``y[t]`` for every token;
        ``x`` may be given quantized (`htp.Q8Rows`, int8 products)."""
        ...

    def end_layer(self) -> None: ...

    def close(self) -> None: ...


class GLUGraph:
    """The fused routed-expert op (`estream_htp.ExpertGraph`) of a family whose experts are
    not plain SwiGLU: the family record's activation (``expert_glu``: SmallThinker's ReGLU,
    gpt-oss's clamped SwiGLU-OAI) and, for gpt-oss, each layer's expert biases
    (`blk.N.ffn_{gate,up,down}_exps.bias`, resident f32, laid out once per layer as the op
    takes them, in the backend's shared memory) — all in the op itself, on every backend. The
    expert source passes the layer (``layer=``). Everything else is the wrapped graph's."""

    def __init__(self, graph: htp.ExpertGraph, model: PackedModel) -> None:
        hp = model.hparams
        self.graph = htp.ExpertGraph(
            graph.d_model, graph.d_ff, graph.capacity, graph.t_max,
            backend=graph.backend, formats=graph.formats, glu=hp.expert_glu,
        )  # fmt: skip
        self.biases: dict[int, np.ndarray] = {}
        if hp.expert_glu == "swiglu_oai":
            self.biases = {
                i: htp.expert_biases(
                    *(
                        model.dense(f"blk.{i}.ffn_{j}_exps.bias").f32()
                        for j in ("gate", "up", "down")
                    ),
                    backend=graph.backend,
                )
                for i in hp.moe_layers
            }

    @property
    def bias_bytes(self) -> int:
        """Bytes of the expert biases laid out for the op (a copy beside the dense weights)."""
        return sum(int(b.nbytes) for b in self.biases.values())

    def __getattr__(self, name: str) -> Any:
        if name == "graph":  # not set yet: no recursion through the delegation
            raise AttributeError(name)
        return getattr(self.graph, name)

    def run(self, *args: Any, layer: int = -1, **kw: Any) -> None:
        self.graph.run(*args, biases=self.biases.get(layer), **kw)

    def submit(self, *args: Any, layer: int = -1, **kw: Any) -> htp.Fence | None:
        return self.graph.submit(*args, biases=self.biases.get(layer), **kw)


def expert_op(graph: htp.ExpertGraph, model: PackedModel) -> htp.ExpertGraph | GLUGraph:
    """The op a model's routed experts run through: the fused graph for SwiGLU experts, a
    `GLUGraph` (the fused op with the family's activation and biases) for the others (the
    family record's `expert_glu`)."""
    return graph if model.hparams.expert_glu == "swiglu" else GLUGraph(graph, model)


def _formats(graph: Any, layer: ExpertLayer) -> dict[str, Any]:
    """The expert op's `formats` argument for a layer: its tile formats where they are not the
    graph's own (a file may store a layer's projections in other types than the first's); and
    the layer, for an op with per-layer weights of its own (`GLUGraph`'s biases)."""
    kw: dict[str, Any] = {} if layer.formats == graph.formats else {"formats": layer.formats}
    if isinstance(graph, GLUGraph):
        kw["layer"] = layer.index
    return kw


class ResidentExperts:
    """All experts read into memory once: the I/O-free reference point (same kernels)."""

    def __init__(self, model: PackedModel, graph: htp.ExpertGraph, *, verify: bool = False) -> None:
        self.model = model
        self.graph = expert_op(graph, model)
        self.records: list[GroupRecord] = []
        try:  # in memory the expert op reads in place (shared memory for an executor)
            self.pool = read_whole(model.experts_path, graph.backend)
        except MemoryError as exc:
            raise InsufficientMemoryError(
                f"resident mode holds every expert in memory, and {exc}; stream the experts "
                "instead (--mode stream, with --budget BYTES to cap the memory)"
            ) from exc
        if self.pool.size != model.parsed.experts_bytes:  # the manifest was checked against the
            raise PackError(  # file a moment ago: it changed since
                f"{model.experts_path}: {self.pool.size} bytes, the manifest says "
                f"{model.parsed.experts_bytes} (changed while loading?)"
            )
        if verify:  # the same crc32 per record the streamed loader checks with verify
            problems = check_record_checksums(model.parsed, self.pool)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ChecksumError(f"{model.path}: {problems[0]}{more}")
        self._base = self.pool.ctypes.data
        self._routes = graph.backend.route_buffers()

    @property
    def memory_bytes(self) -> int:
        return int(self.pool.nbytes)

    @property
    def bytes_read(self) -> int:
        return 0  # the pool was read once, at load

    def reads(self) -> list[ea.ReadEvent]:
        return []

    def reset(self) -> None:
        self.records.clear()

    def recover(self) -> None:
        self.records.clear()  # nothing is open for memory-resident experts

    def begin_layer(self, layer: ExpertLayer) -> None:
        pass

    def routes_known(self, layer: ExpertLayer, ids: np.ndarray) -> None:
        pass  # everything is in memory: nothing to read

    def run_layer(
        self,
        layer: ExpertLayer,
        x: np.ndarray | htp.Q8Rows,
        ids: np.ndarray,
        weights: np.ndarray,
        y: np.ndarray,
    ) -> None:
        tokens, experts, w = flatten_routes(ids, weights)
        ext = layer.plane_extents
        planes = tuple(self._base + layer.offset + off for off, _ in ext)
        strides = (layer.record_bytes,) * 3
        t0 = time.perf_counter()
        slots = layer.position
        rb = self._routes  # everything by reference where the op reads it, nothing staged
        tokens, experts = rb.put("t", tokens), rb.put("e", experts)
        w, slots = rb.put("w", w), rb.put("slots", slots)
        if not isinstance(x, htp.Q8Rows):  # Q8 rows are where the op reads them already
            x = rb.activation("x", x)
        ys = y if rb.in_place(y) else rb.put("y", y)
        self.graph.run(
            x, tokens, experts, w, slots, planes, strides, ys, **_formats(self.graph, layer)
        )
        if ys is not y:
            y[...] = ys
        t1 = time.perf_counter()
        self.records.append(GroupRecord(layer.index, 0, int(tokens.size), t0, t0, t1))

    def end_layer(self) -> None:
        pass

    def close(self) -> None:
        pass


class StreamedExperts:
    """Experts streamed group by group through a fixed arena of `B` banks of `G` slots."""

    def __init__(
        self,
        model: PackedModel,
        graph: htp.ExpertGraph,
        *,
        group_size: int,
        queue_depth: int,
        n_banks: int,
        schedule: str = "early",
        verify: bool = False,
        direct: bool | None = None,
        on_group: Callable[[GroupRecord], None] | None = None,
        coalesce: bool = True,
        pin_bytes: int = 0,
    ) -> None:
        self.model = model
        self.graph = expert_op(graph, model)
        #: Ready groups whose banks follow in the arena join one op (see `_run_groups`).
        self.coalesce = bool(coalesce)
        self.records: list[GroupRecord] = []
        n_e = max(lay.n_experts for lay in model.layers.values())
        self._slot_of_expert = np.full(n_e, -1, dtype=np.int32)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.G, self.Q, self.B = int(group_size), int(queue_depth), int(n_banks)
        self.schedule = schedule
        self.on_group = on_group
        self._direct, self._verify = direct, verify
        #: (layer index, group) -> its bank in `pin_arena` (`pinned_groups`)
        self._pins = {g: b for b, g in enumerate(pinned_groups(model, self.G, pin_bytes))}
        self._strides = tuple(size for _, size in model.plane_extents)
        # the first MoE layer: its reads start when the loader opens (schedule "early")
        self._first = model.layers[min(model.layers)] if model.layers else None
        self._open()

    def _open(self) -> None:
        layout = ea.RecordLayout(
            record_bytes=self.model.record_bytes, planes=self.model.plane_extents
        )
        # private (and on huge pages) unless the backend's executor must map the planes too
        be = self.graph.backend
        self.arena = ea.Arena(layout, n_banks=self.B, group_size=self.G, shared=be.shared_memory)
        try:
            self.loader = ea.GroupLoader(
                self.arena,
                self.model.experts_path,
                self.Q,
                direct=self._direct,
                verify=self._verify,
                merge_bytes=READ_MERGE_BYTES,
            )
        except BaseException:
            self.arena.close()
            raise
        self._planes = tuple(self.arena.plane_address(j) for j in range(3))
        self.pin_arena: ea.Arena | None = None
        self._pin_planes: tuple[int, ...] = ()
        #: bytes the pinned groups took to read when the source opened
        self.pin_bytes_read = 0
        self._layer: ExpertLayer | None = None
        self._started: ExpertLayer | None = None  # begun and submitted ahead of the pass
        # (layer index, its routed groups) when its routes came before its experts (a
        # pre-attention router, `routes_known`): their reads were submitted or the others
        # dropped then
        self._known: tuple[int, frozenset[int]] | None = None
        self._buffers: list[int] = []
        self._routes = be.route_buffers()
        try:
            if self._pins:
                self._read_pins(layout, be.shared_memory)
            arenas = [self.arena] + ([self.pin_arena] if self.pin_arena is not None else [])
            for arena in arenas:
                for j in range(3):  # the planes become buffers of the backend, read in place
                    self._buffers.append(
                        be.expose(
                            arena.plane_address(j),
                            arena.n_slots * arena.slot_bytes[j],
                            fd=arena.fd(j) if arena.shared else None,
                            writable=False,
                        )
                    )
            if self.schedule == "early" and self._first is not None:
                self._start_layer(self._first)
                self._started = self._first
        except BaseException:
            self.close()
            raise

    def _read_pins(self, layout: ea.RecordLayout, shared: bool) -> None:
        """Read the pinned groups into an arena of their own, one bank each (checked like any
        read: checksums under ``verify``, the file unchanged)."""
        self.pin_arena = ea.Arena(layout, n_banks=len(self._pins), group_size=self.G, shared=shared)
        loader = ea.GroupLoader(
            self.pin_arena, self.model.experts_path, 1, direct=self._direct, verify=self._verify
        )
        try:
            by_layer: dict[int, list[tuple[int, int]]] = {}
            for (li, k), bank in self._pins.items():
                by_layer.setdefault(li, []).append((k, bank))
            for li, groups in by_layer.items():  # a group number is unique within a layer
                lay = self.model.layers[li]
                loader.read_into(
                    [self._request(lay, k) for k, _ in groups], [b for _, b in groups], layer=li
                )
            self.pin_bytes_read = int(loader.stats.bytes_read)
        finally:
            loader.close()
        self._pin_planes = tuple(self.pin_arena.plane_address(j) for j in range(3))

    def _unpinned(self, layer: ExpertLayer, groups: Any) -> list[int]:
        """``groups`` of ``layer`` that are not pinned (the ones its loader reads)."""
        return [int(k) for k in groups if (layer.index, int(k)) not in self._pins]

    def recover(self) -> None:
        """After a request failed half-way (a read or checksum error, Ctrl-C): stop its reads,
        join the loader's threads, and start again with a fresh loader and arena, so the next
        request finds no layer open and nothing leaked."""
        self.records.clear()
        self._known = None
        self.close()
        self._open()

    @property
    def memory_bytes(self) -> int:
        return int(self.arena.total_bytes) + self.pinned_bytes

    @property
    def pinned_bytes(self) -> int:
        """Memory of the pinned groups (their arena: a bank of G slots each)."""
        return int(self.pin_arena.total_bytes) if self.pin_arena is not None else 0

    @property
    def bytes_read(self) -> int:
        """Bytes the layers read (not the pinned groups' reads when the source opened)."""
        return int(self.loader.stats.bytes_read)

    def reads(self) -> list[ea.ReadEvent]:
        return list(self.loader.stats.events)

    def reset(self) -> None:
        self.records.clear()
        if self._started is None:  # else the reads of the layer started ahead are this pass's
            self.loader.reset_stats()

    def _n_groups(self, layer: ExpertLayer) -> int:
        return -(-layer.n_experts // self.G)

    def _request(self, layer: ExpertLayer, k: int) -> ea.GroupRequest:
        first = k * self.G
        n = min(self.G, layer.n_experts - first)
        sums = layer.checksums[first : first + n] if layer.checksums else None
        return ea.GroupRequest(
            group=k,
            offset=layer.offset + first * layer.record_bytes,
            n_records=n,
            checksums=tuple(sums) if sums else None,
        )

    def _start_layer(self, layer: ExpertLayer) -> None:
        self.loader.begin_layer(layer.index)
        if self.schedule == "early":
            groups = self._unpinned(layer, range(self._n_groups(layer)))
            self.loader.submit([self._request(layer, k) for k in groups])

    def begin_layer(self, layer: ExpertLayer) -> None:
        """The layer starts: with the ``early`` schedule, reads begin before routing is known
        (for the first MoE layer they began when the loader opened: the pass takes them over)."""
        started, self._started = self._started, None
        if started is not None and started.index != layer.index:  # not the first layer: the
            # the reads started ahead are dropped
            self.loader.drop(self._unpinned(started, range(self._n_groups(started))))
            self.loader.end_layer()
            started = None
        self._layer = layer
        if started is None:
            self._start_layer(layer)

    def routes_known(self, layer: ExpertLayer, ids: np.ndarray) -> None:
        """Routes known at layer start: with ``after-routing`` the routed groups' reads start
        now, while attention runs (no read is wasted and none waits for the router after
        attention); with ``early`` the unrouted groups are dropped now. ``ondemand`` reads
        each group when it is due, as ever."""
        assert self._layer is layer, "begin_layer() must be called first"
        if self.schedule == "ondemand":
            return
        routed = frozenset(int(k) for k in np.unique(layer.position[np.ravel(ids)] // self.G))
        if self.schedule == "after-routing":
            self.loader.submit(
                [self._request(layer, k) for k in self._unpinned(layer, sorted(routed))]
            )
        else:
            unrouted = [
                k for k in self._unpinned(layer, range(self._n_groups(layer))) if k not in routed
            ]
            if unrouted:
                self.loader.drop(unrouted)
        self._known = (layer.index, routed)

    def run_layer(
        self,
        layer: ExpertLayer,
        x: np.ndarray | htp.Q8Rows,
        ids: np.ndarray,
        weights: np.ndarray,
        y: np.ndarray,
    ) -> None:
        assert self._layer is layer, "begin_layer() must be called first"
        known, self._known = self._known, None
        tokens, experts, w = flatten_routes(ids, weights)
        group_of_route = layer.position[experts] // self.G
        perm = np.argsort(group_of_route, kind="stable")
        tokens, experts, w = tokens[perm], experts[perm], w[perm]
        n_groups = self._n_groups(layer)
        counts = np.bincount(group_of_route, minlength=n_groups)
        starts = np.concatenate(([0], np.cumsum(counts)))
        routed = np.flatnonzero(counts)
        unrouted = np.flatnonzero(counts == 0)
        if known is not None and known[0] == layer.index:
            if known[1] != frozenset(int(k) for k in routed):
                raise RuntimeError(f"layer {layer.index}: the routes changed after routes_known")
        elif self.schedule == "early":
            drop = self._unpinned(layer, unrouted)
            if drop:
                self.loader.drop(drop)
        elif self.schedule == "after-routing":
            self.loader.submit([self._request(layer, k) for k in self._unpinned(layer, routed)])
        # x: with int8 products, the layer input quantized once for every group (Ops.moe);
        # fp32 rows otherwise (or from another caller: then each group's op quantizes them)
        self._run_groups(layer, x, y, tokens, experts, w, counts, starts, routed)

    def _record(self, rec: GroupRecord) -> None:
        self.records.append(rec)
        if self.on_group is not None:
            self.on_group(rec)

    def _run_groups(
        self,
        layer: ExpertLayer,
        x: np.ndarray | htp.Q8Rows,
        y: np.ndarray,
        tokens: np.ndarray,
        experts: np.ndarray,
        w: np.ndarray,
        counts: np.ndarray,
        starts: np.ndarray,
        routed: np.ndarray,
    ) -> None:
        """Submit the routed groups' ops, in group order; each op's banks are released at its
        completion fence (at once on a backend that runs the op in this process, as it is
        submitted).

        Groups already Ready when an op is submitted join it (with ``coalesce``) while their
        banks follow the previous one's in the arena, so that the op meets its slots in group
        order: the contributions reach ``y`` in the order separate ops would add them (slot
        ascending, then route order), and the result is bit for bit the same, while the op's
        fixed costs (its dispatch, its threads' start and barriers) are paid once. One bank is
        always left to the loader. A run of pinned groups is one op on the pinned arena (their
        banks, one per group, follow each other in group order within a layer); it holds no
        bank of the loader."""
        rb = self._routes
        xs = x if isinstance(x, htp.Q8Rows) else rb.activation("x", x)
        ts, es, ws = rb.put("t", tokens), rb.put("e", experts), rb.put("w", w)
        # y in registered memory (the activation pool): the ops accumulate into it in place
        direct = rb.in_place(y)
        ys = y if direct else rb.put("y", np.zeros_like(y))
        operands = (xs, ts, es, ws, ys)
        n_e = self._slot_of_expert.size
        table = rb.put("slots", np.full((max(len(routed), 1), n_e), -1, np.int32))
        # per op: its fence, (bank, group, t_wait) of each group it runs (bank None: pinned),
        # its start
        inflight: deque[tuple[Any, list[tuple[Any, int, float]], float]] = deque()
        held = 0  # banks held by the ops in flight
        error: BaseException | None = None
        order = [int(k) for k in routed]

        def retire() -> None:
            nonlocal error, held
            fence, members, t0 = inflight.popleft()
            try:
                fence.wait()
            except BaseException as e:  # the op failed or the executor died: nothing reads now
                error = error or e
            finally:
                for bank, _, _ in members:
                    if bank is not None:
                        self.loader.release(bank)
                        held -= 1
            t1 = time.perf_counter()
            for _, k, t_wait in members:
                self._record(GroupRecord(layer.index, k, int(counts[k]), t_wait, t0, t1))

        def ready_after(k: int, prev: int) -> bool:
            """Group ``k`` is Ready in a bank after bank ``prev`` (joins the op at no wait)."""
            slot = self.loader.residency().get(k * self.G)
            return slot is not None and slot // self.G > prev

        try:
            i = 0
            while i < len(order):
                k = order[i]
                while inflight and inflight[0][0].poll():
                    retire()
                while inflight and held >= self.B - 1:  # keep a bank for the loader
                    retire()
                if error is not None:
                    break
                if (layer.index, k) in self._pins:
                    i += self._run_pinned(layer, order, i, table[i], operands, starts, inflight)
                    continue
                if self.schedule == "ondemand":
                    self.loader.submit([self._request(layer, k)])
                t_wait = time.perf_counter()
                members = [(self.loader.acquire(k, timeout=ACQUIRE_TIMEOUT_S), k, t_wait)]
                try:
                    while (
                        self.coalesce
                        and i + len(members) < len(order)
                        and held + len(members) < self.B - 1
                        and ready_after(order[i + len(members)], members[-1][0].index)
                    ):
                        kn = order[i + len(members)]
                        t_next = time.perf_counter()
                        members.append((self.loader.acquire(kn, timeout=0), kn, t_next))
                    t0 = time.perf_counter()
                    groups = [(kb, bank.slots) for bank, kb, _ in members]
                    fence = self._submit(layer, groups, table[i], self._planes, operands, starts)
                except BaseException:
                    for bank, _, _ in members:
                        self.loader.release(bank)
                    raise
                inflight.append((fence, members, t0))
                held += len(members)
                i += len(members)
        finally:
            while inflight:
                retire()
        if error is not None:
            raise error
        if not direct:
            y += ys

    def _submit(
        self,
        layer: ExpertLayer,
        groups: list[tuple[int, Sequence[int]]],
        row: np.ndarray,
        planes: tuple[int, ...],
        operands: tuple[Any, ...],
        starts: np.ndarray,
    ) -> Any:
        """Submit one expert op for the consecutive groups ``[(k, slots), ...]`` of ``layer``,
        whose experts sit in ``slots`` of the arena at ``planes``; returns its fence."""
        xs, ts, es, ws, ys = operands
        for k, slots in groups:
            first = k * self.G
            row[layer.order[first : first + len(slots)]] = np.asarray(slots, dtype=np.int32)
        sl = slice(int(starts[groups[0][0]]), int(starts[groups[-1][0] + 1]))
        return self.graph.submit(
            xs, ts[sl], es[sl], ws[sl], row, planes, self._strides, ys,
            **_formats(self.graph, layer),
        )  # fmt: skip

    def _run_pinned(
        self,
        layer: ExpertLayer,
        order: list[int],
        i: int,
        row: np.ndarray,
        operands: tuple[Any, ...],
        starts: np.ndarray,
        inflight: deque[tuple[Any, list[tuple[Any, int, float]], float]],
    ) -> int:
        """Submit one op for the pinned groups ``order[i], order[i+1], ...`` (as many as follow
        each other in ``order``, or one without ``coalesce``); returns how many it runs."""
        n = 1
        while self.coalesce and i + n < len(order) and (layer.index, order[i + n]) in self._pins:
            n += 1
        t0 = time.perf_counter()
        groups: list[tuple[int, Sequence[int]]] = []
        for k in order[i : i + n]:
            bank = self._pins[(layer.index, k)]
            count = min(self.G, layer.n_experts - k * self.G)
            groups.append((k, range(bank * self.G, bank * self.G + count)))
        fence = self._submit(layer, groups, row, self._pin_planes, operands, starts)
        inflight.append((fence, [(None, k, t0) for k in order[i : i + n]], t0))
        return n

    def end_layer(self) -> None:
        self.loader.end_layer()
        self._layer = None
        self._known = None

    def close(self) -> None:
        try:
            if getattr(self, "loader", None) is not None:
                self.loader.close()
        finally:
            for bid in self._buffers:
                if not self.graph.backend.closed:
                    self.graph.backend.unregister(bid)
            self._buffers.clear()
            self.arena.close()
            if getattr(self, "pin_arena", None) is not None:
                self.pin_arena.close()
