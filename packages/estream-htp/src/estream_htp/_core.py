"""Typed NumPy layer over the C ABI: validates before crossing into C, owns no hidden copies,
turns status codes into exceptions. Every op runs on a `Backend` (default: a process-wide host
backend created on first use) and takes its activation format per call."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from estream_htp._backend import (
    ACT,
    SIMD_LEVELS,
    Backend,
    CapacityError,
    ExecutorDiedError,
    ExpertNotResidentError,
    Fence,
    HTPDescriptorError,
    HTPError,
    HTPInputError,
    HTPTimeoutError,
    HTPUnsupportedError,
    best_simd_level,
    check,
)
from estream_htp._ffi import ffi, lib
from estream_htp._formats import FLOAT_TILE_FORMATS, TILE_FORMATS, matrix_nbytes

__all__ = [
    "GLU_KINDS",
    "Backend",
    "CapacityError",
    "ExecutorDiedError",
    "ExpertGraph",
    "ExpertNotResidentError",
    "Fence",
    "HTPDescriptorError",
    "HTPError",
    "HTPInputError",
    "HTPTimeoutError",
    "HTPUnsupportedError",
    "Q8Rows",
    "add",
    "attention",
    "conv1d_causal",
    "copy_rows",
    "default_backend",
    "expert_biases",
    "fill",
    "gemm",
    "get_activation_format",
    "get_num_threads",
    "get_rows",
    "matmul_f32",
    "moe_ffn",
    "mul",
    "native_bf16_attention",
    "open_backend",
    "q8_rows_nbytes",
    "quantize_q8",
    "rms_norm",
    "rms_norm_heads",
    "rope",
    "rope_yarn_corr_dims",
    "router_topk",
    "set_activation_format",
    "set_num_threads",
    "silu",
    "simd_level",
    "swiglu",
    "swiglu_oai",
]

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

_FMT = {
    "q4_0-t32r4": lib.HTP_FMT_Q4_0_T32R4,
    "q8_0-t32r4": lib.HTP_FMT_Q8_0_T32R4,
    "q4_k-t32r4": lib.HTP_FMT_Q4_K_T32R4,
    "q5_k-t32r4": lib.HTP_FMT_Q5_K_T32R4,
    "q6_k-t32r4": lib.HTP_FMT_Q6_K_T32R4,
    "mxfp4-t32r4": lib.HTP_FMT_MXFP4_T32R4,
    "iq4_nl-t32r4": lib.HTP_FMT_IQ4_NL_T32R4,
    "q4_1-t32r4": lib.HTP_FMT_Q4_1_T32R4,
    "q5_0-t32r4": lib.HTP_FMT_Q5_0_T32R4,
    "q5_1-t32r4": lib.HTP_FMT_Q5_1_T32R4,
    "iq4_xs-t32r4": lib.HTP_FMT_IQ4_XS_T32R4,
    "f16-t32r4": lib.HTP_FMT_F16_T32R4,
    "bf16-t32r4": lib.HTP_FMT_BF16_T32R4,
    "f16": lib.HTP_FMT_F16,
    "f32": lib.HTP_FMT_F32,
}
_U32 = 2**32


# ---------------------------------------------------------------- validation helpers
def _arr(a: Any, name: str, dtype: Any, ndim: int | None = None) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise HTPInputError(
            f"{name} must be a numpy array of {np.dtype(dtype)}, got {type(a).__name__}"
        )
    if a.dtype != dtype:
        raise HTPInputError(
            f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype} (convert with .astype)"
        )
    if ndim is not None and a.ndim != ndim:
        raise HTPInputError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise HTPInputError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    return a


def _u32(v: int, name: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise HTPInputError(f"{name} must be an int, got {type(v).__name__}")
    if not minimum <= int(v) < _U32:
        raise HTPInputError(f"{name} must be in [{minimum}, 2**32), got {v}")
    return int(v)


def _out(out: Any, shape: tuple[int, ...], name: str = "out") -> F32:
    if out is None:
        return np.empty(shape, dtype=np.float32)
    o = _arr(out, name, np.float32)
    if o.shape != shape:
        raise HTPInputError(f"{name} must have shape {shape}, got {o.shape}")
    if not o.flags.writeable:
        raise HTPInputError(f"{name} must be writeable")
    return o


def _bytes(buf: Any, name: str) -> np.ndarray:
    """Any contiguous buffer viewed as flat uint8 (no copy)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise HTPInputError(f"{name} must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except TypeError as e:
        raise HTPInputError(
            f"{name} must be a buffer (numpy array, bytes, mmap), got {type(buf).__name__}"
        ) from e


def _act(act: str | None, be: Backend) -> str:
    a = be.act if act is None else act
    if a not in ACT:
        raise HTPInputError(f"act must be one of {sorted(ACT)}, got {a!r}")
    return a


# ---------------------------------------------------------------- the default backend
_default: Backend | None = None
_default_lock = threading.Lock()


def default_backend() -> Backend:
    """The process-wide host backend the module-level functions use when given none
    (created on first use from ``ESTREAM_HTP_THREADS`` / ``ESTREAM_HTP_SIMD`` / ``ESTREAM_HTP_ACT``)."""
    global _default
    b = _default
    if b is not None and not b.closed:
        return b
    with _default_lock:
        if _default is None or _default.closed:
            simd = os.environ.get("ESTREAM_HTP_SIMD", "").strip().lower() or None
            act = os.environ.get("ESTREAM_HTP_ACT", "").strip().lower() or "q8"
            _default = Backend("host", simd=simd, act=act)
        return _default


def open_backend(kind: str, *, n_threads: int | None = None, act: str = "q8") -> Backend:
    """The backend of ``kind`` for a runtime: this process's `default_backend` for "host"
    (shared; close it never), a new `Backend` otherwise, its executor running ``n_threads``
    (default: `default_threads`) where it runs a pool — hexagon's runs one thread."""
    if kind == "host":
        return default_backend()
    if kind == "hexagon":
        n_threads = 1
    return Backend(kind, n_threads=n_threads, act=act)


def _be(backend: Backend | None) -> Backend:
    return default_backend() if backend is None else backend


def set_num_threads(n: int) -> None:
    """Size the default backend's thread pool (the caller is thread 0)."""
    default_backend().configure(n_threads=_u32(n, "n", 1))


def get_num_threads() -> int:
    return default_backend().n_threads


def simd_level() -> str:
    """The default backend's kernel set: "portable", "avx2", "avx512", "avx512vnni", "amx", "neon"."""
    return default_backend().simd


def _set_simd_level(name: str) -> None:
    """Re-dispatch the default backend (tests and benchmarks; ``ESTREAM_HTP_SIMD`` at import)."""
    default_backend().configure(simd=name)


def simd_supported(name: str) -> bool:
    """Whether this CPU/build can run a kernel set."""
    if name not in SIMD_LEVELS:
        return False
    d = ffi.new("htp_backend_desc *")
    d.abi_version = lib.HTP_ABI_VERSION
    d.kind = lib.HTP_BACKEND_HOST
    d.n_threads = 1
    d.simd = SIMD_LEVELS[name]
    d.sock_fd = -1
    pp = ffi.new("htp_backend **")
    st = lib.htp_backend_init(d, pp)
    if st == lib.HTP_OK:
        lib.htp_backend_free(pp[0])
    return st == lib.HTP_OK


def native_bf16_attention(backend: Backend | None = None) -> bool:
    """Whether ``backend``'s kernel set (default: the default backend's) runs bf16 attention
    products (``attention(..., products="bf16")``) natively on this CPU at about twice the fp32
    products' rate: an AVX-512 level or AMX on a CPU with AVX512_BF16 (vdpbf16ps). False where
    they are emulated bit for bit (slower than fp32 products: other levels, other CPUs, the
    hexagon executor's HVX) and on NEON, whose native FEAT_BF16 kernel (BFMLALB/T, one product
    a lane) gives the same bits at below the fp32 kernel's rate. Heads whose dk or dv is not a
    multiple of 16 take the emulation on any level."""
    return bool(lib.htp_simd_native_bf16_attention(SIMD_LEVELS[_be(backend).simd]))


def set_activation_format(fmt: Literal["q8", "f32"]) -> None:
    """Default activation format of the default backend (ops also take ``act=`` per call).

    "q8": int8 per 32-block with an fp32 scale (fast path, rel. L2 error ~3e-3, see README);
    "f32": weights dequantized, fp32 products (rel. L2 ~1e-7)."""
    if fmt not in ACT:
        raise HTPInputError(f"activation format must be one of {sorted(ACT)}, got {fmt!r}")
    default_backend().act = fmt


def get_activation_format() -> str:
    return default_backend().act


def _init_from_env() -> None:
    simd = os.environ.get("ESTREAM_HTP_SIMD", "").strip().lower()
    if simd:
        if simd not in SIMD_LEVELS:
            raise HTPInputError(
                f"ESTREAM_HTP_SIMD: unknown SIMD level {simd!r}; expected one of {sorted(SIMD_LEVELS)}"
            )
        if not simd_supported(simd):
            raise HTPUnsupportedError(
                f"ESTREAM_HTP_SIMD: SIMD level {simd!r} is not supported by this CPU/build "
                f"(best is {best_simd_level()!r})"
            )
    act = os.environ.get("ESTREAM_HTP_ACT", "").strip().lower()
    if act and act not in ACT:
        raise HTPInputError(f"ESTREAM_HTP_ACT must be one of {sorted(ACT)}, got {act!r}")


# ---------------------------------------------------------------- GEMM
def gemm(
    x: F32 | Q8Rows,
    w: Any,
    n: int,
    fmt: str = "q4_0-t32r4",
    out: F32 | None = None,
    *,
    act: str | None = None,
    backend: Backend | None = None,
) -> F32:
    """``Y[T, N] = X[T, K] · Wᵀ`` with ``W[N][K]`` in a tile format (flat uint8 buffer).
    ``x`` may be `Q8Rows` (`quantize_q8`) with ``act="q8"``: the same bits as from the rows.
    ``f16-t32r4`` / ``bf16-t32r4`` matrices are multiplied in fp32 under either ``act`` (their
    values converted exactly; ``x`` must be float32)."""
    (y,) = gemm_shared(x, [(w, n)], fmt, None if out is None else [out], act=act, backend=backend)
    return y


#: matrices one GEMM op multiplies by the same input (htp_gemm_params.n_more + 1)
GEMM_MAX_MATRICES = 3


def gemm_shared(
    x: F32 | Q8Rows,
    mats: Sequence[tuple[Any, int]],
    fmt: str = "q4_0-t32r4",
    outs: Sequence[F32 | None] | None = None,
    *,
    act: str | None = None,
    backend: Backend | None = None,
) -> list[F32]:
    """``Y_i[T, N_i] = X[T, K] · W_iᵀ`` for up to three matrices ``(W_i, N_i)`` of one tile
    format that share the input (q/k/v, gate/up): one op, ``X`` quantized once, each ``Y_i``
    bit-identical to `gemm` of its matrix alone. ``x`` may be `Q8Rows` with ``act="q8"``."""
    be = _be(backend)
    rows = isinstance(x, Q8Rows)
    if rows:
        t, k = x.t, x.d
        if _act(act, be) != "q8":
            raise HTPInputError("x given as Q8Rows needs act='q8' (quantized products)")
    else:
        x = _arr(x, "x", np.float32, 2)
        t, k = x.shape
    if fmt not in TILE_FORMATS:
        raise HTPInputError(f"fmt must be one of {sorted(TILE_FORMATS)}, got {fmt!r}")
    if rows and fmt in FLOAT_TILE_FORMATS:
        raise HTPInputError(
            f"{fmt} matrices are multiplied in fp32: pass x as float32, not as Q8Rows"
        )
    if k == 0 or k % 32:
        raise HTPInputError(f"x.shape[1] (K) must be a positive multiple of 32, got {k}")
    if not 1 <= len(mats) <= GEMM_MAX_MATRICES:
        raise HTPInputError(f"one GEMM takes 1 to {GEMM_MAX_MATRICES} matrices, got {len(mats)}")
    if outs is not None and len(outs) != len(mats):
        raise HTPInputError(f"{len(mats)} matrices but {len(outs)} outputs")
    ws: list[np.ndarray] = []
    ns: list[int] = []
    ys: list[F32] = []
    for i, (w, n) in enumerate(mats):
        name = "w" if len(mats) == 1 else f"w[{i}]"
        n = _u32(n, "n" if len(mats) == 1 else f"n[{i}]", 1)
        wb = _bytes(w, name)
        need = matrix_nbytes(fmt, n, k)
        if wb.size < need:
            raise HTPInputError(f"{name} holds {wb.size} bytes but {fmt} W[{n}][{k}] needs {need}")
        ws.append(wb[:need])
        ns.append(n)
        oname = "out" if len(mats) == 1 else f"outs[{i}]"
        ys.append(_out(None if outs is None else outs[i], (t, n), oname))
    if t:
        c = be.call(lib.HTP_OP_GEMM, _act(act, be))
        c.what = "gemm"
        p = c.p.gemm
        p.format, p.n, p.k, p.t, p.ldx, p.ldy = _FMT[fmt], ns[0], k, t, k, ns[0]
        p.n_more = len(mats) - 1
        if len(mats) > 1:
            p.n_b = ns[1]
        if len(mats) > 2:
            p.n_c = ns[2]
        p.x_q8 = int(rows)
        c.ref(ws[0]).ref(x.data if rows else x).ref(ys[0], "w")
        for wb, y in zip(ws[1:], ys[1:], strict=True):
            c.ref(wb).ref(y, "w")
        be.run(c)
    return ys


# ---------------------------------------------------------------- shared Q8 rows
class Q8Rows:
    """``t`` rows of an fp32 ``x[t, d]`` quantized once by `quantize_q8`, as the Q8 GEMM and
    expert op quantize them (per 32-element block: int8 values, an fp32 scale, the int32 sum),
    for several ops on the same input (`ExpertGraph.run`, `gemm`, `gemm_shared`): the groups
    of a streamed layer, the shared experts beside the routed ones. ``data`` holds
    ``t * (d + d // 4)`` bytes: ``[t][d]`` int8, ``[t][d/32]`` fp32, ``[t][d/32]`` int32."""

    __slots__ = ("d", "data", "t")

    def __init__(
        self,
        t: int,
        d: int,
        *,
        backend: Backend | None = None,
        data: npt.NDArray[np.uint8] | None = None,
    ) -> None:
        """New rows, in memory of their own (shared memory on an executor backend, so that
        queued ops read it in place), or over ``data``: a caller's C-contiguous uint8 buffer of
        exactly `q8_rows_nbytes` bytes (e.g. from an activation pool)."""
        self.t, self.d = _u32(t, "t"), _u32(d, "d", 1)
        if self.d % 32:
            raise HTPInputError(f"d must be a multiple of 32, got {d}")
        n = q8_rows_nbytes(self.t, self.d)
        if data is not None:
            data = _arr(data, "data", np.uint8, 1)
            if data.size != n or not data.flags.writeable:
                raise HTPInputError(f"data must be {n} writeable bytes, got {data.size}")
            self.data = data
            return
        be = _be(backend)
        self.data = np.empty(n, np.uint8) if be.kind == "host" else be.empty(n, np.uint8)

    @property
    def shape(self) -> tuple[int, int]:
        """``(t, d)``: the shape of the fp32 input these rows quantize."""
        return self.t, self.d

    def parts(self) -> tuple[npt.NDArray[np.int8], F32, I32]:
        """Views of the values ``[t, d]``, scales ``[t, d/32]`` and block sums ``[t, d/32]``."""
        t, d, db = self.t, self.d, self.d // 32
        q = self.data[: t * d].view(np.int8).reshape(t, d)
        sc = self.data[t * d : t * d + t * db * 4].view(np.float32).reshape(t, db)
        sm = self.data[t * d + t * db * 4 :].view(np.int32).reshape(t, db)
        return q, sc, sm


def q8_rows_nbytes(t: int, d: int) -> int:
    """Bytes of `Q8Rows` for ``t`` rows of ``d`` values."""
    return int(t) * (int(d) + int(d) // 4)


def quantize_q8(x: F32, out: Q8Rows | None = None, *, backend: Backend | None = None) -> Q8Rows:
    """``x[t, d]`` (``d`` a multiple of 32) quantized once into `Q8Rows` (``out`` when given:
    the same ``t`` and ``d``, reused between layers), for `ExpertGraph.run`, `gemm` and
    `gemm_shared` with ``act="q8"``."""
    x = _arr(x, "x", np.float32, 2)
    t, d = x.shape
    if d == 0 or d % 32:
        raise HTPInputError(f"x.shape[1] must be a positive multiple of 32, got {d}")
    be = _be(backend)
    if out is None:
        out = Q8Rows(t, d, backend=be)
    elif not isinstance(out, Q8Rows):
        raise HTPInputError(f"out must be a Q8Rows, got {type(out).__name__}")
    elif (out.t, out.d) != (t, d):
        raise HTPInputError(f"out holds {out.t} rows of {out.d}, x is {t} x {d}")
    if t:
        c = be.call(lib.HTP_OP_QUANTIZE)
        c.what = "quantize_q8"
        c.p.quantize.t, c.p.quantize.d = t, d
        c.ref(x).ref(out.data, "w")
        be.run(c)
    return out


# ---------------------------------------------------------------- expert op
EXPERT_FORMATS = (
    "q4_0-t32r4", "q8_0-t32r4", "q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "mxfp4-t32r4",
    "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4", "iq4_xs-t32r4",
)  # fmt: skip


def _expert_formats(formats: str | Sequence[str]) -> tuple[str, str, str]:
    fs = (formats,) * 3 if isinstance(formats, str) else tuple(formats)
    if len(fs) != 3 or any(f not in EXPERT_FORMATS for f in fs):
        raise HTPInputError(
            f"formats must be one tile format or 3 (gate, up, down), each one of "
            f"{list(EXPERT_FORMATS)}, got {formats!r}"
        )
    return fs  # type: ignore[return-value]


#: The expert op's gated activations (htp.h's htp_glu): name -> code.
GLU_KINDS = {"swiglu": 0, "reglu": 1, "swiglu_oai": 2}


def _oai_params(alpha: object, limit: object) -> tuple[float, float]:
    """SwiGLU-OAI's ``alpha`` and ``limit`` as floats, both finite and > 0."""
    try:
        a, lim = float(alpha), float(limit)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        a = lim = float("nan")
    if not (0 < a < float("inf") and 0 < lim < float("inf")):
        raise HTPInputError(
            f"swiglu_oai needs alpha and limit finite and > 0, got {alpha!r}, {limit!r}"
        )
    return a, lim


class ExpertGraph:
    """The fused routed-expert op for ``d_model``/``d_ff``, cut into passes of ``capacity``
    routes, accepting up to ``t_max`` tokens, on a backend (default: the default backend).
    ``formats``: the tile format of every projection, or of gate, up and down each (a file may
    store an expert's projections in different types). ``glu``: the gated activation of gate g
    and up u — "swiglu" ``silu(g)·u``, "reglu" ``max(g, 0)·u`` or "swiglu_oai" (gpt-oss:
    ``g'·sigmoid(alpha·g')·(u' + 1)``, ``g' = min(g, limit)``, ``u' = clamp(u, ±limit)``).
    The working buffers live in the backend and are reused for every expert and layer."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        capacity: int,
        t_max: int,
        *,
        backend: Backend | None = None,
        formats: str | Sequence[str] = "q4_0-t32r4",
        glu: str = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        if glu not in GLU_KINDS:
            raise HTPInputError(f"glu must be one of {list(GLU_KINDS)}, got {glu!r}")
        self.glu = glu
        self.alpha, self.limit = _oai_params(alpha, limit) if glu == "swiglu_oai" else (0.0, 0.0)
        for v, nm in ((d_model, "d_model"), (d_ff, "d_ff")):
            if _u32(v, nm, 1) % 32:
                raise HTPInputError(f"{nm} must be a multiple of 32, got {v}")
        self.d_model, self.d_ff = int(d_model), int(d_ff)
        self.capacity, self.t_max = _u32(capacity, "capacity", 1), _u32(t_max, "t_max", 1)
        self.formats = _expert_formats(formats)
        self.backend = _be(backend)
        self._closed = False
        self._need = self._needs(self.formats)

    def _needs(self, fmts: tuple[str, str, str]) -> tuple[int, int, int]:
        """Bytes of one expert's gate, up and down in the tile formats ``fmts``."""
        return (
            matrix_nbytes(fmts[0], self.d_ff, self.d_model),
            matrix_nbytes(fmts[1], self.d_ff, self.d_model),
            matrix_nbytes(fmts[2], self.d_model, self.d_ff),
        )

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> ExpertGraph:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A Ctrl-C landing while the interpreter collects the graph at exit must not print an
        # "Exception ignored in __del__" traceback; the memory is freed either way.
        with contextlib.suppress(BaseException):
            self.close()

    def run(
        self,
        x: F32 | Q8Rows,
        tokens: I32,
        experts: I32,
        weights: F32,
        slot_of_expert: I32,
        planes: Sequence[int],
        strides: Sequence[int],
        y: F32,
        *,
        act: str | None = None,
        formats: str | Sequence[str] | None = None,
        biases: F32 | None = None,
    ) -> None:
        """``y[t] += w · down(silu(gate(x[t])) * up(x[t]))`` for every route ``(t, e, w)``
        (with the graph's ``glu`` in place of SwiGLU).

        ``planes``: addresses (in this process) of slot 0 of the gate/up/down planes, inside
        memory registered with the backend (host backends also take unregistered memory);
        ``strides``: bytes between slots of each plane; expert ``e`` lives in slot
        ``slot_of_expert[e]``. ``x`` may be `Q8Rows` (`quantize_q8`) with ``act="q8"``: the
        same bits as from the fp32 rows, quantized once for every op on that input.
        ``formats`` (default: the graph's) gives this call's tile formats: one layer's experts
        may be stored in other types than another's. ``biases``: the experts' f32 bias rows
        as one array (`expert_biases`) for the ``E = len(slot_of_expert)`` experts: expert
        ``e``'s gate and up rows are added to its projections before the activation, its down
        row to its output before the weighting."""
        c = self._call(
            x, tokens, experts, weights, slot_of_expert, planes, strides, y, act, formats, biases
        )
        if c is not None:
            self.backend.run(c)

    def submit(
        self,
        x: F32 | Q8Rows,
        tokens: I32,
        experts: I32,
        weights: F32,
        slot_of_expert: I32,
        planes: Sequence[int],
        strides: Sequence[int],
        y: F32,
        *,
        act: str | None = None,
        formats: str | Sequence[str] | None = None,
        biases: F32 | None = None,
    ) -> Fence | None:
        """As `run`, but returns the op's completion fence at once (None if nothing is
        routed). The operands must stay untouched until the fence completes; ``y`` must be in
        registered memory (`Backend.empty`) on a host-process backend so that ops queued one
        after another accumulate into the same array."""
        c = self._call(
            x, tokens, experts, weights, slot_of_expert, planes, strides, y, act, formats, biases
        )
        if c is None:
            return None
        if (
            self.backend.kind != "host"
            and self.backend._resolve(int(y.ctypes.data), y.nbytes) is None
        ):
            raise HTPInputError(
                "ExpertGraph.submit on a host-process backend needs y in shared memory "
                "(allocate it with Backend.empty)"
            )
        return self.backend.submit(c)

    def _call(
        self,
        x: F32 | Q8Rows,
        tokens: I32,
        experts: I32,
        weights: F32,
        slot_of_expert: I32,
        planes: Sequence[int],
        strides: Sequence[int],
        y: F32,
        act: str | None,
        formats: str | Sequence[str] | None = None,
        biases: F32 | None = None,
    ) -> Any:
        # long: the expert op's validator, one check per operand, then its descriptor
        if self._closed:
            raise HTPInputError("ExpertGraph is closed")
        rows = isinstance(x, Q8Rows)
        if rows:
            t, d = x.t, x.d
            if _act(act, self.backend) != "q8":
                raise HTPInputError("x given as Q8Rows needs act='q8' (quantized products)")
        else:
            x = _arr(x, "x", np.float32, 2)
            t, d = x.shape
        if d != self.d_model:
            raise HTPInputError(f"x.shape[1] must be d_model={self.d_model}, got {d}")
        if t > self.t_max:
            raise CapacityError(f"x has {t} tokens but the graph was sized for t_max={self.t_max}")
        tokens = _arr(tokens, "tokens", np.int32, 1)
        experts = _arr(experts, "experts", np.int32, 1)
        weights = _arr(weights, "weights", np.float32, 1)
        slot_of_expert = _arr(slot_of_expert, "slot_of_expert", np.int32, 1)
        r = tokens.shape[0]
        if experts.shape != (r,) or weights.shape != (r,):
            raise HTPInputError(
                f"tokens, experts, weights must have the same length, got {r}, {experts.shape[0]}, {weights.shape[0]}"
            )
        y = _arr(y, "y", np.float32, 2)
        if y.shape != (t, d):
            raise HTPInputError(f"y must have shape {(t, d)}, got {y.shape}")
        if not y.flags.writeable:
            raise HTPInputError("y must be writeable")
        e = slot_of_expert.shape[0]
        if biases is not None:
            biases = _arr(biases, "biases", np.float32, 1)
            nb = e * (2 * self.d_ff + self.d_model)
            if biases.shape[0] != nb:
                raise HTPInputError(
                    f"biases must hold the gate, up and down rows of {e} experts "
                    f"({nb} floats, see expert_biases), got {biases.shape[0]}"
                )
        if r:
            if tokens.min() < 0 or tokens.max() >= t:
                raise HTPInputError(
                    f"tokens must be in [0, {t}), got range [{tokens.min()}, {tokens.max()}]"
                )
            if experts.min() < 0 or experts.max() >= e:
                raise HTPInputError(
                    f"experts must be in [0, {e}), got range [{experts.min()}, {experts.max()}]"
                )
            routed_slots = slot_of_expert[experts]
            missing = experts[routed_slots < 0]
            if missing.size:
                raise ExpertNotResidentError(
                    f"expert {int(missing[0])} is routed but not resident (slot_of_expert = -1)"
                )
        if r == 0:
            return None  # nothing routed: y is left as it is
        if len(planes) != 3 or len(strides) != 3:
            raise HTPInputError("planes and strides must each hold 3 ints (gate, up, down)")
        planes_i = [int(p) for p in planes]
        strides_i = [int(s) for s in strides]
        if any(p <= 0 for p in planes_i) or any(s < 0 for s in strides_i):
            raise HTPInputError(
                f"plane addresses must be > 0 and strides >= 0, got {planes_i}, {strides_i}"
            )
        max_slot = int(routed_slots.max())
        be = self.backend
        c = be.call(lib.HTP_OP_EXPERT, _act(act, be))
        c.what = "ExpertGraph.run"
        p = c.p.expert
        p.d_model, p.d_ff, p.n_tokens, p.n_routes, p.n_experts = d, self.d_ff, t, r, e
        fmts = self.formats if formats is None else _expert_formats(formats)
        need = self._need if formats is None else self._needs(fmts)
        p.capacity, p.format = self.capacity, _FMT[fmts[0]]
        p.format_up, p.format_down = _FMT[fmts[1]], _FMT[fmts[2]]
        p.x_q8 = int(rows)
        p.slot_stride = strides_i
        p.glu, p.glu_alpha, p.glu_limit = GLU_KINDS[self.glu], self.alpha, self.limit
        c.ref(x.data if rows else x).ref(tokens).ref(experts).ref(weights).ref(slot_of_expert)
        for j in range(3):
            c.ref_address(planes_i[j], max_slot * strides_i[j] + need[j])
        c.ref(y, "rw")
        if biases is not None:  # gate [E][ff], then up [E][ff], then down [E][d]
            p.has_bias, p.bias_up, p.bias_down = 1, 4 * e * self.d_ff, 8 * e * self.d_ff
            c.ref(biases)
        return c


def expert_biases(
    gate: F32, up: F32, down: F32, *, backend: Backend | None = None
) -> npt.NDArray[np.float32]:
    """The experts' f32 bias rows (``gate``, ``up`` ``[E, d_ff]``, ``down`` ``[E, d_model]``)
    as the one array `ExpertGraph.run` takes as ``biases``: in the backend's shared memory on
    an executor backend, so that no op copies them."""
    g = _arr(np.ascontiguousarray(gate, np.float32), "gate", np.float32, 2)
    u = _arr(np.ascontiguousarray(up, np.float32), "up", np.float32, 2)
    d = _arr(np.ascontiguousarray(down, np.float32), "down", np.float32, 2)
    if u.shape != g.shape or d.shape[0] != g.shape[0]:
        raise HTPInputError(
            f"gate and up must be [E, d_ff] and down [E, d_model] with one E, got "
            f"{g.shape}, {u.shape}, {d.shape}"
        )
    be = _be(backend)
    n = g.size + u.size + d.size
    out = np.empty(n, np.float32) if be.kind == "host" else be.empty((n,), np.float32)
    out[: g.size], out[g.size : 2 * g.size], out[2 * g.size :] = g.ravel(), u.ravel(), d.ravel()
    return out


def moe_ffn(
    x: F32,
    gate: npt.NDArray[np.uint8],
    up: npt.NDArray[np.uint8],
    down: npt.NDArray[np.uint8],
    topk_ids: I32,
    topk_weights: F32,
    ff: int | None = None,
    *,
    act: str | None = None,
    backend: Backend | None = None,
    formats: str | Sequence[str] = "q4_0-t32r4",
    glu: str = "swiglu",
    biases: tuple[F32, F32, F32] | None = None,
) -> F32:
    """Routed SwiGLU experts over packed tile-format byte arrays ``[E, nbytes]`` (``formats``:
    one for all three projections, or gate's, up's and down's); ``glu`` another activation
    (`ExpertGraph`), ``biases`` the experts' gate, up and down bias rows.

    Returns ``Y[T, d] = Σ_k w[t,k] · down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = topk_ids[t, k]``. ``ff`` is inferred from the gate byte count when not given."""
    fmts = _expert_formats(formats)
    x = _arr(x, "x", np.float32, 2)
    t, d = x.shape
    if d == 0 or d % 32:
        raise HTPInputError(f"x.shape[1] (d_model) must be a positive multiple of 32, got {d}")
    planes = []
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        p = _arr(p, name, np.uint8, 2)
        planes.append(p)
    e = planes[0].shape[0]
    if any(p.shape[0] != e for p in planes):
        raise HTPInputError(
            f"gate, up, down must have the same number of experts, got {[p.shape[0] for p in planes]}"
        )
    row_bytes = (d // 32) * TILE_FORMATS[fmts[0]]
    if ff is None:
        ff = (planes[0].shape[1] // row_bytes) * 32
        if ff == 0:
            raise HTPInputError(
                f"gate rows hold {planes[0].shape[1]} bytes, less than one tile row ({row_bytes})"
            )
    ff = _u32(ff, "ff", 1)
    if ff % 32:
        raise HTPInputError(f"ff must be a multiple of 32, got {ff}")
    need = [matrix_nbytes(fmts[0], ff, d), matrix_nbytes(fmts[1], ff, d)]
    need.append(matrix_nbytes(fmts[2], d, ff))
    for name, p, nb in zip(("gate", "up", "down"), planes, need):
        if p.shape[1] < nb:
            raise HTPInputError(
                f"{name} rows hold {p.shape[1]} bytes, need {nb} for d={d}, ff={ff}"
            )
    topk_ids = _arr(topk_ids, "topk_ids", np.int32, 2)
    topk_weights = _arr(topk_weights, "topk_weights", np.float32, 2)
    if topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise HTPInputError(
            f"topk_ids and topk_weights must both be [T={t}, k], got {topk_ids.shape}, {topk_weights.shape}"
        )
    be = _be(backend)
    y = np.zeros((t, d), dtype=np.float32)
    k = topk_ids.shape[1]
    if t == 0 or k == 0 or e == 0:
        return y
    tokens = np.repeat(np.arange(t, dtype=np.int32), k)
    shared = [be.share(p) for p in planes] if be.kind != "host" else planes
    bias = None if biases is None else expert_biases(*biases, backend=be)
    if bias is not None and bias.size != e * (2 * ff + d):
        raise HTPInputError(f"biases must be [E={e}, ff={ff}] twice and [E, d={d}]")
    with ExpertGraph(
        d, ff, capacity=min(t * k, 8192), t_max=t, backend=be, formats=fmts, glu=glu
    ) as g:
        g.run(
            x,
            tokens,
            np.ascontiguousarray(topk_ids.reshape(-1)),
            np.ascontiguousarray(topk_weights.reshape(-1)),
            np.arange(e, dtype=np.int32),
            [p.ctypes.data for p in shared],
            [p.strides[0] for p in shared],
            y,
            act=act,
            biases=bias,
        )
    return y


# ---------------------------------------------------------------- small ops
def rms_norm(
    x: F32, w: F32 | None, eps: float, out: F32 | None = None, *, backend: Backend | None = None
) -> F32:
    """``x / sqrt(mean(x²) + eps) * w`` over the last axis of ``x[T, D]``."""
    x = _arr(x, "x", np.float32, 2)
    t, dd = x.shape
    return _rms(x, w, eps, out, t, 1, dd, "rms_norm", backend)


def rms_norm_heads(
    x: F32,
    w: F32,
    n_heads: int,
    eps: float,
    out: F32 | None = None,
    *,
    backend: Backend | None = None,
) -> F32:
    """Per-head RMSNorm of ``x[T, H*Dh]`` with a shared ``w[Dh]`` (qwen3 q/k-norm)."""
    x = _arr(x, "x", np.float32, 2)
    h = _u32(n_heads, "n_heads", 1)
    t, width = x.shape
    if width % h:
        raise HTPInputError(f"x.shape[1]={width} is not a multiple of n_heads={h}")
    return _rms(x, w, eps, out, t, h, width // h, "rms_norm_heads", backend)


def _rms(
    x: F32,
    w: F32 | None,
    eps: float,
    out: F32 | None,
    t: int,
    h: int,
    dh: int,
    what: str,
    backend: Backend | None,
) -> F32:
    if w is not None:
        w = _arr(w, "w", np.float32, 1)
        if w.shape[0] != dh:
            raise HTPInputError(f"w must have shape ({dh},), got {w.shape}")
    if not (isinstance(eps, (float, int)) and eps >= 0):
        raise HTPInputError(f"eps must be a float >= 0, got {eps!r}")
    if dh == 0:
        raise HTPInputError("rows must not be empty")
    o = _out(out, x.shape)
    if t:
        be = _be(backend)
        c = be.call(lib.HTP_OP_RMS_NORM)
        c.what = what
        p = c.p.rms_norm
        p.t, p.n_groups, p.d, p.has_weight, p.eps = t, h, dh, int(w is not None), float(eps)
        c.ref(x)
        if w is not None:
            c.ref(w)
        c.ref(o, "w")
        be.run(c)
    return o


def rope(
    x: F32,
    positions: I32,
    n_rot: int,
    freq_base: float,
    freq_scale: float,
    mode: Literal["normal", "neox"],
    *,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    corr_dims: tuple[float, float] = (0.0, 0.0),
    backend: Backend | None = None,
) -> None:
    """Rotary embedding, in place, of the first ``n_rot`` dims of each head of ``x[T, H, Dh]``.

    "normal" rotates pairs (2i, 2i+1), "neox" pairs (i, i + n_rot/2); angle
    ``pos * freq_scale * freq_base^(-2i/n_rot)``. YaRN (llama.cpp's ``ggml_rope_ext``), for
    models stretched past their training context: with ``ext_factor`` ≠ 0, pair ``i`` mixes the
    scaled and unscaled angle by ``ramp(i) * ext_factor`` where ``ramp`` falls from 1 to 0 over
    ``corr_dims`` (see `rope_yarn_corr_dims`), and cos/sin are multiplied by ``attn_factor``
    (times ``1 + 0.1 ln(1/freq_scale)`` when ``ext_factor`` ≠ 0)."""
    x = _arr(x, "x", np.float32, 3)
    if not x.flags.writeable:
        raise HTPInputError("x must be writeable (rope works in place)")
    t, h, dh = x.shape
    positions = _arr(positions, "positions", np.int32, 1)
    if positions.shape[0] != t:
        raise HTPInputError(f"positions must have shape ({t},), got {positions.shape}")
    n_rot = _u32(n_rot, "n_rot")
    if n_rot > dh or n_rot % 2:
        raise HTPInputError(f"n_rot must be even and <= head dim {dh}, got {n_rot}")
    if mode not in ("normal", "neox"):
        raise HTPInputError(f"mode must be 'normal' or 'neox', got {mode!r}")
    if not freq_base > 0:
        raise HTPInputError(f"freq_base must be > 0, got {freq_base}")
    low, high = (float(c) for c in corr_dims)
    yarn = ext_factor != 0.0 or attn_factor != 1.0
    if yarn:
        if not (math.isfinite(freq_scale) and freq_scale > 0):
            raise HTPInputError(f"YaRN needs freq_scale > 0, got {freq_scale}")
        for name, v in (("ext_factor", ext_factor), ("attn_factor", attn_factor),
                        ("corr_dims[0]", low), ("corr_dims[1]", high)):  # fmt: skip
            if not math.isfinite(v):
                raise HTPInputError(f"{name} must be finite, got {v}")
    if t and h and n_rot:
        be = _be(backend)
        c = be.call(lib.HTP_OP_ROPE)
        c.what = "rope"
        p = c.p.rope
        p.t, p.n_heads, p.head_dim, p.n_rot = t, h, dh, n_rot
        p.mode = lib.HTP_ROPE_NORMAL if mode == "normal" else lib.HTP_ROPE_NEOX
        p.freq_base, p.freq_scale = float(freq_base), float(freq_scale)
        if yarn:
            p.yarn, p.ext_factor, p.attn_factor = 1, float(ext_factor), float(attn_factor)
            p.corr_low, p.corr_high = low, high
        c.ref(x, "rw").ref(positions)
        be.run(c)


def rope_yarn_corr_dims(
    n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[float, float]:
    """YaRN's ramp limits for `rope` (ggml's ``ggml_rope_yarn_corr_dims``): the pair indices
    whose wavelength spans ``n_ctx_orig / beta_fast`` and ``n_ctx_orig / beta_slow`` tokens,
    floored / ceiled and clamped to ``[0, n_rot - 1]``."""
    if n_rot < 2 or n_ctx_orig < 1 or not freq_base > 1:
        raise HTPInputError(
            f"YaRN needs n_rot >= 2, n_ctx_orig >= 1, freq_base > 1; got {n_rot}, "
            f"{n_ctx_orig}, {freq_base}"
        )

    def dim(beta: float) -> float:
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(freq_base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


_PRODUCTS = {
    "f32": lib.HTP_PRODUCTS_F32,
    "bf16": lib.HTP_PRODUCTS_BF16,
    "bf16-pv": lib.HTP_PRODUCTS_BF16_PV,
}


def round_bf16(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``x`` (as float32) rounded to bfloat16 values the way the bf16 attention kernels round:
    nearest even, subnormals to signed zero (``vcvtneps2bf16``); returned as float32."""
    u = np.array(x, dtype=np.float32, copy=True).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    r = np.where((u & np.uint32(0x7F800000)) == 0, u & np.uint32(0x80000000), r)
    return r.astype(np.uint32).view(np.float32)


def attention(
    q: F32,
    k: F32,
    v: F32,
    scale: float,
    causal: bool = True,
    out: F32 | None = None,
    *,
    products: str = "f32",
    context: int = 0,
    window: int = 0,
    sinks: F32 | None = None,
    backend: Backend | None = None,
) -> F32:
    """Softmax attention with grouped KV heads (query head ``h`` reads KV head
    ``h // (Hq // Hkv)``), tiled with an online softmax: memory O(T·d).

    ``context``: ``k, v`` hold ``context + T`` rows and query ``i`` sits at key position
    ``context + i``: causal attention sees every context row and then its own rows up to
    itself (a segment continuing a prefix, e.g. a branch); 0 is plain self-attention.

    ``window`` (causal only): 0 sees every earlier key; ``W > 0`` lets the query at key
    position ``p`` see only keys ``p - W < j <= p`` (sliding-window attention).

    ``sinks``: ``None`` or ``[Hq]`` float32 logits, one per query head, that join every row's
    softmax denominator as an extra key whose value is zero (attention sinks).

    ``products``: "f32" (fp32 products, matches float64 to ~1e-6), "bf16" (``q·scale``,
    ``k``, ``v`` and the softmax weights rounded to bfloat16, fp32 sums: twice the
    multiply rate on CPUs with AVX512_BF16, emulated elsewhere; rel. L2 error ~3e-3) or
    "bf16-pv" (the scores ``q·scale·k`` in fp32; the softmax weights and ``v`` rounded to
    bfloat16 for their product, at the bf16 rate where "bf16" has it; rel. L2 error ~2e-3,
    most of it from ``v``'s rounding, which averages out over the keys)."""
    if products not in _PRODUCTS:
        raise HTPInputError(f"products must be one of {sorted(_PRODUCTS)}, got {products!r}")
    q = _arr(q, "q", np.float32, 3)
    k = _arr(k, "k", np.float32, 3)
    v = _arr(v, "v", np.float32, 3)
    t, hq, dk = q.shape
    context = _u32(context, "context")
    tk = t + context
    if k.shape[0] != tk or v.shape[0] != tk or k.shape[1] != v.shape[1]:
        raise HTPInputError(
            f"k, v must be [context + T = {context} + {t}, Hkv, D], got {k.shape}, {v.shape}"
        )
    if tk >= _U32:
        raise HTPInputError(f"context + T must be < 2**32, got {tk}")
    hkv = k.shape[1]
    if k.shape[2] != dk:
        raise HTPInputError(f"k head dim {k.shape[2]} != q head dim {dk}")
    if hkv == 0 or hq % hkv:
        raise HTPInputError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    dv = v.shape[2]
    if dk == 0 or dv == 0:
        raise HTPInputError("head dims must be > 0")
    window = _u32(window, "window")
    if window and not causal:
        raise HTPInputError("window needs causal attention")
    if sinks is not None:
        sinks = _arr(sinks, "sinks", np.float32, 1)
        if sinks.shape != (hq,):
            raise HTPInputError(f"sinks must be [Hq = {hq}], got {sinks.shape}")
        if not np.all(np.isfinite(sinks)):
            raise HTPInputError("sinks must be finite")
    o = _out(out, (t, hq, dv))
    if t and hq:
        be = _be(backend)
        c = be.call(lib.HTP_OP_ATTENTION)
        c.what = "attention"
        p = c.p.attention
        p.t, p.n_q_heads, p.n_kv_heads, p.dk, p.dv = t, hq, hkv, dk, dv
        p.causal, p.scale = 1 if causal else 0, float(scale)
        p.products, p.n_ctx = _PRODUCTS[products], context
        p.window, p.has_sinks = window, 0 if sinks is None else 1
        c.ref(q).ref(k).ref(v)
        if sinks is not None:
            c.ref(sinks)
        c.ref(o, "w")
        be.run(c)
    return o


def silu(x: F32, out: F32 | None = None, *, backend: Backend | None = None) -> F32:
    """``x * sigmoid(x)`` element-wise."""
    x = _arr(x, "x", np.float32)
    o = _out(out, x.shape)
    if x.size:
        be = _be(backend)
        c = be.call(lib.HTP_OP_SILU)
        c.what = "silu"
        c.p.eltwise.n = x.size
        c.ref(x).ref(o, "w")
        be.run(c)
    return o


def matmul_f32(x: F32, w: F32, out: F32 | None = None, *, backend: Backend | None = None) -> F32:
    """``x[T, K] @ w[K, N]`` in fp32, each output summed over K in order (the router's logits,
    f32 projections, on any backend)."""
    x = _arr(x, "x", np.float32, 2)
    w = _arr(w, "w", np.float32, 2)
    t, k = x.shape
    if w.shape[0] != k or k == 0 or w.shape[1] == 0:
        raise HTPInputError(f"w must be [K={k}, N] with K, N > 0, got {w.shape}")
    n = w.shape[1]
    o = _out(out, (t, n))
    if t:
        be = _be(backend)
        c = be.call(lib.HTP_OP_MATMUL_F32)
        c.what = "matmul_f32"
        c.p.matmul.t, c.p.matmul.k, c.p.matmul.n = t, _u32(k, "k"), _u32(n, "n")
        c.ref(x).ref(w).ref(o, "w")
        be.run(c)
    return o


def _glu(
    g: F32, u: F32, out: F32 | None, backend: Backend | None, glu: str, alpha: float, limit: float
) -> F32:
    """HTP_OP_SWIGLU with activation ``glu`` (`GLU_KINDS`: "swiglu" or "swiglu_oai")."""
    g = _arr(g, "g", np.float32)
    u = _arr(u, "u", np.float32)
    if g.shape != u.shape:
        raise HTPInputError(f"g and u must have the same shape, got {g.shape}, {u.shape}")
    o = _out(out, g.shape)
    if g.size:
        be = _be(backend)
        c = be.call(lib.HTP_OP_SWIGLU)
        c.what = glu
        c.p.eltwise.n = g.size
        c.p.eltwise.glu = GLU_KINDS[glu]
        c.p.eltwise.alpha, c.p.eltwise.limit = alpha, limit
        c.ref(g).ref(u).ref(o, "w")
        be.run(c)
    return o


def swiglu(g: F32, u: F32, out: F32 | None = None, *, backend: Backend | None = None) -> F32:
    """``silu(g) * u`` element-wise."""
    return _glu(g, u, out, backend, "swiglu", 0.0, 0.0)


def swiglu_oai(
    g: F32,
    u: F32,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: F32 | None = None,
    *,
    backend: Backend | None = None,
) -> F32:
    """gpt-oss's clamped SwiGLU element-wise: ``g' * sigmoid(alpha * g') * (u' + 1)`` with
    ``g' = min(g, limit)`` and ``u' = clamp(u, -limit, limit)`` (the expert op's "swiglu_oai";
    a NaN input gives NaN)."""
    a, lim = _oai_params(alpha, limit)
    return _glu(g, u, out, backend, "swiglu_oai", a, lim)


def router_topk(
    logits: F32,
    k: int,
    gating: Literal["softmax", "sigmoid"] = "softmax",
    norm: bool = False,
    scale: float = 1.0,
    bias: F32 | None = None,
    out: tuple[I32, F32] | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[I32, F32]:
    """Top-k routing. softmax: ``p = softmax(logits)``, top-k of ``p`` (ties → lower id),
    ``w = p[top]``; sigmoid: ``p = sigmoid(logits)``, top-k of ``p + bias``, ``w = p[top]``.
    Then ``w /= sum(w)`` if ``norm``, and ``w *= scale``. ``out``: (ids i32[T, k],
    weights f32[T, k]) to write into."""
    logits = _arr(logits, "logits", np.float32, 2)
    t, e = logits.shape
    k = _u32(k, "k", 1)
    if k > e:
        raise HTPInputError(f"k={k} exceeds the number of experts {e}")
    if gating not in ("softmax", "sigmoid"):
        raise HTPInputError(f"gating must be 'softmax' or 'sigmoid', got {gating!r}")
    if bias is not None:
        bias = _arr(bias, "bias", np.float32, 1)
        if bias.shape[0] != e:
            raise HTPInputError(f"bias must have shape ({e},), got {bias.shape}")
    if out is None:
        ids = np.empty((t, k), dtype=np.int32)
        w = np.empty((t, k), dtype=np.float32)
    else:
        ids = _arr(out[0], "out[0] (ids)", np.int32, 2)
        w = _out(out[1], (t, k), "out[1] (weights)")
        if ids.shape != (t, k) or not ids.flags.writeable:
            raise HTPInputError(f"out[0] (ids) must be a writeable [{t}, {k}], got {ids.shape}")
    if t:
        be = _be(backend)
        c = be.call(lib.HTP_OP_ROUTER_TOPK)
        c.what = "router_topk"
        p = c.p.router
        p.t, p.n_experts, p.k = t, e, k
        p.gating = lib.HTP_GATING_SOFTMAX if gating == "softmax" else lib.HTP_GATING_SIGMOID
        p.norm, p.has_bias, p.scale = int(bool(norm)), int(bias is not None), float(scale)
        c.ref(logits)
        if bias is not None:
            c.ref(bias)
        c.ref(ids, "w").ref(w, "w")
        be.run(c)
    return ids, w


def conv1d_causal(
    x: F32,
    w: F32,
    state: F32 | None = None,
    out: F32 | None = None,
    *,
    backend: Backend | None = None,
) -> F32:
    """Causal depthwise convolution over the token axis of ``x[T, C]`` with ``w[C, L]``:
    ``out[t, c] = sum_j w[c, j] * s[t + j, c]`` where ``s`` is ``state[L-1, C]`` (the rows
    before ``x``; zeros when None) followed by ``x``, so tap ``L-1`` weighs the current token.

    This is llama.cpp's ``ggml_ssm_conv`` over ``concat(conv_state, x)``: LFM2's short
    convolution. ``state`` lets a caller continue a sequence (a branch after a shared prefix)."""
    x = _arr(x, "x", np.float32, 2)
    w = _arr(w, "w", np.float32, 2)
    t, ch = x.shape
    if ch == 0:
        raise HTPInputError("x must have at least one channel")
    if w.shape[0] != ch or w.shape[1] == 0:
        raise HTPInputError(f"w must be [C={ch}, taps >= 1], got {w.shape}")
    taps = w.shape[1]
    _u32(t, "T")
    _u32(ch, "C", 1)
    _u32(taps, "taps", 1)
    if state is not None:
        state = _arr(state, "state", np.float32, 2)
        if state.shape != (taps - 1, ch):
            raise HTPInputError(
                f"state must be [taps-1={taps - 1}, C={ch}] (the rows before x), got {state.shape}"
            )
    o = _out(out, (t, ch))
    if t:
        be = _be(backend)
        c = be.call(lib.HTP_OP_CONV1D)
        c.what = "conv1d_causal"
        p = c.p.conv1d
        p.t, p.channels, p.taps, p.has_state = t, ch, taps, int(state is not None)
        c.ref(x).ref(w)
        if state is not None:
            c.ref(state)
        c.ref(o, "w")
        be.run(c)
    return o


def get_rows(
    table: Any,
    fmt: str,
    n_rows: int,
    n_cols: int,
    ids: I32,
    out: F32 | None = None,
    *,
    backend: Backend | None = None,
) -> F32:
    """Embedding lookup: rows ``ids`` of a ``[n_rows, n_cols]`` table in ``fmt``
    ("q4_0-t32r4", "q8_0-t32r4", "q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "mxfp4-t32r4",
    "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4", "iq4_xs-t32r4", "f16-t32r4",
    "bf16-t32r4", "f16", "f32"), as
    float32 ``[T, n_cols]``."""
    if fmt not in _FMT:
        raise HTPInputError(f"fmt must be one of {sorted(_FMT)}, got {fmt!r}")
    n_rows = _u32(n_rows, "n_rows", 1)
    n_cols = _u32(n_cols, "n_cols", 1)
    tb = _bytes(table, "table")
    if fmt in TILE_FORMATS:
        if n_cols % 32:
            raise HTPInputError(f"n_cols must be a multiple of 32 for {fmt}, got {n_cols}")
        need = matrix_nbytes(fmt, n_rows, n_cols)
    else:
        need = n_rows * n_cols * (2 if fmt == "f16" else 4)
    if tb.size < need:
        raise HTPInputError(
            f"table holds {tb.size} bytes but {fmt} [{n_rows}, {n_cols}] needs {need}"
        )
    ids = _arr(ids, "ids", np.int32, 1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        raise HTPInputError(f"ids must be in [0, {n_rows}), got range [{ids.min()}, {ids.max()}]")
    out = _out(out, (ids.shape[0], n_cols))
    if ids.size:
        be = _be(backend)
        c = be.call(lib.HTP_OP_GET_ROWS)
        c.what = "get_rows"
        p = c.p.get_rows
        p.format, p.n_rows, p.n_cols, p.t = _FMT[fmt], n_rows, n_cols, ids.shape[0]
        c.ref(tb[:need]).ref(ids).ref(out, "w")
        be.run(c)
    return out


# ---------------------------------------------------------------- element-wise, copies, fill
def _rows2d(a: Any, name: str, writeable: bool = False) -> tuple[np.ndarray, int, int, int]:
    """A float32 operand as rows of contiguous elements: (array, rows, cols, row stride in
    elements). C-contiguous arrays of any shape are one run of elements; a 2-D view with
    contiguous rows (``x[:, a:b]``) keeps its row stride."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise HTPInputError(f"{name} must be a numpy float32 array, got {got}")
    if writeable and not a.flags.writeable:
        raise HTPInputError(f"{name} must be writeable")
    if a.flags.c_contiguous:
        n = int(a.size)
        return a, (1 if n else 0), n, n
    if (
        a.ndim == 2
        and a.strides[1] == 4
        and a.strides[0] >= 4 * a.shape[1]
        and a.strides[0] % 4 == 0
    ):
        return a, a.shape[0], a.shape[1], a.strides[0] // 4
    raise HTPInputError(
        f"{name} must be C-contiguous or a 2-D view with contiguous rows (x[:, a:b]), got "
        f"shape {a.shape} strides {a.strides}"
    )


def _span(rows: int, cols: int, ld: int) -> int:
    return 0 if rows == 0 or cols == 0 else ((rows - 1) * ld + cols) * 4


def _binary(opcode: int, what: str, a: Any, b: Any, out: Any, backend: Backend | None) -> F32:
    a, ra, ca, lda = _rows2d(a, "a")
    b, rb, cb, ldb = _rows2d(b, "b")
    if a.shape != b.shape:
        raise HTPInputError(f"a and b must have the same shape, got {a.shape}, {b.shape}")
    if out is None:
        out = np.empty(a.shape, dtype=np.float32)
    o, ro, co, ldo = _rows2d(out, "out", writeable=True)
    if o.shape != a.shape:
        raise HTPInputError(f"out must have shape {a.shape}, got {o.shape}")
    # one row layout for all three: contiguous operands of a strided one take its row shape
    rows, cols = max((ra, ca), (rb, cb), (ro, co), key=lambda rc: rc[0])
    lds = []
    for r, c, ld in ((ra, ca, lda), (rb, cb, ldb), (ro, co, ldo)):
        lds.append(cols if (r, c) != (rows, cols) else ld)
    if a.size:
        be = _be(backend)
        _u32(rows, "rows")
        _u32(cols, "cols")
        c = be.call(opcode)
        c.what = what
        p = c.p.binary
        p.rows, p.cols, p.lda, p.ldb, p.ldo = rows, cols, *lds
        c.ref_span(a, _span(rows, cols, lds[0]))
        c.ref_span(b, _span(rows, cols, lds[1]))
        c.ref_span(o, _span(rows, cols, lds[2]), "w")
        be.run(c)
    return o


def add(a: F32, b: F32, out: F32 | None = None, *, backend: Backend | None = None) -> F32:
    """``a + b`` element-wise in fp32 (residual adds). Operands: C-contiguous, or 2-D views
    with contiguous rows; ``out`` may be ``a`` or ``b`` (in place: the same array and row
    stride), and must not overlap them otherwise (refused)."""
    return _binary(lib.HTP_OP_ADD, "add", a, b, out, backend)


def mul(a: F32, b: F32, out: F32 | None = None, *, backend: Backend | None = None) -> F32:
    """``a * b`` element-wise in fp32 (gates), operands as for `add`."""
    return _binary(lib.HTP_OP_MUL, "mul", a, b, out, backend)


def copy_rows(src: F32, dst: F32, rep: int = 1, *, backend: Backend | None = None) -> F32:
    """``dst[r] = src[r // rep]`` for every row of ``dst`` (``rows(dst) = rep · rows(src)``):
    slices, re-orderings and broadcasts of activations as one op. ``src`` and ``dst`` are
    C-contiguous (one row) or 2-D views with contiguous rows (``x[:, a:b]``), and must not
    overlap. Returns ``dst``."""
    rep = _u32(rep, "rep", 1)
    src, rs, cs, lds = _rows2d(src, "src")
    dst, rd, cd, ldd = _rows2d(dst, "dst", writeable=True)
    if src.flags.c_contiguous and src.ndim == 2:  # contiguous 2-D: its own rows
        rs, cs, lds = src.shape[0], src.shape[1], src.shape[1]
    if dst.flags.c_contiguous and dst.ndim == 2:
        rd, cd, ldd = dst.shape[0], dst.shape[1], dst.shape[1]
    if cs != cd or rd != rs * rep:
        raise HTPInputError(
            f"dst must be [rep · rows(src) = {rep} x {rs}, {cs}], got [{rd}, {cd}] "
            f"(src {src.shape}, dst {dst.shape})"
        )
    if rd and cd:
        be = _be(backend)
        c = be.call(lib.HTP_OP_COPY_ROWS)
        c.what = "copy_rows"
        p = c.p.copy
        p.rows, p.cols, p.ld_src, p.ld_dst, p.rep = (
            _u32(rd, "rows"),
            _u32(cd, "cols"),
            lds,
            ldd,
            rep,
        )
        c.ref_span(src, _span(rs, cs, lds))
        c.ref_span(dst, _span(rd, cd, ldd), "w")
        be.run(c)
    return dst


def fill(out: np.ndarray, value: float = 0.0, *, backend: Backend | None = None) -> np.ndarray:
    """Every element of ``out`` (C-contiguous float32 or int32) set to ``value``."""
    if not isinstance(out, np.ndarray) or out.dtype not in (np.float32, np.int32):
        raise HTPInputError("out must be a numpy float32 or int32 array")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise HTPInputError("out must be C-contiguous and writeable")
    if out.dtype == np.int32 and (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not -(2**31) <= value < 2**31
    ):
        raise HTPInputError(f"value must be an int32 for an int32 array, got {value!r}")
    bits = np.array([value], dtype=out.dtype).view(np.uint32)[0]
    if out.size:
        be = _be(backend)
        c = be.call(lib.HTP_OP_FILL)
        c.what = "fill"
        c.p.fill.n, c.p.fill.value = out.size, int(bits)
        c.ref(out, "w")
        be.run(c)
    return out


def nop(*, backend: Backend | None = None) -> None:
    """An op with no operands: measures the submission round trip of a backend."""
    be = _be(backend)
    c = be.call(lib.HTP_OP_NOP)
    c.what = "nop"
    be.run(c)


def _dot_peak(iters: int = 20_000_000, *, backend: Backend | None = None) -> float:
    """Measured int8 dot-product peak of a host backend's SIMD level on its threads (MAC/s)."""
    be = _be(backend)
    p = ffi.new("double *")
    check(lib.htp_bench_dot_peak(be._handle(), _u32(iters, "iters", 1), p), "dot_peak")
    return float(p[0])


_PEAKS = {"int8": 0, "fp32": 1, "bf16": 2, "int8_step": 3}


def _mac_peak(kind: str, iters: int = 5_000_000, *, backend: Backend | None = None) -> float:
    """Measured multiply-accumulate peak (MAC/s, all of a host backend's threads) of its SIMD
    level's int8 dot product ("int8"), fp32 FMA ("fp32") or bf16 dot product ("bf16"), or of
    the int8 dot product in the Q4_0 / Q8_0 x Q8 kernels' mix with their fp32 step per 32-value
    block ("int8_step": 16 dot products, 2 multiplies, 2 FMAs; its int8 MACs only);
    HTPUnsupportedError where the level/CPU has no such instruction (int8_step: but on the
    AVX-512 VNNI level)."""
    if kind not in _PEAKS:
        raise HTPInputError(f"kind must be one of {sorted(_PEAKS)}, got {kind!r}")
    be = _be(backend)
    p = ffi.new("double *")
    check(
        lib.htp_bench_mac_peak(be._handle(), _PEAKS[kind], _u32(iters, "iters", 1), p), "mac_peak"
    )
    return float(p[0])


def measure_peaks(
    *, backend: Backend | None = None, repeats: int = 5, iters: int = 2_000_000
) -> dict[str, float | None]:
    """This machine's measured peak rates on a host backend's threads, in GOP/s (2 per
    multiply-add): ``{"int8": ..., "fp32": ..., "bf16": ...}`` for its SIMD level's int8 dot
    product, fp32 FMA and bf16 dot product, each the best of ``repeats`` runs of ``iters``
    iterations (about 0.1 s each at the defaults). None for an instruction the level or CPU
    lacks, and for every kind on a backend that runs its ops elsewhere (an executor process or
    the DSP), whose rates the host cannot time. The per-op tables read achieved rates
    against these."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise HTPInputError(f"repeats must be a positive int, got {repeats!r}")
    out: dict[str, float | None] = {}
    for kind in ("int8", "fp32", "bf16"):
        try:
            out[kind] = max(_mac_peak(kind, iters, backend=backend) for _ in range(repeats)) * 2e-9
        except HTPUnsupportedError:
            out[kind] = None
    return out
