"""Device/model calibration (`estream profile`) and configuration (`estream config`).

Profiling runs one calibration request per candidate group size `g` (docs/design.md §6): a prompt of
`T` tokens streamed with `Q = 1` and enough banks that reads never wait for a bank, so that each
group's read time is its pure service time and each group's execution time is measured alone.
Grouped-read bandwidth `BW(g, q)` is measured with the real loader on a cold file, in interleaved
rounds (every `(g, q)` once per round, each round starting one point later), and each point keeps
the median of its rounds: one timed read of a noisy disk can be 20 % off, enough to move `Q0`
(design §6) by a whole step. The resulting
`estream_sched.Profile` is stored in the manifest; `config.configure_for_budget` turns it into
`(G, Q, B)` for any memory budget in milliseconds.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import estream_arena as ea
import estream_sched as es
from estream_layout import ModelSpec

from .config import cpu_name, running_identity
from .engine import DEFAULT_THREADS, Engine, PrefillResult
from .errors import BadRequestError
from .experts import READ_MERGE_BYTES
from .memory import drop_file_cache, trim_heap
from .packed import PackedModel

__all__ = ["DEFAULT_CANDIDATES", "measure_bandwidth", "measure_bandwidth_table", "profile_model"]

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32)
DEFAULT_QS = (1, 2, 4, 8)
DEFAULT_BW_ROUNDS = 3


def measure_bandwidth(
    model: PackedModel,
    g: int,
    q: int,
    *,
    max_bytes: int = 256 << 20,
    shared: bool = False,
) -> float:
    """Grouped-read bandwidth (bytes/s) of the real loader at group size g, queue depth q, into
    an arena like the runtime's (``shared``: memfd planes, as for an executor process; else
    private ones on huge pages, as for the in-process host backend)."""
    layers = sorted(model.layers.values(), key=lambda lay: lay.index)
    reqs: list[tuple[int, ea.GroupRequest]] = []
    total = 0
    for lay in layers:
        n_groups = -(-lay.n_experts // g)
        for k in range(n_groups):
            n = min(g, lay.n_experts - k * g)
            reqs.append((lay.index, ea.GroupRequest(k, lay.offset + k * g * lay.record_bytes, n)))
            total += n * lay.record_bytes
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    layout = ea.RecordLayout(record_bytes=model.record_bytes, planes=model.plane_extents)
    drop_file_cache(model.experts_path)
    with (
        ea.Arena(layout, n_banks=q + 1, group_size=g, shared=shared) as arena,
        ea.GroupLoader(arena, model.experts_path, q, merge_bytes=READ_MERGE_BYTES) as loader,
    ):
        t0 = time.perf_counter()
        by_layer: dict[int, list[ea.GroupRequest]] = {}
        for li, r in reqs:
            by_layer.setdefault(li, []).append(r)
        for li, rs in by_layer.items():
            loader.begin_layer(li)
            loader.submit(rs)
            for r in rs:
                loader.release(loader.acquire(r.group, timeout=300))
            loader.end_layer()
        dt = time.perf_counter() - t0
    return total / dt if dt > 0 else float("inf")


def measure_bandwidth_table(
    model: PackedModel,
    groups: Sequence[int],
    queue_depths: Sequence[int],
    *,
    rounds: int = DEFAULT_BW_ROUNDS,
    max_bytes: int = 256 << 20,
    measure: Callable[[PackedModel, int, int], float] | None = None,
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, list[float]]]]:
    """``BW(g, q)`` for every ``g`` and ``q``: the median of ``rounds`` interleaved measurements.

    Round ``r`` visits the points in a fixed order rotated by ``r``, so that a slow spell of the
    disk lands on different points in different rounds instead of on one point every time.
    Returns the medians and the samples (in round order) behind them."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    points = [(int(g), int(q)) for g in groups for q in queue_depths]
    if not points:
        raise ValueError("no (g, q) point to measure")
    run = measure or (lambda m, g, q: measure_bandwidth(m, g, q, max_bytes=max_bytes))
    samples: dict[int, dict[int, list[float]]] = {g: {q: [] for _, q in points} for g, _ in points}
    for r in range(rounds):
        k = r % len(points)
        for g, q in points[k:] + points[:k]:
            samples[g][q].append(float(run(model, g, q)))
    medians = {g: {q: float(np.median(v)) for q, v in by_q.items()} for g, by_q in samples.items()}
    return medians, samples


