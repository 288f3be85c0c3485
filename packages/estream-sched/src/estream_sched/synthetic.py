"""Synthetic (but physically plausible) calibration profiles for tests, benchmarks and demos.

A ``SyntheticSpec`` describes a device and a model in a few numbers; :func:`synthetic_profile`
turns it into a full :class:`~estream_sched.Profile` as a calibration run would have measured it:

* grouped reads: a read of ``n`` bytes costs ``t0 + n / stream_bw`` on one stream, ``q`` streams
  share the device up to ``peak_bw``: ``BW(g, q) = min(peak_bw, q · n / (t0 + n / stream_bw))``;
* routes: per layer, expert popularity ``~ Dirichlet(alpha)``, ``tokens · top_k`` routes drawn
  multinomially; each expert independently unrouted with probability ``p_unrouted``;
* execution of a group: ``c_group + Σ_routed experts (c_expert + c_route · routes_e)``;
* every measured time gets multiplicative log-normal noise ``noise`` (independently per ``g``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from .profile import LayerProfile, Profile, n_groups

__all__ = ["SyntheticSpec", "synthetic_profile"]


@attrs.frozen
class SyntheticSpec:
    model: str = "synthetic-moe"
    device: str = "synthetic-ufs"
    n_experts: int = 64
    n_layers: int = 16
    calibration_layers: int | None = None  # default: every MoE layer
    expert_bytes: int = 3 * 1179648  # OLMoE-1B-7B expert record, Q4_0, 4 KiB padded
    groups: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16), converter=tuple)
    queue_depths: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8), converter=tuple)
    q_measured: int = 2
    tokens: int = 1024
    top_k: int = 8
    alpha: float = 2.0
    p_unrouted: float = 0.0
    t0: float = 150e-6
    stream_bw: float = 2.0e9
    peak_bw: float = 3.6e9
    c_group: float = 40e-6
    c_expert: float = 25e-6
    c_route: float = 6e-6
    t_ne: float = 15e-3
    t_ne_jitter: float = 0.1
    m_other_base: int = 800 * 2**20
    m_other_per_g: int = 2 * 2**20
    noise: float = 0.03

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SyntheticSpec:
        names = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown synthetic-spec keys {unknown}; known: {sorted(names)}")
        return cls(**dict(d))

    def bandwidth(self, g: int, q: int) -> float:
        n = g * self.expert_bytes
        return float(min(self.peak_bw, q * n / (self.t0 + n / self.stream_bw)))


def synthetic_profile(spec: SyntheticSpec | None = None, *, seed: int = 0) -> Profile:
    """A profile as one calibration request per ``g`` would have measured it (deterministic)."""
    spec = spec or SyntheticSpec()
    rng = np.random.default_rng(seed)
    E, We = spec.n_experts, spec.expert_bytes
    W = spec.calibration_layers or spec.n_layers
    gs: Sequence[int] = sorted(spec.groups)
    bandwidth = {g: {q: spec.bandwidth(g, q) for q in spec.queue_depths} for g in gs}
    # Routing does not depend on g: one route vector per calibration layer.
    routes_e = []
    t_ne = []
    for _ in range(W):
        pop = rng.dirichlet(np.full(E, spec.alpha))
        r = rng.multinomial(spec.tokens * spec.top_k, pop)
        r[rng.random(E) < spec.p_unrouted] = 0
        routes_e.append(r.astype(np.int64))
        t_ne.append(spec.t_ne * (1 + spec.t_ne_jitter * (2 * rng.random() - 1)))

    def noisy(x: np.ndarray) -> np.ndarray:
        return x * np.exp(spec.noise * rng.standard_normal(np.shape(x)))

    candidates: dict[int, list[LayerProfile]] = {}
    for g in gs:
        K = n_groups(E, g)
        sizes = np.full(K, g, dtype=np.int64)
        sizes[-1] = E - (K - 1) * g
        nbytes = sizes * We
        bw = bandwidth[g][spec.q_measured]
        layers = []
        for w in range(W):
            r = routes_e[w]
            starts = np.arange(K) * g
            routes = np.add.reduceat(r, starts)
            n_routed = np.add.reduceat((r > 0).astype(np.int64), starts)
            ex = spec.c_group + spec.c_expert * n_routed + spec.c_route * routes
            ex = np.where(routes > 0, noisy(ex), 0.0)
            rd = noisy(nbytes * spec.q_measured / bw)
            layers.append(
                LayerProfile(
                    layer=w if spec.n_layers == W else int(w * spec.n_layers // W),
                    t_ne=float(noisy(np.float64(t_ne[w]))),
                    group_bytes=nbytes,
                    routes=routes,
                    read_times=rd,
                    exec_times=ex,
                )
            )
        candidates[g] = layers
    return Profile(
        model=spec.model,
        device=spec.device,
        n_experts=E,
        n_layers=spec.n_layers,
        expert_bytes=We,
        q_measured=spec.q_measured,
        m_other={g: spec.m_other_base + g * spec.m_other_per_g for g in gs},
        bandwidth=bandwidth,
        candidates=candidates,
        meta={"synthetic": True, "seed": seed, "tokens": spec.tokens},
    )
