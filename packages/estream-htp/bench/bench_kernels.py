"""Kernel GFLOP/s on OLMoE-1B-7B shapes vs numpy/BLAS float32 on the same dequantized weights,
and as a percentage of the peak of the instruction each op multiplies with (int8 dot product for
q8 GEMMs and the expert op, fp32 FMA for f32, bf16 dot product for bf16 attention), measured in
the same run (start and end).

Also measures the per-op submission overhead of the host-process (executor) backend against the
in-process host backend. Run with `nox -s bench_kernels`. `-- --attention` runs only the
attention rows, at T = 1K, 4K and 16K on OLMoE's, DeepSeek-V2-Lite's MLA (192/128) and a
GQA sliding-window-with-sinks head shape (`--attention-lengths=64,200` to change the lengths,
`--out=PATH` for the JSON); `-- --source-types` runs only the GEMM on each block type files store
(Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS, Q4_1, Q5_0, Q5_1) and the expert op on Q4_K_M's, Q8_0's and Q4_0's experts. The BLAS baseline must get this machine's best kernel, so the
script re-executes itself with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE removed from its own
environment (nothing else is touched). Both sides use 2 threads. Writes
bench-results/bench_kernels.json.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

_SCRUB = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREADS = int(os.environ.get("BENCH_THREADS", "2"))
if any(k in os.environ for k in _SCRUB) or os.environ.get("OPENBLAS_NUM_THREADS") != str(THREADS):
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["OPENBLAS_NUM_THREADS"] = str(THREADS)
    os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)

import numpy as np  # noqa: E402

import estream_htp as htp  # noqa: E402
from estream_htp import _core  # noqa: E402
from estream_htp import testing as T  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
D, FF, E, K = 2048, 1024, 64, 8
QUICK = "--quick" in sys.argv
ONLY_SUBMISSION = "--submission" in sys.argv  # just the host vs host-process section
ONLY_ATTENTION = "--attention" in sys.argv  # just the attention rows, at ATTN_LENGTHS
ONLY_SOURCE_TYPES = "--source-types" in sys.argv  # just the SOURCE_TYPES GEMM and expert rows


def _flag_value(name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(name + "=")), None)


try:
    _lengths = _flag_value("--attention-lengths")
    ATTN_LENGTHS = tuple(int(x) for x in _lengths.split(",")) if _lengths else (1024, 4096, 16384)
    if not ATTN_LENGTHS or min(ATTN_LENGTHS) < 1:
        raise ValueError
except ValueError:
    sys.exit(f"bench_kernels: --attention-lengths wants positive integers, got {_lengths!r}")
OUT = _flag_value("--out")


def best_of(fn, reps: int = 3, min_time: float = 0.5) -> float:
    """Best of at least ``reps`` timed calls after a warm-up, and more until ``min_time``
    seconds have been timed: a few-millisecond op gets enough tries to see past this shared
    machine's stalls (3 tries put the first GEMM row at half its standalone rate)."""
    fn()  # warm-up
    best, spent, n = float("inf"), 0.0, 0
    while n < reps or spent < min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def blas_best_of(fn, reps: int = 3) -> tuple[float, float | None]:
    """BLAS baseline time with THREADS threads, and with 1 thread when threadpoolctl can set it
    (on a loaded 2-core machine OpenBLAS's 2-thread kernels can lose to 1 thread). Then a
    pause: OpenBLAS's idle threads spin for ~0.1 s after a call, and an htp op timed in that
    window ran at half speed (2048² GEMM, 256 tokens: 12.7 against 5.8 ms); htp's own workers
    spin only ~20 000 polls before they sleep."""
    t_n = best_of(fn, reps)
    t_1 = None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        with threadpool_limits(limits=1, user_api="blas"):
            t_1 = best_of(fn, reps)
    time.sleep(0.3)
    return t_n, t_1


