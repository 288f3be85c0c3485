"""`estream demo`: the main job, end to end, on a small synthetic model.

synthesize → pack → profile → configure under a budget → streamed prefill → result + metrics,
then the same prompt resident (all experts in memory) for comparison.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from estream import memory
from estream.errors import BadRequestError

from .messages import plural

__all__ = ["DEMO_DIMS", "run_demo"]

# The default demo model: the `small` preset widened so that its experts (≈ 226 MiB) are worth
# streaming, yet it synthesizes, packs and runs in seconds.
DEMO_DIMS = {
    "n_layers": 8,
    "n_embd": 1024,
    "n_ff_exp": 512,
    "n_experts": 32,
    "n_experts_used": 4,
    "n_head": 8,
    "n_head_kv": 8,
    "head_dim": 128,
}


def _step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    from estream_layout.synth import PRESET_ARCH

    if PRESET_ARCH.get(args.preset, args.arch) != args.arch:
        raise BadRequestError(
            f"--preset {args.preset} is the shape of a {PRESET_ARCH[args.preset]} model; "
            f"give --arch {PRESET_ARCH[args.preset]}"
        )
    t_all = time.perf_counter()
    own = args.dir is None
    # our own directory is named first and made inside the `try` that removes it: an interrupt
    # at any moment leaves nothing behind
    if own:
        work = Path(tempfile.gettempdir()) / f"estream-demo-{secrets.token_hex(6)}"
    else:
        work = Path(args.dir)
    made = own  # the handler below removes `work` (False: nothing made here)
    try:
        if own:
            try:
                work.mkdir(mode=0o700)
            except OSError:
                made = False
                raise
        else:
            work.mkdir(parents=True, exist_ok=True)
        dst = _synth_and_pack(args, work)
        n_vocab = _profile_and_configure(dst, args.tokens)
        tokens = np.random.default_rng(1).integers(0, n_vocab, size=args.tokens)
        if not _stream_and_resident(dst, tokens):
            print("estream demo: stream and resident disagree", file=sys.stderr)
            return 1
        print(f"demo finished in {time.perf_counter() - t_all:.1f} s")
        return 0
    finally:
        if made:
            shutil.rmtree(work, ignore_errors=True)


def _synth_and_pack(args: argparse.Namespace, work: Path) -> Path:
    """The demo model synthesized and packed in ``work``: the pack's path."""
    from estream.packed import PackedModel
    from estream_layout import pack_model, synth_model

    src = work / f"{args.arch}-{args.preset}.gguf"
    dst = work / f"{args.arch}-{args.preset}.estream"
    _step(f"synthesizing a {args.preset} {args.arch} model → {src}")
    t0 = time.perf_counter()
    if args.preset == "demo":
        synth_model(args.arch, "small", src, seed=0, **DEMO_DIMS)
    else:
        synth_model(args.arch, args.preset, src, seed=0)
    print(f"    {memory.format_bytes(src.stat().st_size)} in {time.perf_counter() - t0:.1f} s")
    _step(f"packing → {dst}")
    t0 = time.perf_counter()
    pack_model(src, dst, force=True, progress=False)
    model = PackedModel(dst)
    hp = model.hparams
    print(
        f"    {len(model.layers)} MoE layers × {hp.n_experts} experts (top-{hp.n_experts_used}),"
        f" experts {memory.format_bytes(model.expert_bytes_total)}, in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return dst


def _profile_and_configure(dst: Path, n_tokens: int) -> int:
    """The pack profiled and configured for a budget of a quarter of its experts (stored in
    its manifest); the model's vocabulary size."""
    from estream.config import configure_for_budget, store_config, store_profile
    from estream.packed import PackedModel
    from estream.profiling import profile_model

    model = PackedModel(dst)
    hp = model.hparams
    experts = model.expert_bytes_total
    _step("profiling (one calibration request per candidate group size)")
    t0 = time.perf_counter()
    cands = tuple(g for g in (1, 2, 4, 8) if g <= hp.n_experts)
    prof = profile_model(
        dst,
        candidates=cands,
        queue_depths=(1, 2, 4),
        n_tokens=min(128, n_tokens),
        log=lambda s: print("  " + s.strip(), flush=True),
    )
    store_profile(model, prof)
    print(f"    done in {time.perf_counter() - t0:.1f} s")
    model = PackedModel(dst)
    m_other = max(int(v) for v in prof.to_dict()["m_other"].values())
    budget = m_other + experts // 4
    _step(
        f"configuring for a {memory.format_bytes(budget)} budget (experts alone: "
        f"{memory.format_bytes(experts)})"
    )
    t0 = time.perf_counter()
    choice = configure_for_budget(model, budget)
    dt = time.perf_counter() - t0
    store_config(model, choice, budget)
    print(
        f"    G={choice.G} Q={choice.Q} B={choice.B}: predicted memory "
        f"{memory.format_bytes(choice.memory_bytes)}, predicted "
        f"{choice.predicted_s * 1e3:.1f} ms per request of {choice.tokens or '?'} tokens, selected in {dt * 1e3:.2f} ms"
    )
    return int(hp.n_vocab)


def _stream_and_resident(dst: Path, tokens: np.ndarray) -> bool:
    """The prompt streamed under the stored configuration, then with every expert resident;
    whether their logits agree (1e-5 relative)."""
    from estream.engine import load

    from .report import print_metrics

    _step(f"streamed prefill of {plural(tokens.size, 'token')}")
    with load(dst) as eng:
        res = eng.prefill(tokens)
    print("    next-token top-5:", ", ".join(f"{i} ({p:.3f})" for i, p in res.top_k(5)))
    print_metrics(res.metrics)
    _step("the same prompt with every expert resident (same kernels, no I/O)")
    with load(dst, mode="resident") as eng:
        ref = eng.prefill(tokens)
    print_metrics(ref.metrics)
    rel = float(np.linalg.norm(res.logits - ref.logits) / np.linalg.norm(ref.logits))
    print(f"    stream vs resident logits: relative difference {rel:.2e}")
    ratio = res.metrics["ttft_s"] / ref.metrics["ttft_s"]
    mem = res.metrics["expert_memory_bytes"] / max(1, ref.metrics["expert_memory_bytes"])
    print(f"    stream TTFT = {ratio:.2f}× resident, expert memory = {mem:.2f}× resident")
    return rel <= 1e-5
