"""Test helpers for users of estream-htp: weight packers/quantizers (independent of
estream-layout), float64 reference implementations of every op, and Hypothesis strategies."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import numpy.typing as npt

from estream_htp._formats import (
    dequantize_mxfp4,
    dequantize_q4_0,
    dequantize_q8_0,
    dequantize_tiles,
    matrix_nbytes,
    pack_f16_t32r4,
    pack_iq4_nl_t32r4,
    pack_iq4_xs_t32r4,
    pack_mxfp4_t32r4,
    pack_q4_0_t32r4,
    pack_q4_1_q5_t32r4,
    pack_q4_k_t32r4,
    pack_q5_k_t32r4,
    pack_q6_k_t32r4,
    pack_q8_0_t32r4,
    quantize_mxfp4,
    quantize_q4_0,
    quantize_q8_0,
    unpack_iq4_xs_t32r4,
    unpack_mxfp4_t32r4,
    unpack_q4_0_t32r4,
    unpack_q8_0_t32r4,
)

__all__ = [
    "dequantize_mxfp4",
    "dequantize_q4_0",
    "dequantize_q8_0",
    "dequantize_tiles",
    "end_run_after",
    "matrix_nbytes",
    "pack_f16_t32r4",
    "pack_iq4_nl_t32r4",
    "pack_iq4_xs_t32r4",
    "pack_mxfp4_t32r4",
    "pack_q4_0_t32r4",
    "pack_q4_1_q5_t32r4",
    "pack_q4_k_t32r4",
    "pack_q5_k_t32r4",
    "pack_q6_k_t32r4",
    "pack_q8_0_t32r4",
    "quantize_mxfp4",
    "quantize_q4_0",
    "quantize_q8_0",
    "random_experts",
    "random_f16_t32r4",
    "random_iq4_nl_blocks",
    "random_iq4_xs_blocks",
    "random_mxfp4_blocks",
    "random_q4_0_blocks",
    "random_q4_1_q5_blocks",
    "random_q4_k_blocks",
    "random_q5_k_blocks",
    "random_q6_k_blocks",
    "random_q8_0_blocks",
    "ref_attention",
    "ref_conv1d_causal",
    "ref_expert_op",
    "ref_gemm",
    "ref_gemm_magnitude",
    "ref_q8_activations",
    "ref_rms_norm",
    "ref_rope",
    "ref_router_topk",
    "rel_l2",
    "rel_l2_floored",
    "unpack_iq4_xs_t32r4",
    "unpack_mxfp4_t32r4",
    "unpack_q4_0_t32r4",
    "unpack_q8_0_t32r4",
]

F64 = npt.NDArray[np.float64]


def end_run_after(
    seconds: float,
    what: str,
    unmute: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Callable[[], None]:
    """A deadline for a test whose executor may never answer (a hung emulated program): unless
    the returned function is called within ``seconds``, print ``what`` and every thread's
    traceback to stderr (inside ``unmute()``: pytest's
    ``capturemanager.global_and_fixture_disabled``, so it reaches the terminal), kill this
    process's child processes (a hung executor never exits by itself) and end this process
    with status 1. faulthandler's watchdog, a minute later, ends it if the interpreter cannot
    run the timer's thread."""

    def expire() -> None:
        with unmute():
            print(f"\n{what}: still running after {seconds} s; ending the run", file=sys.stderr)
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 60, exit=True)

    def cancel() -> None:
        faulthandler.cancel_dump_traceback_later()
        timer.cancel()

    return cancel


def rel_l2(got: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """``‖got − ref‖₂ / ‖ref‖₂`` in float64 (NaN anywhere in ``got`` gives NaN)."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(r)
    return float(np.linalg.norm(g - r) / (den if den > 0 else 1.0))


def rel_l2_floored(
    got: npt.ArrayLike, ref: npt.ArrayLike, magnitude: npt.ArrayLike, n_terms: int
) -> float:
    """Relative L2 error whose reference norm is floored at the rounding scale of the sums.

    A float32 sum of ``n`` terms carries rounding error ~ ``eps · ‖Σ|terms|‖ / √n`` whatever the
    result; when the terms cancel (one output of a tiny GEMM) ``‖ref‖`` alone would demand more
    than any fp32 kernel can give. ``magnitude`` is the same computation on absolute values."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    den = max(
        float(np.linalg.norm(r)),
        float(np.linalg.norm(np.asarray(magnitude, dtype=np.float64))) / np.sqrt(max(1, n_terms)),
    )
    return float(np.linalg.norm(g - r) / (den if den > 0 else 1.0))


