"""Device/model calibration profiles: a versioned JSON schema, validated on load.

One calibration request per candidate group size ``g`` yields, for every calibration layer,
``T_ne`` and per-group byte counts, route counts, read times and execution times; a grouped-read
microbenchmark yields ``BW(g, q)``; the smallest-``g`` run also measures the non-arena memory
``M_other(g)``. See the package README for the schema with an example.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["FORMAT", "SCHEMA_VERSION", "LayerProfile", "Profile", "ProfileError", "n_groups"]

FORMAT = "estream-profile"
SCHEMA_VERSION = 1


class ProfileError(ValueError):
    """A profile is malformed; the message starts with the JSON path of the offending value."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


def n_groups(n_experts: int, g: int) -> int:
    """Groups of ``g`` consecutive experts in storage order: ``ceil(N_e / g)``."""
    return -(-n_experts // g)


def _ro(a: NDArray[Any]) -> NDArray[Any]:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _f64(x: Any) -> NDArray[np.float64]:
    return _ro(np.asarray(x, dtype=np.float64).reshape(-1))


def _i64(x: Any) -> NDArray[np.int64]:
    return _ro(np.asarray(x, dtype=np.int64).reshape(-1))


_array_eq = attrs.cmp_using(eq=lambda a, b: bool(np.array_equal(a, b)))


@attrs.frozen
class LayerProfile:
    """One calibration layer at one group size: all ``ceil(N_e/g)`` groups in storage order.

    ``t_ne``: completion time of the layer's non-expert work (s, from layer start);
    ``group_bytes``: bytes of each group's extent; ``routes``: routes (token, expert pairs) per
    group, 0 for a group nobody routed to (such groups are dropped from the schedule);
    ``read_times``: read service time per group (s) measured with ``Profile.q_measured`` reads in
    flight; ``exec_times``: execution time per group (s). ``layer``: MoE layer index, if known.
    """

    t_ne: float = attrs.field(converter=float)
    group_bytes: NDArray[np.int64] = attrs.field(converter=_i64, eq=_array_eq)
    routes: NDArray[np.int64] = attrs.field(converter=_i64, eq=_array_eq)
    read_times: NDArray[np.float64] = attrs.field(converter=_f64, eq=_array_eq)
    exec_times: NDArray[np.float64] = attrs.field(converter=_f64, eq=_array_eq)
    layer: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.layer is not None:
            d["layer"] = self.layer
        d.update(
            t_ne=self.t_ne,
            group_bytes=self.group_bytes.tolist(),
            routes=self.routes.tolist(),
            read_times=self.read_times.tolist(),
            exec_times=self.exec_times.tolist(),
        )
        return d


def _int_keys(d: Mapping[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


@attrs.frozen
class Profile:
    """A calibration profile; construct with :meth:`from_dict` / :meth:`from_path` or directly.

    Every constructor validates (``ProfileError`` names the JSON path of the first problem).
    """

    model: str
    device: str
    n_experts: int
    n_layers: int
    expert_bytes: int
    q_measured: int
    m_other: Mapping[int, int] = attrs.field(converter=_int_keys)
    bandwidth: Mapping[int, Mapping[int, float]] = attrs.field(
        converter=lambda d: {int(g): _int_keys(v) for g, v in d.items()}
    )
    candidates: Mapping[int, Sequence[LayerProfile]] = attrs.field(
        converter=lambda d: {int(g): tuple(v) for g, v in sorted(_int_keys(d).items())}
    )
    version: int = SCHEMA_VERSION
    meta: Mapping[str, Any] = attrs.field(factory=dict)
    #: what the profile was measured with (CPU, kernel build, threads, ...), as the measuring
    #: program names it: string keys, each a string, an integer or a list of strings. Empty for
    #: a profile that does not record it. Compared by the program that uses the profile: a
    #: profile measured with other kernels or on another CPU predicts other times.
    measured_with: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    #: memory a request adds per token beyond the calibration prompt (``meta["tokens"]``), in
    #: bytes: the activations that grow with the prompt, measured as the growth of a pass's
    #: peak over a longer one. None for a profile that does not record it.
    m_per_token: int | None = None
    # Derived arrays (budget independent) cached per profile; not part of the value.
    _cache: dict[Any, Any] = attrs.field(factory=dict, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        _validate(self)

    @property
    def groups(self) -> list[int]:
        """Candidate group sizes ``g``, ascending."""
        return sorted(self.candidates)

    @property
    def n_calibration_layers(self) -> int:
        return len(next(iter(self.candidates.values())))

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "model": self.model,
            "device": self.device,
            "n_experts": self.n_experts,
            "n_layers": self.n_layers,
            "expert_bytes": self.expert_bytes,
            "q_measured": self.q_measured,
            "m_other": {str(g): int(v) for g, v in sorted(self.m_other.items())},
            "bandwidth": {
                str(g): {str(q): float(bw) for q, bw in sorted(row.items())}
                for g, row in sorted(self.bandwidth.items())
            },
            "candidates": {
                str(g): [lp.to_dict() for lp in layers] for g, layers in self.candidates.items()
            },
            "meta": dict(self.meta),
            **({"measured_with": dict(self.measured_with)} if self.measured_with else {}),
            **({"m_per_token": self.m_per_token} if self.m_per_token is not None else {}),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON atomically: a temporary file of its own beside `path` (named first,
        made inside the `try` that removes it, so neither an error nor an interrupt at any
        moment leaves it behind), renamed over `path`."""
        path = os.fspath(path)
        tmp: str | None = f"{path}.tmp-{secrets.token_hex(6)}"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except OSError:
                tmp = None  # not made here: nothing to remove
                raise
            with open(fd, "w", encoding="utf-8") as fh:
                json.dump(self.to_dict(), fh, indent=1)
                fh.write("\n")
            os.replace(tmp, path)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as e:
            raise ProfileError("", f"{os.fspath(path)} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        """Parse and validate a profile document (as produced by :meth:`to_dict`)."""
        return _parse(d)


# ---- parsing (types) --------------------------------------------------------------------------


def _p(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _get(d: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise ProfileError(_p(path, key), "missing")
    return d[key]


def _int(v: Any, path: str, *, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ProfileError(path, f"expected an integer, got {v!r} ({_tname(v)})")
    if minimum is not None and v < minimum:
        raise ProfileError(path, f"expected an integer >= {minimum}, got {v}")
    return v


def _num(v: Any, path: str, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProfileError(path, f"expected a number, got {v!r} ({_tname(v)})")
    x = float(v)
    if not math.isfinite(x):
        raise ProfileError(path, f"expected a finite number, got {v!r}")
    if positive and x <= 0:
        raise ProfileError(path, f"expected a number > 0, got {v!r}")
    if not positive and x < 0:
        raise ProfileError(path, f"expected a number >= 0, got {v!r}")
    return x


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise ProfileError(path, f"expected a string, got {v!r} ({_tname(v)})")
    return v


def _obj(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ProfileError(path, f"expected an object, got {_tname(v)}")
    return v


def _gkey(k: Any, path: str, what: str) -> int:
    try:
        g = int(k)
    except (TypeError, ValueError):
        g = 0
    if g < 1 or str(g) != str(k).strip():
        raise ProfileError(_p(path, str(k)), f"{what} key must be a positive integer, got {k!r}")
    return g


def _numbers(v: Any, path: str, n: int | None, *, integer: bool = False) -> list[Any]:
    what = "integers" if integer else "numbers"
    if not isinstance(v, list):
        raise ProfileError(path, f"expected a list of {what}, got {_tname(v)}")
    if n is not None and len(v) != n:
        raise ProfileError(path, f"expected {n} {what}, got {len(v)}")
    if integer:
        return [_int(x, _p(path, i), minimum=0) for i, x in enumerate(v)]
    return [_num(x, _p(path, i)) for i, x in enumerate(v)]


def _parse(d: Any) -> Profile:
    d = _obj(d, "")
    fmt = d.get("format", FORMAT)
    if fmt != FORMAT:
        raise ProfileError("format", f"expected {FORMAT!r}, got {fmt!r}")
    version = _int(_get(d, "version", ""), "version")
    if version != SCHEMA_VERSION:
        raise ProfileError(
            "version",
            f"unsupported profile version {version} (this estream-sched reads {SCHEMA_VERSION})",
        )
    n_experts = _int(_get(d, "n_experts", ""), "n_experts", minimum=1)
    m_other_raw = _obj(_get(d, "m_other", ""), "m_other")
    m_other = {
        _gkey(k, "m_other", "m_other"): _int(v, _p("m_other", str(k)), minimum=0)
        for k, v in m_other_raw.items()
    }
    bw_raw = _obj(_get(d, "bandwidth", ""), "bandwidth")
    bandwidth: dict[int, dict[int, float]] = {}
    for k, row in bw_raw.items():
        g = _gkey(k, "bandwidth", "bandwidth")
        rp = _p("bandwidth", str(k))
        bandwidth[g] = {
            _gkey(q, rp, "queue depth"): _num(v, _p(rp, str(q)), positive=True)
            for q, v in _obj(row, rp).items()
        }
    cand_raw = _obj(_get(d, "candidates", ""), "candidates")
    candidates: dict[int, list[LayerProfile]] = {}
    for k, layers in cand_raw.items():
        g = _gkey(k, "candidates", "candidates")
        cp = _p("candidates", str(k))
        if not isinstance(layers, list):
            raise ProfileError(cp, f"expected a list of layer profiles, got {_tname(layers)}")
        K = n_groups(n_experts, g)
        out = []
        for i, lp in enumerate(layers):
            lpath = _p(cp, i)
            lp = _obj(lp, lpath)
            layer = lp.get("layer")
            out.append(
                LayerProfile(
                    layer=None if layer is None else _int(layer, _p(lpath, "layer"), minimum=0),
                    t_ne=_num(_get(lp, "t_ne", lpath), _p(lpath, "t_ne")),
                    group_bytes=_numbers(
                        _get(lp, "group_bytes", lpath), _p(lpath, "group_bytes"), K, integer=True
                    ),
                    routes=_numbers(
                        _get(lp, "routes", lpath), _p(lpath, "routes"), K, integer=True
                    ),
                    read_times=_numbers(_get(lp, "read_times", lpath), _p(lpath, "read_times"), K),
                    exec_times=_numbers(_get(lp, "exec_times", lpath), _p(lpath, "exec_times"), K),
                )
            )
        candidates[g] = out
    meta = d.get("meta", {})
    measured_with = _obj(d.get("measured_with", {}), "measured_with")
    per_token = d.get("m_per_token")
    return Profile(
        version=version,
        model=_str(_get(d, "model", ""), "model"),
        device=_str(_get(d, "device", ""), "device"),
        n_experts=n_experts,
        n_layers=_int(_get(d, "n_layers", ""), "n_layers", minimum=1),
        expert_bytes=_int(_get(d, "expert_bytes", ""), "expert_bytes", minimum=1),
        q_measured=_int(_get(d, "q_measured", ""), "q_measured", minimum=1),
        m_other=m_other,
        bandwidth=bandwidth,
        candidates=candidates,
        meta=dict(_obj(meta, "meta")),
        measured_with=dict(measured_with),
        m_per_token=None if per_token is None else _int(per_token, "m_per_token", minimum=0),
    )


# ---- validation (semantics); also runs for directly constructed profiles ---------------------


def _validate(p: Profile) -> None:
    # long: the profile validator, one check per field
    if p.version != SCHEMA_VERSION:
        raise ProfileError("version", f"unsupported profile version {p.version}")
    _validate_measured_with(p.measured_with)
    for name in ("n_experts", "n_layers", "expert_bytes", "q_measured"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ProfileError(name, f"expected an integer >= 1, got {v!r}")
    if not p.candidates:
        raise ProfileError("candidates", "no candidate group sizes")
    gs = sorted(p.candidates)
    for g in gs:
        if g < 1 or g > p.n_experts:
            raise ProfileError(
                _p("candidates", str(g)), f"group size must be in 1..n_experts={p.n_experts}"
            )
    for name, table in (("m_other", p.m_other), ("bandwidth", p.bandwidth)):
        missing = [g for g in gs if g not in table]
        extra = sorted(set(table) - set(gs))
        if missing:
            raise ProfileError(name, f"missing entry for g={missing[0]} (candidates are {gs})")
        if extra:
            raise ProfileError(
                _p(name, str(extra[0])), f"no candidate profile for g={extra[0]} (candidates {gs})"
            )
    mt = p.m_per_token
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
        raise ProfileError("m_per_token", f"expected bytes >= 0 or null, got {mt!r}")
    for g in gs:
        if p.m_other[g] < 0:
            raise ProfileError(_p("m_other", str(g)), f"expected bytes >= 0, got {p.m_other[g]}")
    g0 = gs[0]
    qs0 = sorted(p.bandwidth[g0])
    for g in gs:
        row = p.bandwidth[g]
        bp = _p("bandwidth", str(g))
        if not row:
            raise ProfileError(bp, "no queue depths measured")
        if sorted(row) != qs0:
            raise ProfileError(
                bp,
                f"queue depths {sorted(row)} differ from bandwidth.{g0}'s {qs0}; measure the same q for every g",
            )
        for q, bw in row.items():
            if q < 1:
                raise ProfileError(_p(bp, str(q)), "queue depth must be >= 1")
            if not (math.isfinite(bw) and bw > 0):
                raise ProfileError(_p(bp, str(q)), f"expected bytes/s > 0, got {bw!r}")
    if p.q_measured not in qs0:
        raise ProfileError(
            "q_measured", f"{p.q_measured} is not one of the measured queue depths {qs0}"
        )
    W = len(p.candidates[g0])
    for g in gs:
        layers = p.candidates[g]
        cp = _p("candidates", str(g))
        if len(layers) == 0:
            raise ProfileError(cp, "no calibration layers")
        if len(layers) != W:
            raise ProfileError(
                cp,
                f"{len(layers)} calibration layers, but candidates.{g0} has {W}; "
                "every g must profile the same layers",
            )
        K = n_groups(p.n_experts, g)
        expect = np.full(K, g * p.expert_bytes, dtype=np.int64)
        expect[-1] = (p.n_experts - (K - 1) * g) * p.expert_bytes
        for i, lp in enumerate(layers):
            lpath = _p(cp, i)
            if not isinstance(lp, LayerProfile):
                raise ProfileError(lpath, f"expected a LayerProfile, got {_tname(lp)}")
            if lp.layer is not None and not (0 <= lp.layer < p.n_layers):
                raise ProfileError(_p(lpath, "layer"), f"must be in 0..{p.n_layers - 1}")
            if not (math.isfinite(lp.t_ne) and lp.t_ne >= 0):
                raise ProfileError(_p(lpath, "t_ne"), f"expected seconds >= 0, got {lp.t_ne!r}")
            for name in ("group_bytes", "routes", "read_times", "exec_times"):
                arr = getattr(lp, name)
                what = "integers" if arr.dtype.kind == "i" else "numbers"
                if arr.shape != (K,):
                    raise ProfileError(_p(lpath, name), f"expected {K} {what}, got {arr.shape[0]}")
                bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
                if bad.size:
                    raise ProfileError(
                        _p(_p(lpath, name), int(bad[0])),
                        f"expected a finite value >= 0, got {arr[bad[0]]!r}",
                    )
            bad = np.flatnonzero(lp.group_bytes != expect)
            if bad.size:
                k = int(bad[0])
                n = int(expect[k] // p.expert_bytes)
                raise ProfileError(
                    _p(_p(lpath, "group_bytes"), k),
                    f"expected {int(expect[k])} ({n} experts x expert_bytes {p.expert_bytes}), "
                    f"got {int(lp.group_bytes[k])}",
                )


def _validate_measured_with(m: Mapping[str, Any]) -> None:
    """``measured_with``: non-empty string keys, each value a string, an integer (not a bool)
    or a list of strings."""
    for k, v in m.items():
        if not isinstance(k, str) or not k:
            raise ProfileError("measured_with", f"keys must be non-empty strings, got {k!r}")
        path = _p("measured_with", k)
        if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
            continue
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            continue
        raise ProfileError(
            path, f"expected a string, an integer or a list of strings, got {v!r} ({_tname(v)})"
        )
