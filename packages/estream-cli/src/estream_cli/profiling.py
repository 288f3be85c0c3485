"""Device/model calibration (`estream profile`) and configuration (`estream config`).

Profiling runs one calibration request per candidate group size `g` (docs/design.md §6): a prompt of
`T` tokens streamed with `Q = 1` and enough banks that reads never wait for a bank, so that each
group's read time is its pure service time and each group's execution time is measured alone.
Grouped-read bandwidth `BW(g, q)` is measured with the real loader on a cold file. The resulting
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

from .engine import Engine, PrefillResult
from .errors import PackError
from .experts import READ_MERGE_BYTES
from .memory import drop_file_cache
from .packed import PackedModel

__all__ = ["DEFAULT_CANDIDATES", "measure_bandwidth", "profile_model"]

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16)
DEFAULT_QS = (1, 2, 4, 8)


def measure_bandwidth(
    model: PackedModel,
    g: int,
    q: int,
    *,
    max_bytes: int = 256 << 20,
) -> float:
    """Grouped-read bandwidth (bytes/s) of the real loader at group size g, queue depth q."""
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
        ea.Arena(layout, n_banks=q + 1, group_size=g) as arena,
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


def profile_model(
    path: str | os.PathLike[str],
    *,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    queue_depths: Sequence[int] = DEFAULT_QS,
    n_tokens: int = 256,
    seed: int = 0,
    n_threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> es.Profile:
    """Calibrate: one request per candidate g, plus BW(g, q). Returns an `estream_sched.Profile`."""
    say = log or (lambda s: None)
    model = PackedModel(path)
    hp = model.hparams
    gs = sorted({int(g) for g in candidates if 1 <= int(g) <= hp.n_experts})
    queue_depths = sorted({1, *(int(q) for q in queue_depths)})  # reads are timed at q = 1
    if not gs:
        raise PackError(f"no candidate group size fits {hp.n_experts} experts")
    T = max(1, min(int(n_tokens), hp.n_ctx))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hp.n_vocab, size=T)
    W_e = model.record_bytes
    cand: dict[int, list[es.LayerProfile]] = {}
    m_other: dict[int, int] = {}
    bandwidth: dict[int, dict[int, float]] = {}
    for g in gs:
        t0 = time.perf_counter()
        B = -(-hp.n_experts // g)
        with Engine(path, G=g, Q=1, B=B, n_threads=n_threads) as eng:
            eng.prefill(tokens[: min(T, 8)])  # warm-up: dense weights paged in, pool started
            res = eng.prefill(tokens)
            arena_bytes = eng.experts.memory_bytes
        # process-owned memory only: MemAvailable also moves with other processes on the machine
        m_other[g] = max(0, int(res.metrics["peak_rss_bytes"]) - int(arena_bytes))
        cand[g] = _layer_profiles(res, model, g)
        bandwidth[g] = {int(q): measure_bandwidth(model, g, int(q)) for q in queue_depths}
        say(
            f"  g={g:<3d} B={B:<3d} ttft={res.metrics['ttft_s'] * 1e3:8.1f} ms  "
            f"BW(q={','.join(str(q) for q in queue_depths)})="
            + "/".join(f"{bandwidth[g][int(q)] / 1e9:.2f}" for q in queue_depths)
            + f" GB/s  ({time.perf_counter() - t0:.1f} s)"
        )
    return es.Profile(
        model=str(model.manifest.get("source", {}).get("file", model.path.name)),
        device=_device_name(),
        n_experts=hp.n_experts,
        n_layers=len(model.layers),
        expert_bytes=W_e,
        m_other=m_other,
        bandwidth=bandwidth,
        candidates=cand,
        q_measured=1,
        meta={"tokens": T},  # the pass m_other was measured on (batch sizing reads it)
    )


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


def _device_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


if __name__ == "__main__":  # pragma: no cover
    print(profile_model(sys.argv[1], log=print))
