"""The max-plus pipeline recurrence of docs/design.md §6, vectorised over candidates.

For one layer with ``K`` scheduled groups (1-based ``k``; ``d_j = f_j = 0`` for ``j ≤ 0``)::

    a_k = max(d_{k-q}, f_{k-b}, r)     # at most q reads in flight; bank reuse waits for its
                                       # consumer; no read before its release time r
    d_k = a_k + L_k
    s_k = max(d_k, t_ne, f_{k-1})      # data ready, non-expert work done, executor free
    f_k = s_k + X_k
    T_pipe = f_K                       # and T_pipe = t_ne when K = 0

The release time ``r`` (``t_read``, default 0) is when the layer's reads may begin: 0 when
they are issued at layer start (the ``early`` schedule, or ``after-routing`` for an architecture
whose router reads the layer's input before attention), ``t_ne`` when they wait for a router
that runs after attention (``after-routing`` otherwise).

Every leading axis of ``L``/``X`` (and of ``t_ne``, ``t_read``, ``q``, ``b``) is a candidate
axis: thousands of ``(layer, g, q, b)`` candidates are evaluated with one Python loop over ``k``.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["Schedule", "pipeline_schedule", "pipeline_time"]

F64 = NDArray[np.float64]


def _arr_eq(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b))


def _as_f64(x: ArrayLike) -> F64:
    return np.asarray(x, dtype=np.float64)


@attrs.frozen(eq=False)
class Schedule:
    """Read start/end ``a, d`` and execution start/end ``s, f`` of every scheduled group.

    Arrays have shape ``[..., K]`` (candidate axes first, groups last); ``t_ne`` has the
    candidate shape. Times are seconds from the start of the layer.
    """

    a: F64 = attrs.field(converter=_as_f64)
    d: F64 = attrs.field(converter=_as_f64)
    s: F64 = attrs.field(converter=_as_f64)
    f: F64 = attrs.field(converter=_as_f64)
    t_ne: F64 = attrs.field(converter=_as_f64)

    @property
    def n_groups(self) -> int:
        return int(self.f.shape[-1])

    @property
    def total(self) -> F64:
        """``f_K`` per candidate (``t_ne`` where there are no groups)."""
        if self.n_groups == 0:
            return np.broadcast_to(self.t_ne, self.f.shape[:-1]).copy()
        return self.f[..., -1].copy()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return all(
            _arr_eq(getattr(self, n), getattr(other, n)) for n in ("a", "d", "s", "f", "t_ne")
        )

    def allclose(self, other: Schedule, *, rtol: float = 1e-12, atol: float = 0.0) -> bool:
        return all(
            np.shape(getattr(self, n)) == np.shape(getattr(other, n))
            and bool(np.allclose(getattr(self, n), getattr(other, n), rtol=rtol, atol=atol))
            for n in ("a", "d", "s", "f", "t_ne")
        )


def _prepare(
    L: ArrayLike, X: ArrayLike, t_ne: ArrayLike, q: ArrayLike, b: ArrayLike, t_read: ArrayLike
) -> tuple[F64, F64, F64, NDArray[np.int64], NDArray[np.int64], F64, tuple[int, ...]]:
    L_ = np.asarray(L, dtype=np.float64)
    X_ = np.asarray(X, dtype=np.float64)
    if L_.ndim == 0 or X_.ndim == 0:
        raise ValueError("L and X must have a group axis (shape [..., K])")
    if L_.shape[-1] != X_.shape[-1]:
        raise ValueError(
            f"L and X must have the same number of groups K (last axis): {L_.shape} vs {X_.shape}"
        )
    t = np.asarray(t_ne, dtype=np.float64)
    r = np.asarray(t_read, dtype=np.float64)
    q_in, b_in = np.asarray(q), np.asarray(b)
    for name, v in (("q", q_in), ("b", b_in)):
        if v.dtype.kind not in "iu" and not (
            v.dtype.kind == "f" and v.size and np.all(v == np.floor(v))
        ):
            raise ValueError(f"{name} must be an integer (or integer array), got {v!r}")
        if v.size and np.min(v) < 1:
            raise ValueError(f"{name} must be >= 1, got min {np.min(v)}")
    qi, bi = q_in.astype(np.int64), b_in.astype(np.int64)
    for name, v in (("L", L_), ("X", X_), ("t_ne", t), ("t_read", r)):
        if v.size and not (np.all(np.isfinite(v)) and np.min(v) >= 0):
            raise ValueError(f"{name} must be finite and >= 0")
    batch = np.broadcast_shapes(L_.shape[:-1], X_.shape[:-1], t.shape, qi.shape, bi.shape, r.shape)
    K = L_.shape[-1]
    return (
        np.broadcast_to(L_, (*batch, K)),
        np.broadcast_to(X_, (*batch, K)),
        np.broadcast_to(t, batch),
        np.broadcast_to(qi, batch),
        np.broadcast_to(bi, batch),
        np.broadcast_to(r, batch),
        batch,
    )


def _run(
    L: F64, X: F64, t: F64, q: NDArray[np.int64], b: NDArray[np.int64], r: F64, keep: bool
) -> tuple[F64, F64, F64, F64] | F64:
    """Core loop on flattened candidates; histories have K zero rows on top (``j ≤ 0``)."""
    batch = t.shape
    K = L.shape[-1]
    N = int(np.prod(batch, dtype=np.int64))
    Lf = np.ascontiguousarray(L.reshape(N, K).T)  # [K, N]
    Xf = np.ascontiguousarray(X.reshape(N, K).T)
    tf = t.reshape(N)
    qf, bf = q.reshape(N), b.reshape(N)
    rf = r.reshape(N)
    released = bool(np.any(rf > 0))
    D = np.zeros((2 * K, N))
    Fh = np.zeros((2 * K, N))
    A = np.empty((K, N)) if keep else None
    S = np.empty((K, N)) if keep else None
    if N == 0:  # an empty candidate axis: nothing to evaluate
        empty = np.zeros((*batch, K))
        return tf.reshape(batch).copy() if not keep else (empty, empty, empty, empty)
    cols = np.arange(N)
    q_scalar = bool(np.all(qf == qf[0]))
    b_scalar = bool(np.all(bf == bf[0]))
    qe = np.minimum(qf, K)
    be = np.minimum(bf, K)
    a = np.empty(N)
    s = np.empty(N)
    for k in range(1, K + 1):
        row = K + k - 1
        dq = D[row - int(qe[0])] if q_scalar else D[row - qe, cols]
        fb = Fh[row - int(be[0])] if b_scalar else Fh[row - be, cols]
        np.maximum(dq, fb, out=a)
        if released:
            np.maximum(a, rf, out=a)
        np.add(a, Lf[k - 1], out=D[row])
        np.maximum(D[row], tf, out=s)
        np.maximum(s, Fh[row - 1], out=s)
        np.add(s, Xf[k - 1], out=Fh[row])
        if keep:
            A[k - 1] = a  # type: ignore[index]
            S[k - 1] = s  # type: ignore[index]
    if not keep:
        if K == 0:
            return tf.reshape(batch).copy()
        return Fh[2 * K - 1].reshape(batch).copy()

    def out(h: F64) -> F64:
        return np.ascontiguousarray(h.T).reshape((*batch, K))

    return out(A), out(D[K:]), out(S), out(Fh[K:])  # type: ignore[arg-type]


def pipeline_time(
    L: ArrayLike,
    X: ArrayLike,
    t_ne: ArrayLike,
    q: ArrayLike,
    b: ArrayLike,
    t_read: ArrayLike = 0.0,
) -> F64 | float:
    """``T_pipe = f_K`` of the recurrence, per candidate.

    ``L``, ``X``: read service and execution times, shape ``[..., K]``; ``t_ne``: non-expert
    completion time, scalar or ``[...]``; ``q`` (reads in flight) and ``b`` (banks): ints >= 1 or
    int arrays; all leading axes broadcast. With ``K = 0`` there is no expert work and the layer
    ends when its non-expert work does: ``T_pipe = t_ne``. ``t_read``: the reads' release time
    (module docstring), scalar or ``[...]``, default 0. Returns a float for scalar batches.
    """
    L_, X_, t, q_, b_, r, batch = _prepare(L, X, t_ne, q, b, t_read)
    res = _run(L_, X_, t, q_, b_, r, keep=False)
    assert isinstance(res, np.ndarray)
    return float(res) if batch == () else res


def pipeline_schedule(
    L: ArrayLike,
    X: ArrayLike,
    t_ne: ArrayLike,
    q: ArrayLike,
    b: ArrayLike,
    t_read: ArrayLike = 0.0,
) -> Schedule:
    """The whole schedule ``(a, d, s, f)`` of the recurrence; see :func:`pipeline_time`."""
    L_, X_, t, q_, b_, r, _ = _prepare(L, X, t_ne, q, b, t_read)
    res = _run(L_, X_, t, q_, b_, r, keep=True)
    assert isinstance(res, tuple)
    a, d, s, f = res
    return Schedule(a=a, d=d, s=s, f=f, t_ne=np.array(t))


def sweep_banks(
    L: F64, X: F64, t_ne: F64, q: int, b_lo: int, b_hi: int, t_read: F64 | None = None
) -> F64:
    """``f_K`` for every bank count ``b_lo..b_hi`` at once: returns ``[..., b_hi - b_lo + 1]``.

    The configurator's fast path (no validation): ``L``, ``X`` are ``[W, K]`` float64 (layers
    with fewer groups padded at the END with zero-time groups, which leaves ``f_K`` bit-for-bit
    unchanged), ``t_ne`` is ``[W]``; ``t_read`` ``[W]`` the reads' release times (None: 0). ``f_{k-b}`` for all ``b`` is one strided view of the
    history, so each step is five ufunc calls on a ``[W, nb]`` block.
    """
    W, K = L.shape
    nb = b_hi - b_lo + 1
    if K == 0:
        return np.repeat(t_ne[:, None], nb, axis=1)
    P = max(b_hi, q, 1)
    rows = P + K
    plane = nb * W
    # History rows are group indices (P zero rows on top for j <= 0); within a row, column j
    # holds b = b_hi - j (descending b) and the layer axis is innermost, so f_{k-b} for every b
    # is a positive-stride diagonal whose rows are contiguous runs of W values.
    buf = _work_buffer(2 * rows * plane)
    D = buf[: rows * plane].reshape(rows, nb, W)
    Fh = buf[rows * plane :].reshape(rows, nb, W)
    D[:P] = 0.0
    Fh[:P] = 0.0
    flat = buf[rows * plane :]
    it = flat.itemsize
    a = np.empty((nb, W))
    Lc = np.ascontiguousarray(L.T)  # [K, W]
    Xc = np.ascontiguousarray(X.T)
    # diag[k - 1][j, w] = f_{k - (b_hi - j)} of layer w: one strided view for all steps.
    diag = np.lib.stride_tricks.as_strided(
        flat[(P - b_hi) * plane :],
        shape=(K, nb, W),
        strides=(plane * it, (plane + W) * it, it),
    )
    for k in range(1, K + 1):
        row = P + k - 1
        np.maximum(D[row - q], diag[k - 1], out=a)
        if t_read is not None:
            np.maximum(a, t_read, out=a)
        np.add(a, Lc[k - 1], out=D[row])
        # s_1 = max(d_1, t_ne); for k >= 2, f_{k-1} >= s_1 >= t_ne already.
        np.maximum(D[row], t_ne if k == 1 else Fh[row - 1], out=a)
        np.add(a, Xc[k - 1], out=Fh[row])
    return Fh[rows - 1][::-1].T.copy()


_tls = threading.local()


def _work_buffer(n: int) -> F64:
    """A per-thread scratch buffer, reused across calls (avoids page faults on every call)."""
    buf: F64 | None = getattr(_tls, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1 << 16))
        _tls.buf = buf
    return buf[:n]