#: The instruction each host level multiplies int8 with (the one its int8 peak times).
INT8_INSTRUCTION = {
    "avx2": "vpmaddubsw",
    "avx512": "vpmaddubsw zmm",
    "avx512vnni": "vpdpbusd",
    "amx": "tdpbssd tiles",
}


#: The tile formats whose Q8 kernels multiply in the `int8_step` mix (per 32-row block and
#: token: 16 dot products and the fp32 step, d_w * d_a then one FMA, for each 16-row half).
Q8_STEP_FORMATS = frozenset({"q4_0-t32r4", "q8_0-t32r4"})


def measure_peak() -> float:
    """int8 dot throughput (GOP/s, 2 ops per multiply-add) of the level's instruction
    (INT8_INSTRUCTION), best of several short runs on the pool's threads; this
    VM's 2 vCPUs are shared, so it is measured at start and end."""
    iters = 500_000 if htp.simd_level() == "amx" else 5_000_000
    return max(_core._dot_peak(iters) for _ in range(7)) * 2 / 1e9


@contextlib.contextmanager
def simd(level: str):
    """Run a comparison row at another SIMD level (same threads), then switch back."""
    old = htp.simd_level()
    _core._set_simd_level(level)
    try:
        yield
    finally:
        _core._set_simd_level(old)


#: On an AMX CPU the q8 rows are also run at the AVX-512 VNNI level: the same bits, the ratio
#: between the two kernels measured in one run.
VNNI_TOO = htp.simd_level() == "amx"


def measure_peaks() -> dict[str, float | None]:
    """GOP/s (2 per multiply-add) of the int8 dot product, the fp32 FMA and the bf16 dot
    product on the pool's threads, best of several short runs (None: no such instruction);
    ``int8_step``: the int8 dot product in the mix of the Q4_0 / Q8_0 kernels with their fp32
    step per 32-value block (16 dot products, 2 multiplies, 2 FMAs), the ceiling of the rows
    marked ``q8_step`` (AVX-512 VNNI only)."""
    out: dict[str, float | None] = {}
    for kind in ("int8", "fp32", "bf16", "int8_step"):
        try:
            iters = 200_000 if kind == "int8" and VNNI_TOO else 2_000_000
            out[kind] = max(_core._mac_peak(kind, iters) for _ in range(5)) * 2 / 1e9
        except htp.HTPError:
            out[kind] = None
    if VNNI_TOO:  # the peak of the VNNI comparison rows
        with simd("avx512vnni"):
            out["int8_vnni"] = max(_core._mac_peak("int8", 2_000_000) for _ in range(5)) * 2 / 1e9
    return out