def ref_gemm_magnitude(x: npt.ArrayLike, w: Any, n: int, fmt: str = "q4_0-t32r4") -> F64:
    """``|X| · |W|ᵀ`` (float64): the scale of the rounding error of ``X · Wᵀ``."""
    xx = np.abs(np.asarray(x, dtype=np.float64))
    wd = np.abs(dequantize_tiles(w, fmt, n, xx.shape[1]).astype(np.float64))
    return xx @ wd.T


def random_q4_0_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid Q4_0 blocks ``uint8[n, k/32, 18]`` (finite fp16 scales, any nibbles)."""
    b = np.empty((n, k // 32, 18), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 0.05).astype(np.float16)
    b[..., :2] = d[..., None].view(np.uint8)
    b[..., 2:] = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    return b


def random_q8_0_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid Q8_0 blocks ``uint8[n, k/32, 34]`` (finite fp16 scales, any int8, -128
    included)."""
    b = np.empty((n, k // 32, 34), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 0.005).astype(np.float16)
    b[..., :2] = d[..., None].view(np.uint8)
    b[..., 2:] = rng.integers(0, 256, size=(n, k // 32, 32), dtype=np.uint8)
    return b


def random_q4_k_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid Q4_K blocks ``uint8[n, k/256, 144]``: finite fp16 ``d``/``dmin``, any
    6-bit scales and mins, any nibbles (``k`` a multiple of 256)."""
    b = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    b[..., 0:2] = (
        (rng.uniform(0.2, 1, (n, k // 256)) * 2e-3).astype(np.float16)[..., None].view(np.uint8)
    )
    b[..., 2:4] = (
        (rng.uniform(0, 1, (n, k // 256)) * 2e-3).astype(np.float16)[..., None].view(np.uint8)
    )
    return b


def random_q5_k_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid Q5_K blocks ``uint8[n, k/256, 176]``: finite fp16 ``d``/``dmin``, any
    6-bit scales and mins, any fifth bits and nibbles (``k`` a multiple of 256)."""
    b = rng.integers(0, 256, size=(n, k // 256, 176), dtype=np.uint8)
    b[..., 0:2] = (
        (rng.uniform(0.2, 1, (n, k // 256)) * 1e-3).astype(np.float16)[..., None].view(np.uint8)
    )
    b[..., 2:4] = (
        (rng.uniform(0, 1, (n, k // 256)) * 2e-3).astype(np.float16)[..., None].view(np.uint8)
    )
    return b


def random_q6_k_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid Q6_K blocks ``uint8[n, k/256, 210]``: a finite fp16 ``d``, any int8
    scales, any 6-bit values (``k`` a multiple of 256)."""
    b = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256)) * 1e-4).astype(np.float16)
    b[..., 208:210] = d[..., None].view(np.uint8)
    return b


def random_q4_1_q5_blocks(
    rng: np.random.Generator, n: int, k: int, fmt: str
) -> npt.NDArray[np.uint8]:
    """Random valid Q4_1 / Q5_0 / Q5_1 blocks (``fmt`` their tile format's name): finite fp16
    ``d`` (and ``m``), any fifth bits and nibbles."""
    size = {"q4_1-t32r4": 20, "q5_0-t32r4": 22, "q5_1-t32r4": 24}[fmt]
    b = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    b[..., :2] = (
        (rng.standard_normal((n, k // 32)) * 2e-3).astype(np.float16)[..., None].view(np.uint8)
    )
    if fmt != "q5_0-t32r4":
        m = (rng.standard_normal((n, k // 32)) * 1e-2).astype(np.float16)
        b[..., 2:4] = m[..., None].view(np.uint8)
    return b


def random_iq4_nl_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid IQ4_NL blocks ``uint8[n, k/32, 18]`` (finite fp16 scales, any codes)."""
    b = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 5e-4).astype(np.float16)
    b[..., :2] = d[..., None].view(np.uint8)
    return b


def random_iq4_xs_blocks(rng: np.random.Generator, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Random valid IQ4_XS blocks ``uint8[n, k/256, 136]``: a finite fp16 ``d``, any 6-bit
    sub-block scales and codes (``k`` a multiple of 256)."""
    b = rng.integers(0, 256, size=(n, k // 256, 136), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256)) * 3e-5).astype(np.float16)
    b[..., :2] = d[..., None].view(np.uint8)
    return b


def random_mxfp4_blocks(
    rng: np.random.Generator, n: int, k: int, *, subnormal: float = 0.05
) -> npt.NDArray[np.uint8]:
    """Random valid MXFP4 blocks ``uint8[n, k/32, 17]``: exponents 2^-12..2^-1 per block, any
    codes; a ``subnormal`` share of the blocks (the tests' edge cases) takes the subnormal scale
    of exponent 0 or 1. Timings want 0: a model's blocks are scaled to their values, and fp32
    multiplies by a subnormal scale take x86's slow microcode path (the AVX-512 MXFP4 GEMM ran
    at half its speed with the default 5 %)."""
    b = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    e = rng.integers(115, 127, size=(n, k // 32))
    e[rng.random((n, k // 32)) < subnormal] = rng.integers(0, 2)
    b[..., 0] = e
    return b


def random_f16_t32r4(
    rng: np.random.Generator, n: int, k: int, fmt: str = "f16-t32r4", *, largest: bool = False
) -> npt.NDArray[np.uint8]:
    """Random ``f16-t32r4`` / ``bf16-t32r4`` tiles of ``W[n][k]``: standard-normal values with
    some of the format's edge values mixed in (subnormals, the smallest normal, -0.0; with
    ``largest`` its largest finite values too, which overflow a float32 sum for BF16)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "f16-t32r4":
        u = w.astype(np.float16).view(np.uint16)
        special = [0x0001, 0x83FF, 0x8000, 0x0400] + ([0x7BFF, 0xFBFF] if largest else [])
    else:  # round to nearest even into the high half
        b = w.view(np.uint32)
        u = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
        special = [0x0001, 0x807F, 0x8000, 0x0080] + ([0x7F7F, 0xFF7F] if largest else [])
    pick = rng.random((n, k)) < 0.03
    u[pick] = rng.choice(np.array(special, np.uint16), size=int(pick.sum()))
    return pack_f16_t32r4(u)


def _random_tiles(rng: np.random.Generator, fmt: str, n: int, k: int) -> npt.NDArray[np.uint8]:
    if fmt == "mxfp4-t32r4":
        return pack_mxfp4_t32r4(random_mxfp4_blocks(rng, n, k))
    if fmt == "iq4_nl-t32r4":
        return pack_iq4_nl_t32r4(random_iq4_nl_blocks(rng, n, k))
    if fmt == "iq4_xs-t32r4":
        return pack_iq4_xs_t32r4(random_iq4_xs_blocks(rng, n, k))
    if fmt in ("q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4"):
        return pack_q4_1_q5_t32r4(random_q4_1_q5_blocks(rng, n, k, fmt), fmt)
    if fmt == "q4_k-t32r4":
        return pack_q4_k_t32r4(random_q4_k_blocks(rng, n, k))
    if fmt == "q5_k-t32r4":
        return pack_q5_k_t32r4(random_q5_k_blocks(rng, n, k))
    if fmt == "q6_k-t32r4":
        return pack_q6_k_t32r4(random_q6_k_blocks(rng, n, k))
    if fmt == "q8_0-t32r4":
        return pack_q8_0_t32r4(random_q8_0_blocks(rng, n, k))
    if fmt == "q4_0-t32r4":
        return pack_q4_0_t32r4(random_q4_0_blocks(rng, n, k))
    raise ValueError(f"no random expert weights for format {fmt!r}")


def random_experts(
    rng: np.random.Generator,
    n_experts: int,
    d: int,
    ff: int,
    formats: tuple[str, str, str] = ("q4_0-t32r4",) * 3,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Packed gate/up/down planes ``uint8[E, nbytes]`` of random experts, in the tile formats
    ``formats`` (gate, up, down)."""
    fg, fu, fd = formats
    gate = np.stack([_random_tiles(rng, fg, ff, d) for _ in range(n_experts)])
    up = np.stack([_random_tiles(rng, fu, ff, d) for _ in range(n_experts)])
    down = np.stack([_random_tiles(rng, fd, d, ff) for _ in range(n_experts)])
    return gate, up, down


def ref_gemm(x: npt.ArrayLike, w: Any, n: int, fmt: str = "q4_0-t32r4") -> F64:
    """float64 ``X · Wᵀ`` on the dequantized weights."""
    xx = np.asarray(x, dtype=np.float64)
    wd = dequantize_tiles(w, fmt, n, xx.shape[1]).astype(np.float64)
    return xx @ wd.T


def ref_q8_activations(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """The activations as the int8 path sees them: per 32-block ``d = amax/127``,
    ``q = rint(x / d)`` (float32 arithmetic, as in C), returned dequantized ``q * d``."""
    a = np.asarray(x, dtype=np.float32)
    b = a.reshape(*a.shape[:-1], a.shape[-1] // 32, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    return (q * d).reshape(a.shape).astype(np.float32)


def ref_rms_norm(x: npt.ArrayLike, w: npt.ArrayLike | None, eps: float, n_heads: int = 1) -> F64:
    xx = np.asarray(x, dtype=np.float64)
    t, width = xx.shape
    h = xx.reshape(t, n_heads, width // n_heads)
    y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * np.asarray(w, dtype=np.float64)
    return y.reshape(t, width)


def ref_rope(
    x: npt.ArrayLike,
    pos: npt.ArrayLike,
    n_rot: int,
    base: float,
    scale: float,
    mode: str,
    *,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    corr_dims: tuple[float, float] = (0.0, 0.0),
) -> F64:
    """float64 RoPE with llama.cpp's YaRN (``ggml_rope_ext``): written from the YaRN paper's
    ramp, independently of the kernel's loop."""
    xx = np.array(x, dtype=np.float64)
    half = n_rot // 2
    j = np.arange(half, dtype=np.float64)
    extrap = np.asarray(pos, dtype=np.float64)[:, None] * base ** (-2.0 * j / n_rot)
    theta = scale * extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        low, high = corr_dims
        ramp = 1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * ext_factor
        theta = theta * (1.0 - mix) + extrap * mix
        mscale *= 1.0 + 0.1 * np.log(1.0 / scale)
    c, s = np.cos(theta)[:, None, :] * mscale, np.sin(theta)[:, None, :] * mscale
    if mode == "normal":
        a, b = xx[..., 0:n_rot:2].copy(), xx[..., 1:n_rot:2].copy()
        xx[..., 0:n_rot:2] = a * c - b * s
        xx[..., 1:n_rot:2] = a * s + b * c
    else:
        a, b = xx[..., :half].copy(), xx[..., half:n_rot].copy()
        xx[..., :half] = a * c - b * s
        xx[..., half:n_rot] = a * s + b * c
    return xx


def ref_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    scale: float,
    causal: bool = True,
    context: int = 0,
    window: int = 0,
    sinks: npt.ArrayLike | None = None,
) -> F64:
    """Float64 attention; ``context``: k, v hold ``context + T`` rows and query ``i`` sits at
    key position ``p = context + i`` (causal: it sees keys ``0 .. p``; with ``window`` W > 0
    only keys ``p - W < j <= p``); ``sinks``: one logit per query head appended to every row's
    scores as a key whose value is zero (it joins the softmax denominator only)."""
    qq = np.asarray(q, dtype=np.float64)
    kk = np.asarray(k, dtype=np.float64)
    vv = np.asarray(v, dtype=np.float64)
    t, hq, _ = qq.shape
    rep = hq // kk.shape[1]
    kk = np.repeat(kk, rep, axis=1)
    vv = np.repeat(vv, rep, axis=1)
    s = np.einsum("thd,shd->hts", qq, kk) * scale
    if causal:
        pos = context + np.arange(t)[:, None]
        j = np.arange(kk.shape[0])[None, :]
        hidden = (j > pos) | ((j <= pos - window) if window else False)
        s = np.where(hidden, -np.inf, s)
    if sinks is not None:
        sk = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[:, None, None], (hq, t, 1))
        s = np.concatenate([s, sk], axis=-1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return np.einsum("hts,shd->thd", p, vv)


def ref_conv1d_causal(
    x: npt.ArrayLike, w: npt.ArrayLike, state: npt.ArrayLike | None = None
) -> F64:
    """Float64 causal depthwise convolution: ``out[t, c] = sum_j w[c, j] * s[t + j, c]`` with
    ``s = [state (zeros if None); x]`` (``L-1`` history rows), written as shifted slices."""
    xs = np.asarray(x, dtype=np.float64)
    wd = np.asarray(w, dtype=np.float64)
    t, ch = xs.shape
    taps = wd.shape[1]
    hist = np.zeros((taps - 1, ch)) if state is None else np.asarray(state, dtype=np.float64)
    s = np.concatenate([hist, xs])
    out = np.zeros((t, ch))
    for j in range(taps):
        out += wd[:, j] * s[j : j + t]
    return out


def ref_router_topk(
    logits: npt.ArrayLike,
    k: int,
    gating: str = "softmax",
    norm: bool = False,
    scale: float = 1.0,
    bias: npt.ArrayLike | None = None,
) -> tuple[npt.NDArray[np.int64], F64]:
    lg = np.asarray(logits, dtype=np.float64)
    if gating == "softmax":
        p = np.exp(lg - lg.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        key = p
    else:
        p = 1.0 / (1.0 + np.exp(-lg))
        key = p + (0.0 if bias is None else np.asarray(bias, dtype=np.float64))
    ids = np.argsort(-key, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if norm:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w * scale


def ref_expert_op(
    x: npt.ArrayLike,
    tokens: npt.ArrayLike,
    experts: npt.ArrayLike,
    weights: npt.ArrayLike,
    gate: npt.NDArray[np.uint8],
    up: npt.NDArray[np.uint8],
    down: npt.NDArray[np.uint8],
    ff: int,
    magnitude: bool = False,
    q8: bool = False,
    formats: tuple[str, str, str] = ("q4_0-t32r4",) * 3,
    glu: str = "swiglu",
    biases: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike] | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> F64:
    """float64 ``Σ_r w_r · down_e(silu(gate_e(x_t)) * up_e(x_t))`` (planes ``[E, nbytes]`` in
    the tile formats ``formats``: gate, up, down); ``glu`` "reglu" ``max(g, 0)·u`` or
    "swiglu_oai" ``g'·sigmoid(alpha·g')·(u' + 1)`` (``g' = min(g, limit)``, ``u'`` clamped to
    ``±limit``) in place of SwiGLU; ``biases`` (gate, up ``[E, ff]``, down ``[E, d]``) added to
    gate and up before the activation and to down's output before the weighting.

    ``magnitude=True`` returns ``Σ_r |w_r| · |down_e| · |h_r|`` instead (the rounding scale);
    ``q8=True`` feeds x and h through the int8 activation rounding as the q8 path does."""
    xx = np.asarray(ref_q8_activations(x) if q8 else x, dtype=np.float64)
    t, d = xx.shape
    y = np.zeros((t, d))
    cache: dict[int, tuple[F64, F64, F64]] = {}
    for tok, e, w in zip(np.asarray(tokens), np.asarray(experts), np.asarray(weights)):
        e = int(e)
        if e not in cache:
            cache[e] = (
                dequantize_tiles(gate[e], formats[0], ff, d).astype(np.float64),
                dequantize_tiles(up[e], formats[1], ff, d).astype(np.float64),
                dequantize_tiles(down[e], formats[2], d, ff).astype(np.float64),
            )
        wg, wu, wd = cache[e]
        g, u = wg @ xx[tok], wu @ xx[tok]
        if biases is not None:
            g = g + np.asarray(biases[0], dtype=np.float64)[e]
            u = u + np.asarray(biases[1], dtype=np.float64)[e]
        if glu == "reglu":
            h = np.maximum(g, 0.0) * u
        elif glu == "swiglu_oai":
            g = np.minimum(g, limit)
            h = g / (1.0 + np.exp(-alpha * g)) * (np.clip(u, -limit, limit) + 1.0)
        else:
            h = g / (1.0 + np.exp(-g)) * u
        if q8:
            h = ref_q8_activations(h.astype(np.float32)).astype(np.float64)
        bd = 0.0 if biases is None else np.asarray(biases[2], dtype=np.float64)[e]
        if magnitude:
            y[tok] += abs(float(w)) * (np.abs(wd) @ np.abs(h) + np.abs(bd))
        else:
            y[tok] += float(w) * (wd @ h + bd)
    return y