def profile_model(
    path: str | os.PathLike[str],
    *,
    candidates: Sequence[int] | None = None,
    queue_depths: Sequence[int] = DEFAULT_QS,
    n_tokens: int = 256,
    bw_rounds: int = DEFAULT_BW_ROUNDS,
    seed: int = 0,
    n_threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> es.Profile:
    """Calibrate: one request per candidate g, plus BW(g, q) (median of ``bw_rounds``
    interleaved rounds). Returns an `estream_sched.Profile` whose ``measured_with`` is what the
    calibration ran with (`estream.config.running_identity`: CPU, SIMD kernel set, estream-htp
    build, threads, ``q8``, ``host``, the pack's expert formats). ``candidates``: group sizes,
    each at most the model's experts per layer (default: those of `DEFAULT_CANDIDATES` that
    fit); ``n_tokens``: at most the model context. The first candidate's engine also runs a
    pass twice as long (within the context): the growth of its peak memory per token is the
    profile's ``m_per_token``, which a budget for a longer prompt counts."""
    say = log or (lambda s: None)
    model = PackedModel(path)
    hp = model.hparams
    gs, T = _calibration(hp, candidates, n_tokens)
    queue_depths = sorted({1, *(int(q) for q in queue_depths)})  # reads are timed at q = 1
    rng = np.random.default_rng(seed)
    T2 = min(2 * T, hp.n_ctx)  # the longer pass that measures memory per token
    tokens = rng.integers(0, hp.n_vocab, size=T2)
    W_e = model.record_bytes
    load0 = _load_average()  # other work on the machine inflates every time measured below
    if load0 is not None and load0 > max(1.0, (os.cpu_count() or 1) / 2):
        say(
            f"  the machine is busy (1-min load {load0:.1f} on {os.cpu_count()} CPUs): the "
            "times measured now are inflated; profile again on a quiet machine"
        )
    cand: dict[int, list[es.LayerProfile]] = {}
    m_other: dict[int, int] = {}
    m_per_token: int | None = None
    threads = int(n_threads or DEFAULT_THREADS)
    for g in gs:
        t0 = time.perf_counter()
        B = -(-hp.n_experts // g)
        with Engine(path, G=g, Q=1, B=B, n_threads=threads) as eng:
            eng.prefill(tokens[: min(T, 8)])  # warm-up: dense weights paged in, pool started
            res = eng.prefill(tokens[:T])
            arena_bytes = eng.experts.memory_bytes
            # what the engine holds beside the arena: the dense weights and their copies
            held = int(eng.model.dense_bytes) + eng.weight_copy_bytes
            if m_per_token is None and T2 > T:
                # a longer pass in the same engine: what its peak grows by, per token (each
                # pass's peak starts from the memory held when it starts)
                longer = eng.prefill(tokens[:T2]).metrics["peak_rss_bytes"]
                grown = int(longer) - int(res.metrics["peak_rss_bytes"])
                m_per_token = max(0, grown) // (T2 - T)
        # the next candidate's memory without this engine's: its weights go back to the
        # system, not to a heap the next engine's peak would count (memory.keep_freed_heap)
        del eng
        trim_heap()
        # process-owned memory only: MemAvailable also moves with other processes on the
        # machine; never below the weights held (a high-water mark that missed them)
        m_other[g] = max(held, int(res.metrics["peak_rss_bytes"]) - int(arena_bytes))
        cand[g] = _layer_profiles(res, model, g)
        say(
            f"  g={g:<3d} B={B:<3d} ttft={res.metrics['ttft_s'] * 1e3:8.1f} ms"
            f"  ({time.perf_counter() - t0:.1f} s)"
        )
    t0 = time.perf_counter()
    say(
        f"  grouped-read bandwidth: {len(gs)} g × {len(queue_depths)} q,"
        f" {bw_rounds} interleaved round{'' if bw_rounds == 1 else 's'}, median per point"
    )
    bandwidth, samples = measure_bandwidth_table(model, gs, queue_depths, rounds=bw_rounds)
    for g in gs:
        say(_bandwidth_line(g, queue_depths, bandwidth[g], samples[g] if bw_rounds > 1 else None))
    say(f"  bandwidth measured in {time.perf_counter() - t0:.1f} s")
    return es.Profile(
        model=str(model.manifest.get("source", {}).get("file", model.path.name)),
        device=cpu_name(),
        n_experts=hp.n_experts,
        n_layers=len(model.layers),
        expert_bytes=W_e,
        m_other=m_other,
        bandwidth=bandwidth,
        candidates=cand,
        q_measured=1,
        # tokens: the pass m_other was measured on (batch sizing reads it)
        meta={
            "tokens": T,
            "bandwidth_rounds": bw_rounds,
            # 1-min load average before and after calibrating (None where unknown)
            "load_average": [load0, _load_average()],
            "cpus": os.cpu_count(),
            "bandwidth_samples": {
                str(g): {str(q): v for q, v in by_q.items()} for g, by_q in samples.items()
            },
        },
        measured_with=running_identity(model, n_threads=threads, act="q8", backend="host"),
        m_per_token=m_per_token,
    )


def _load_average() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return None


def _calibration(
    hp: ModelSpec, candidates: Sequence[int] | None, n_tokens: int
) -> tuple[list[int], int]:
    """The candidate group sizes, sorted (default: those of `DEFAULT_CANDIDATES` the model's
    experts fit), and the calibration length; `BadRequestError` for a size outside
    ``1..n_experts`` or a length outside the model context."""
    if candidates is None:  # the default set: the sizes of it that the model's experts fit
        candidates = [g for g in DEFAULT_CANDIDATES if g <= hp.n_experts]
    bad = [g for g in candidates if not 1 <= int(g) <= hp.n_experts]
    if bad:
        raise BadRequestError(
            f"candidate group size {bad[0]} does not fit the model's {hp.n_experts} experts "
            f"per layer (each must be 1..{hp.n_experts})"
        )
    gs = sorted({int(g) for g in candidates})
    if not gs:
        raise BadRequestError("no candidate group size given")
    if not 1 <= int(n_tokens) <= hp.n_ctx:
        raise BadRequestError(
            f"a calibration prompt of {n_tokens} tokens does not fit the model context "
            f"(1..{hp.n_ctx} tokens)"
        )
    return gs, int(n_tokens)


def _bandwidth_line(
    g: int,
    qs: Sequence[int],
    bw: dict[int, float],
    samples: dict[int, list[float]] | None,
) -> str:
    """One line of the profile's log: ``BW(g, q)`` for every depth (and each round's)."""
    line = (
        f"  g={g:<3d} BW(q={','.join(str(q) for q in qs)})="
        + "/".join(f"{bw[q] / 1e9:.2f}" for q in qs)
        + " GB/s"
    )
    if samples is not None:
        line += "  [" + "; ".join("/".join(f"{x / 1e9:.2f}" for x in samples[q]) for q in qs) + "]"
    return line


def _layer_profiles(res: PrefillResult, model: PackedModel, g: int) -> list[es.LayerProfile]:
    """Per MoE layer of the calibration request: T_ne, and per group (all ``ceil(E/g)`` groups in
    storage order) its bytes, routes (0 = unrouted, dropped), read and execution times.

    ``layer_t_ne_s`` is indexed by model layer. A layer without experts (a leading dense layer)
    has no profile of its own: its time is added to the T_ne of the next MoE layer, so that the
    predicted request time still contains it."""
    reads = {(r.layer, r.group): r for r in res.reads}
    # Groups read by one merged preadv (the loader's merge_bytes) share its stamps: each gets
    # the share of its duration that its bytes are of the read's.
    merged: dict[tuple[int, float, float], int] = {}
    for r in res.reads:
        key = (r.layer, r.t_start, r.t_end)
        merged[key] = merged.get(key, 0) + r.nbytes
    t_ne_of_layer = res.metrics["layer_t_ne_s"]
    out = []
    carried = 0.0
    moe = sorted(model.layers.values(), key=lambda x: x.index)
    dense_before = {lay.index: 0.0 for lay in moe}
    for layer, t in enumerate(t_ne_of_layer):
        if layer in dense_before:
            dense_before[layer] = carried
            carried = 0.0
        else:
            carried += float(t)
    for i, lay in enumerate(moe):
        n_groups = -(-lay.n_experts // g)
        group_bytes = [min(g, lay.n_experts - k * g) * lay.record_bytes for k in range(n_groups)]
        routes = [0] * n_groups
        exec_t = [0.0] * n_groups
        read_t = [0.0] * n_groups
        for r in res.records:
            if r.layer == lay.index:
                routes[r.group] = int(r.n_routes)
                exec_t[r.group] = float(r.t_end - r.t_start)
        for k in range(n_groups):
            ev = reads.get((lay.index, k))
            if ev is not None:
                share = ev.nbytes / merged[(ev.layer, ev.t_start, ev.t_end)]
                read_t[k] = float(ev.t_end - ev.t_start) * share
        out.append(
            es.LayerProfile(
                t_ne=float(t_ne_of_layer[lay.index]) + dense_before[lay.index],
                group_bytes=group_bytes,
                routes=routes,
                read_times=read_t,
                exec_times=exec_t,
                layer=i,
            )
        )
    return out


if __name__ == "__main__":  # pragma: no cover
    print(profile_model(sys.argv[1], log=print))