def blas_info() -> dict:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {"threadpoolctl": "not installed"}
    return {
        "threadpoolctl": [
            {k: i.get(k) for k in ("internal_api", "num_threads", "architecture", "version")}
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        ]
    }


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def bench_gemm(rng: np.random.Generator, row, n: int, k: int, t: int) -> None:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    buf = T.pack_q4_0_t32r4(w)
    wd = T.dequantize_tiles(buf, "q4_0-t32r4", n, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    out = np.empty((t, n), np.float32)
    ref = x @ wd.T  # before the timed BLAS: its pause covers every BLAS call
    t_blas = blas_best_of(lambda: np.matmul(x, wd.T, out=out))
    for act in ("q8", "f32"):
        htp.set_activation_format(act)
        t_h = best_of(lambda: htp.gemm(x, buf, n, out=out))
        row(
            f"gemm q4_0 {n}x{k} T={t} act={act}",
            2.0 * t * n * k,
            t_h,
            t_blas,
            {"rel_l2_vs_blas_f32": T.rel_l2(out, ref), "q8_step": act == "q8"},
        )
        if act == "q8" and VNNI_TOO:
            with simd("avx512vnni"):
                t_v = best_of(lambda: htp.gemm(x, buf, n, out=out))
            row(f"gemm q4_0 {n}x{k} T={t} act=q8 avx512vnni", 2.0 * t * n * k, t_v, t_blas,
                {"peak": "int8_vnni", "amx_speedup": t_v / t_h})  # fmt: skip


def _random_tiles(
    rng: np.random.Generator, fmt: str, n: int, k: int, subnormal: float = 0.0
) -> np.ndarray:
    """Valid random weights of `fmt` (GGUF's own block types, re-laid as tiles); MXFP4 with a
    ``subnormal`` share of blocks at the subnormal scales (none: a model's scales)."""
    if fmt == "mxfp4-t32r4":
        return T.pack_mxfp4_t32r4(T.random_mxfp4_blocks(rng, n, k, subnormal=subnormal))
    return T.random_experts(rng, 1, k, n, (fmt, fmt, fmt))[0][0]


#: The block types files store that the source-type rows run, Q4_0 first: the K-quant and
#: MXFP4 rows read against it in the same run.
SOURCE_TYPES = ("q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4", "iq4_nl", "iq4_xs", "q4_1",
                "q5_0", "q5_1")  # fmt: skip


def bench_gemm_source_types(rng: np.random.Generator, row, n: int, k: int, t: int) -> None:
    """The GEMM on the block types files store (SOURCE_TYPES), int8 and fp32 activations:
    each row's share of the measured peak of its instruction (int8 dot / fp32 FMA)."""
    x = rng.standard_normal((t, k)).astype(np.float32)
    out = np.empty((t, n), np.float32)
    cases = [(f"{name}-t32r4", 0.0) for name in SOURCE_TYPES] + [("mxfp4-t32r4", 0.05)]
    for fmt, subnormal in cases:
        buf = _random_tiles(rng, fmt, n, k, subnormal)
        wd = T.dequantize_tiles(buf, fmt, n, k)
        ref = x @ wd.T
        t_blas = blas_best_of(lambda wd=wd: np.matmul(x, wd.T, out=out))
        note = f" ({subnormal:.0%} subnormal scales)" if subnormal else ""
        for act in ("q8", "f32"):
            htp.set_activation_format(act)
            t_h = best_of(lambda buf=buf, fmt=fmt: htp.gemm(x, buf, n, fmt, out=out))
            row(f"gemm {fmt.split('-')[0]} {n}x{k} T={t} act={act}{note}", 2.0 * t * n * k, t_h,
                t_blas, {"rel_l2_vs_blas_f32": T.rel_l2(out, ref),
                         "q8_step": act == "q8" and fmt in Q8_STEP_FORMATS})  # fmt: skip


def bench_experts_source_types(rng: np.random.Generator, row) -> None:
    """The expert op at OLMoE shapes on Q4_K_M's expert mix (Q4_K gate/up, Q6_K down), on Q8_0
    experts and on Q4_0 experts (the reference the K-quant row is read against), T = 1024."""
    t = 1024
    x = rng.standard_normal((t, D)).astype(np.float32)
    ids, wts = htp.router_topk(rng.standard_normal((t, E)).astype(np.float32), K)
    tokens = np.repeat(np.arange(t, dtype=np.int32), K)
    experts, weights = ids.reshape(-1), wts.reshape(-1)
    flops = 2.0 * 3 * D * FF * tokens.size
    slots = np.arange(E, dtype=np.int32)
    for name, fmts in (("Q4_K_M", ("q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4")),
                       ("Q8_0", ("q8_0-t32r4",) * 3), ("Q4_0", ("q4_0-t32r4",) * 3)):  # fmt: skip
        gate, up, down = T.random_experts(rng, E, D, FF, fmts)
        shapes = ((gate, (FF, D), fmts[0]), (up, (FF, D), fmts[1]), (down, (D, FF), fmts[2]))
        deq = [
            tuple(T.dequantize_tiles(p[e], f, *shape) for p, shape, f in shapes) for e in range(E)
        ]
        planes = [p.ctypes.data for p in (gate, up, down)]
        strides = [p.strides[0] for p in (gate, up, down)]
        y = np.zeros((t, D), np.float32)
        ref = blas_moe(x, tokens, experts, weights, deq)
        t_blas = blas_best_of(functools.partial(blas_moe, x, tokens, experts, weights, deq), reps=2)
        with htp.ExpertGraph(D, FF, capacity=tokens.size, t_max=t, formats=fmts) as g:
            for act in ("q8", "f32"):
                htp.set_activation_format(act)

                def run(g=g, y=y, planes=planes, strides=strides) -> None:
                    y[:] = 0
                    g.run(x, tokens, experts, weights, slots, planes, strides, y)

                t_h = best_of(run, reps=2)
                row(f"expert op OLMoE {name} T={t} act={act}", flops, t_h, t_blas,
                    {"rel_l2_vs_blas_f32": T.rel_l2(y, ref),
                     "q8_step": act == "q8" and set(fmts) <= Q8_STEP_FORMATS})  # fmt: skip


def blas_moe(x, tokens, experts, weights, deq) -> np.ndarray:
    """The same routed SwiGLU experts with numpy float32 matmuls (BLAS) per expert."""
    yb = np.zeros_like(x)
    order = np.argsort(experts, kind="stable")
    bounds = np.searchsorted(experts[order], np.arange(len(deq) + 1))
    for e, (wg, wu, wdn) in enumerate(deq):
        sel = order[bounds[e] : bounds[e + 1]]
        if sel.size == 0:
            continue
        tok = tokens[sel]
        xg = x[tok]
        h = silu(xg @ wg.T) * (xg @ wu.T)
        # top-k experts are distinct per token, so tok has no repeats: plain fancy += is exact
        yb[tok] += weights[sel, None] * (h @ wdn.T)
    return yb


def bench_experts(rng: np.random.Generator, row) -> None:
    gate, up, down = T.random_experts(rng, E, D, FF)
    shapes = ((gate, (FF, D)), (up, (FF, D)), (down, (D, FF)))
    deq = [
        tuple(T.dequantize_tiles(p[e], "q4_0-t32r4", *shape) for p, shape in shapes)
        for e in range(E)
    ]
    planes = [p.ctypes.data for p in (gate, up, down)]
    strides = [p.strides[0] for p in (gate, up, down)]
    slots = np.arange(E, dtype=np.int32)
    for t in (256, 1024, 4096):
        if QUICK and t > 1024:
            continue
        x = rng.standard_normal((t, D)).astype(np.float32)
        ids, wts = htp.router_topk(rng.standard_normal((t, E)).astype(np.float32), K)
        tokens = np.repeat(np.arange(t, dtype=np.int32), K)
        experts, weights = ids.reshape(-1), wts.reshape(-1)
        flops = 2.0 * 3 * D * FF * tokens.size
        y = np.zeros((t, D), np.float32)
        ref = blas_moe(x, tokens, experts, weights, deq)
        t_blas = blas_best_of(functools.partial(blas_moe, x, tokens, experts, weights, deq), reps=2)
        with htp.ExpertGraph(D, FF, capacity=tokens.size, t_max=t) as g:
            for act in ("q8", "f32"):
                htp.set_activation_format(act)

                def run(g=g, x=x, tokens=tokens, experts=experts, weights=weights, y=y) -> None:
                    y[:] = 0
                    g.run(x, tokens, experts, weights, slots, planes, strides, y)

                t_h = best_of(run, reps=2)
                row(
                    f"expert op OLMoE T={t} (R={tokens.size}) act={act}",
                    flops,
                    t_h,
                    t_blas,
                    {"rel_l2_vs_blas_f32": T.rel_l2(y, ref), "q8_step": act == "q8"},
                )
                if act == "q8" and VNNI_TOO:
                    with simd("avx512vnni"):
                        t_v = best_of(run, reps=2)
                    row(f"expert op OLMoE T={t} act=q8 avx512vnni", flops, t_v, t_blas,
                        {"peak": "int8_vnni", "amx_speedup": t_v / t_h})  # fmt: skip


def blas_attention(q, k, v, scale: float, bq: int = 512, window: int = 0, sinks=None):
    """Causal softmax(QKᵀ)V per head in query blocks of bq rows, skipping future key blocks
    (and, with a sliding window, the keys before it); GQA by head index; ``sinks`` join each
    row's denominator."""
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    out = np.empty((t, hq, v.shape[2]), np.float32)
    for h in range(hq):
        qh, kh, vh = q[:, h], k[:, h // rep], v[:, h // rep]
        for i0 in range(0, t, bq):
            i1 = min(t, i0 + bq)
            j0 = max(0, i0 + 1 - window) if window else 0
            s = (qh[i0:i1] @ kh[j0:i1].T) * np.float32(scale)
            i, j = np.arange(i0, i1)[:, None], np.arange(j0, i1)[None, :]
            s[(i < j) | ((j <= i - window) if window else False)] = -np.inf
            mx = s.max(axis=1, keepdims=True)
            if sinks is not None:
                mx = np.maximum(mx, sinks[h])
            s -= mx
            np.exp(s, out=s)
            den = s.sum(axis=1, keepdims=True)
            if sinks is not None:
                den += np.exp(sinks[h] - mx)
            out[i0:i1, h] = (s / den) @ vh[j0:i1]
    return out


# name, query heads, KV heads, K dim, V dim, sliding window (0: none), sinks
ATTN_SHAPES = (
    ("OLMoE", 16, 16, 128, 128, 0, False),
    ("DeepSeek-V2-Lite MLA", 16, 16, 192, 128, 0, False),
    ("GQA 64/8 window 128 sinks", 64, 8, 64, 64, 128, True),
)


def pct_of_step(r: dict, peaks: dict) -> float | None:
    """A ``q8_step`` row's rate as a share of the ``int8_step`` ceiling (the int8 dot product in
    its kernel's mix with the per-block fp32 step); None for other rows or without it."""
    if not r.get("q8_step") or r.get("peak_kind") != "int8" or not peaks.get("int8_step"):
        return None
    return 100.0 * r["htp_gflops"] / peaks["int8_step"]


def pct_of_peak(r: dict, peaks: dict) -> float | None:
    """A row's share of the peak of the instruction its products run on: its rate over the
    peak; for an op of two kinds (``flops_by_peak``), the time its work takes with each part
    at its peak over the time it took. None without the peaks."""
    by = r.get("flops_by_peak") or {r["peak_kind"]: r["gflop"] * 1e9}
    if not all(peaks.get(k) for k in by):
        return None
    floor_s = sum(f / (peaks[k] * 1e9) for k, f in by.items())
    return 100 * floor_s / r["htp_s"]


def bench_attention(rng: np.random.Generator, row) -> None:
    """Causal attention against the BLAS blocked baseline, fp32 and bf16 products: the OLMoE
    shape at T=4096 (1024 with --quick), or with --attention every head shape at every length
    of ATTN_LENGTHS."""
    if ONLY_ATTENTION:
        cases = [(t, shape) for t in ATTN_LENGTHS for shape in ATTN_SHAPES]
    else:
        cases = [(1024 if QUICK else 4096, ATTN_SHAPES[0])]
    for t, shape in cases:
        _bench_attention_case(rng, row, t, *shape)


def _bench_attention_case(rng, row, t, name, hq, hkv, dk, dv, window, with_sinks) -> None:
    """One head shape at one length: BLAS baseline, then fp32, bf16 and bf16-pv products (the
    last is read against both peaks: its scores at the fp32 rate, its weighted sum at bf16's)."""
    q = rng.standard_normal((t, hq, dk)).astype(np.float32)
    k = rng.standard_normal((t, hkv, dk)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32) if with_sinks else None
    scale = 1.0 / np.sqrt(dk)
    ref = blas_attention(q, k, v, scale, window=window, sinks=sinks)
    t_blas = blas_best_of(
        lambda: blas_attention(q, k, v, scale, window=window, sinks=sinks), reps=2
    )
    o = np.empty((t, hq, dv), np.float32)
    keys = np.minimum(np.arange(1, t + 1), window).sum() if window else t * (t + 1) / 2
    flops = 2.0 * hq * (dk + dv) * float(keys)  # QKᵀ and PV over the visible keys
    kinds = {
        "f32": "fp32",
        "bf16": "bf16",
        "bf16-pv": {"fp32": 2.0 * hq * dk * float(keys), "bf16": 2.0 * hq * dv * float(keys)},
    }
    for products in ("f32", "bf16", "bf16-pv"):
        t_h = best_of(
            lambda p=products: htp.attention(
                q, k, v, scale, True, out=o, products=p, window=window, sinks=sinks
            ),
            reps=2,
        )
        row(
            f"attention {name} T={t} {products}"
            if ONLY_ATTENTION
            else f"attention causal T={t} H={hq} Dh={dk} {products}",
            flops,
            t_h,
            t_blas,
            {
                "rel_l2_vs_blas": T.rel_l2(o, ref),
                "peak": kinds[products],
            },
        )


def bench_submission(results: dict) -> None:
    """Per-op cost of the executor path: an empty op's round trip, and the expert op of one
    group (G=4 of 64 OLMoE experts, T=1024) with every operand already in shared memory, run
    in-process (host) and through the executor (host-process) in this one run."""
    from estream_htp._ffi import ffi, lib

    rng = np.random.default_rng(1)
    g_size, t = 4, 1024
    gate, up, down = T.random_experts(rng, g_size, D, FF)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    tokens_all = np.repeat(np.arange(t, dtype=np.int32), K)
    sel = ids.reshape(-1) < g_size  # the routes of one group of 4 experts
    out: dict = {}
    print(f"{'submission':44s} {'host us':>9s} {'process us':>10s} {'overhead us':>11s}")
    with (
        htp.Backend("host", n_threads=THREADS) as host,
        htp.Backend("host-process", n_threads=THREADS) as proc,
    ):
        d = ffi.new("htp_op_desc *")
        lat: dict[str, list[float]] = {k: [] for k in ("c_host", "c_proc", "py_host", "py_proc")}
        for _ in range(10):  # interleaved rounds: both backends see the same machine load
            for name, be in (("host", host), ("proc", proc)):
                for _ in range(200):
                    t0 = time.perf_counter()
                    lib.htp_op_run(be._b, d)
                    lat[f"c_{name}"].append(time.perf_counter() - t0)
                for _ in range(200):
                    t0 = time.perf_counter()
                    htp.nop(backend=be)
                    lat[f"py_{name}"].append(time.perf_counter() - t0)
        for key, name in (("c", "nop_c"), ("py", "nop_python")):
            for b, label in (("host", "host"), ("proc", "host-process")):
                v = np.array(lat[f"{key}_{b}"]) * 1e6
                out[f"{name}_{label}_us"] = float(np.median(v))
                out[f"{name}_{label}_p10_us"] = float(np.percentile(v, 10))
                out[f"{name}_{label}_p90_us"] = float(np.percentile(v, 90))
        row = ("empty op round trip (C call, median)", "nop_c")
        print(
            f"{row[0]:44s} {out['nop_c_host_us']:9.1f} {out['nop_c_host-process_us']:10.1f} "
            f"{out['nop_c_host-process_us'] - out['nop_c_host_us']:11.1f}"
            f"  (process p10 {out['nop_c_host-process_p10_us']:.1f}, "
            f"p90 {out['nop_c_host-process_p90_us']:.1f})"
        )
        print(
            f"{'empty op round trip (Python htp.nop, median)':44s} {out['nop_python_host_us']:9.1f} "
            f"{out['nop_python_host-process_us']:10.1f} "
            f"{out['nop_python_host-process_us'] - out['nop_python_host_us']:11.1f}"
        )
        x0 = rng.standard_normal((t, D)).astype(np.float32)
        for act in ("q8", "f32"):
            runs = {}
            ys = {}
            for name, be in (("host", host), ("host-process", proc)):
                planes = [be.share(p) for p in (gate, up, down)]
                x = be.share(x0)
                tok = be.share(np.ascontiguousarray(tokens_all[sel]))
                ex = be.share(np.ascontiguousarray(ids.reshape(-1)[sel]))
                w = be.share(np.ones(int(sel.sum()), np.float32))
                slots = be.share(
                    np.concatenate([np.arange(g_size), np.full(E - g_size, -1)]).astype(np.int32)
                )
                y = be.empty((t, D), np.float32)
                g = htp.ExpertGraph(D, FF, 4096, t, backend=be)
                addrs = [p.ctypes.data for p in planes]
                strides = [p.strides[0] for p in planes]
                args = (x, tok, ex, w, slots, addrs, strides, y)

                def run(g=g, args=args, y=y, act=act, keep=planes) -> None:
                    y[...] = 0  # (keep: the planes must outlive their addresses in args)
                    g.run(*args, act=act)

                run()
                runs[name] = run
                ys[name] = y
            times = {"host": float("inf"), "host-process": float("inf")}
            for _ in range(9):  # alternate, best of 9 each
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    run()
                    times[name] = min(times[name], time.perf_counter() - t0)
            diff = np.abs(ys["host"] - ys["host-process"])
            assert ys["host"].tobytes() == ys["host-process"].tobytes(), (
                f"backends disagree: max |diff| {diff.max()} at {np.unravel_index(diff.argmax(), diff.shape)}, "
                f"{int((diff > 0).sum())} elements"
            )
            ov = times["host-process"] - times["host"]
            out[f"expert_group_{act}_host_us"] = times["host"] * 1e6
            out[f"expert_group_{act}_process_us"] = times["host-process"] * 1e6
            out[f"expert_group_{act}_overhead_pct"] = 100 * ov / times["host"]
            print(
                f"{f'expert op, 1 group (G=4, R={int(sel.sum())}) act={act}':44s} "
                f"{times['host'] * 1e6:9.1f} {times['host-process'] * 1e6:10.1f} {ov * 1e6:11.1f}"
                f" ({100 * ov / times['host']:+.1f}%)"
            )
    results["submission"] = out


def main() -> None:
    htp.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    results: dict = {
        "machine": {
            "simd": htp.simd_level(),
            "threads": THREADS,
            "blas": blas_info(),
            "env_scrubbed": [k for k in _SCRUB],
        },
        "rows": [],
    }
    rows = results["rows"]

    def row(
        name: str,
        flops: float,
        t_htp: float,
        t_blas: tuple[float, float | None],
        extra: dict | None = None,
    ) -> None:
        t2, t1 = t_blas
        best = min(t2, t1) if t1 is not None else t2
        r = {
            "op": name,
            "gflop": flops / 1e9,
            "htp_s": t_htp,
            "htp_gflops": flops / t_htp / 1e9,
            "blas_s": t2,
            "blas_gflops": flops / t2 / 1e9,
            "blas_1thread_gflops": flops / t1 / 1e9 if t1 is not None else None,
            "speedup_vs_best_blas": best / t_htp,
        }
        r.update(extra or {})
        # the instruction this op's products run on: int8 dot (q8), bf16 dot, fp32 FMA; or
        # {kind: flops} for an op of two (its floor: each part at its peak)
        kind = r.pop("peak", "int8" if "act=q8" in name else "fp32")
        if isinstance(kind, dict):
            r["flops_by_peak"], kind = kind, "+".join(sorted(kind))
        r["peak_kind"] = kind
        r["pct_of_peak"] = pct_of_peak(r, results["peaks_start"])
        r["pct_of_step"] = pct_of_step(r, results["peaks_start"])
        rows.append(r)
        b1 = f"{r['blas_1thread_gflops']:9.1f}" if t1 is not None else " " * 9
        pct = f"{r['pct_of_peak']:5.0f}% {kind}" if r["pct_of_peak"] is not None else ""
        print(
            f"{name:44s} {r['gflop']:8.1f} {r['htp_gflops']:9.1f} {r['blas_gflops']:9.1f} {b1} {r['speedup_vs_best_blas']:7.2f}x {pct}",
            flush=True,
        )

    # ---- instruction-mix peak
    try:
        results["peak_int8_gops"] = measure_peak()
    except htp.HTPError:
        results["peak_int8_gops"] = None
    print(
        f"SIMD {htp.simd_level()}, {THREADS} threads; measured int8 dot peak "
        f"({INT8_INSTRUCTION.get(htp.simd_level(), 'none')}): "
        f"{results['peak_int8_gops'] or 0:.0f} GOP/s (int8 mul+add); BLAS: {results['machine']['blas']}"
    )
    results["peaks_start"] = measure_peaks()
    print(
        "measured peaks (GOP/s, 2 per multiply-add): "
        + ", ".join(f"{k} {v:.0f}" if v else f"{k} n/a" for k, v in results["peaks_start"].items())
        + f"; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'op':44s} {'GFLOP':>8s} {'htp GF/s':>9s} {'BLAS GF/s':>9s} {'BLAS 1thr':>9s} {'vs best':>8s} {'of peak':>9s}"
    )

    if ONLY_ATTENTION:
        bench_attention(rng, row)
    elif ONLY_SOURCE_TYPES:
        bench_gemm_source_types(rng, row, 2048, 2048, 256)
        bench_experts_source_types(rng, row)
    elif not ONLY_SUBMISSION:
        for n, k, t in ((2048, 2048, 256), (50304, 2048, 256)):
            if not (QUICK and n > 4096):
                bench_gemm(rng, row, n, k, t)
        bench_experts(rng, row)
        bench_gemm_source_types(rng, row, 2048, 2048, 256)
        if not QUICK:
            bench_experts_source_types(rng, row)
        bench_attention(rng, row)
    if not (ONLY_ATTENTION or ONLY_SOURCE_TYPES):
        bench_submission(results)

    if results["peak_int8_gops"] is not None:
        end_peak = measure_peak()
        results["peak_int8_gops_start_end"] = [results["peak_int8_gops"], end_peak]
        results["peak_int8_gops"] = max(results["peak_int8_gops"], end_peak)
        print(f"int8 dot peak (max of start/end): {results['peak_int8_gops']:.0f} GOP/s")
    results["peaks_end"] = measure_peaks()
    results["load_average_end"] = os.getloadavg()
    print(
        "measured peaks at the end (GOP/s): "
        + ", ".join(f"{k} {v:.0f}" if v else f"{k} n/a" for k, v in results["peaks_end"].items())
        + f"; load average {os.getloadavg()[0]:.1f}"
    )
    # on a shared machine a peak measured at a busy moment is low: use the better of the two
    best = {
        k: max(v for v in (results["peaks_start"][k], results["peaks_end"][k]) if v is not None)
        for k in results["peaks_start"]
        if results["peaks_start"][k] is not None or results["peaks_end"][k] is not None
    }
    results["peaks_best"] = best
    print("share of the better of the start/end peaks:")
    for r in rows:
        r["pct_of_best_peak"] = pct_of_peak(r, best)
        r["pct_of_best_step"] = pct_of_step(r, best)
        if r["pct_of_best_peak"] is not None:
            pk = "+".join(f"{best[k]:.0f}" for k in r["peak_kind"].split("+"))
            step = (f", {r['pct_of_best_step']:.0f}% of int8_step {best['int8_step']:.0f}"
                    if r["pct_of_best_step"] is not None else "")  # fmt: skip
            print(
                f"  {r['op']:44s} {r['pct_of_best_peak']:5.0f}% of {r['peak_kind']} {pk} GOP/s{step}"
            )
    path = Path(OUT) if OUT else ROOT / "bench-results" / "bench_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
