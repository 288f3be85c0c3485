"""Which `(G, Q, B)` a run streams with, and the stored profile/configuration it comes from.

`resolve_config` is the one place that turns a mode, explicit `-G/-Q/-B`, a memory budget (via
the profile that `estream profile` stored in the manifest) or the manifest's stored configuration
into a `StreamConfig`. Measuring the profile is `profiling`'s job; this module only reads and
writes what is stored, so that the engine can use it without depending on the profiler.

A profile's times hold only for what it was measured with: the CPU, the SIMD kernel set the
kernels picked, the estream-htp build, the thread count, the activation format, the backend and
the pack's expert formats (`running_identity`; stored in the profile's ``measured_with``). When
the running identity differs, or the profile does not record one (profiled before it was
recorded), the profile is *stale* (`profile_mismatch`): a budget's or the stored configuration is
then not derived from it; the run takes the default configuration, shrunk to fit the budget,
and says so (`StaleProfileWarning`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import attrs

import estream_htp as htp
import estream_sched as es
from estream_layout import ModelSpec

from . import memory
from .errors import BadRequestError, BudgetTooSmallError, PackError, StaleProfileError
from .packed import PackedModel, update_config

#: Compute threads when a run does not say (the engine's default; kept here, with the
#: configuration it feeds, so that the engine imports this module and not the other way).
DEFAULT_THREADS = max(1, min(os.cpu_count() or 1, 8))

__all__ = [
    "IDENTITY_KEYS",
    "PROFILE_TOKENS",
    "OverBudgetWarning",
    "StaleProfileWarning",
    "StreamConfig",
    "configure_for_budget",
    "cpu_name",
    "kernel_build",
    "pass_bytes_per_token",
    "profile_mismatch",
    "profile_staleness",
    "profile_tokens",
    "prompt_extra_bytes",
    "prompt_extra_rate",
    "require_fresh_profile",
    "resolve_config",
    "running_identity",
    "store_config",
    "store_profile",
    "stored_profile",
    "warn_stale",
]

#: What a profile records it was measured with, and what a run compares (`running_identity`).
IDENTITY_KEYS = ("cpu", "simd", "kernels", "threads", "act", "backend", "expert_formats")


PROFILE_TOKENS = 256  # the pass `estream profile` measures by default


def pass_bytes_per_token(hp: ModelSpec, *, all_logits: bool = False) -> int:
    """Bytes of activations and scratch a pass holds per token, at its peak (README:
    "Batching"): float32 ``4 * (6 d + 2 q + 2 kv + 3 f + E + V_l)`` plus the routes
    ``12 k`` and the int8 copy of a GEMM input ``d (1 + 8/32)``, where ``d`` is the model
    width, ``q``/``kv`` the widest query and key+value projections, ``f`` the widest resident
    FFN (dense or shared experts), ``E``/``k`` the experts and experts per token, ``V_l`` the
    vocabulary when every position's logits are returned (else 0)."""
    d = hp.n_embd
    if hp.arch == "deepseek2":
        q = hp.n_head * hp.head_dim_k_mla
        kv = hp.n_head * (hp.head_dim_k_mla + hp.head_dim_v_mla) + hp.kv_lora_rank
    else:
        q = hp.n_head * hp.head_dim_k
        kv = max(hp.n_head_kv, default=0) * (hp.head_dim_k + hp.head_dim_v)
        kv = max(kv, 3 * d) if hp.shortconv_l_cache else kv  # LFM2's in_proj: B, C, x
    f = max(hp.n_ff, hp.n_ff_shexp)
    v = hp.n_vocab if all_logits else 0
    return (
        4 * (6 * d + 2 * q + 2 * kv + 3 * f + hp.n_experts + v)
        + 12 * hp.n_experts_used
        + (d + d // 4)
    )


def profile_tokens(model: PackedModel) -> int:
    """Tokens of the pass the stored profile measured its memory on
    (`estream_sched.calibration_tokens`; `PROFILE_TOKENS` without a profile or where it records
    none)."""
    if not model.manifest.get("profile"):
        return PROFILE_TOKENS
    try:
        return es.calibration_tokens(stored_profile(model))
    except es.ProfileError:
        return PROFILE_TOKENS


def prompt_extra_rate(model: PackedModel) -> tuple[int, int]:
    """The profile's pass length (`profile_tokens`) and the activation memory a pass holds for
    each token beyond it: the profile's measured ``m_per_token``, or the `pass_bytes_per_token`
    bound for a profile that does not record it (or no profile)."""
    per = stored_profile(model).m_per_token if model.manifest.get("profile") else None
    return profile_tokens(model), pass_bytes_per_token(model.hparams) if per is None else per


def prompt_extra_bytes(model: PackedModel, tokens: int | None) -> int:
    """Activation memory a ``tokens``-token pass holds beyond the profile's own pass (whose
    memory the profile measured): `prompt_extra_rate` for each token beyond it; 0 for None or
    a prompt no longer than the profile's."""
    if tokens is None:
        return 0
    t0, per = prompt_extra_rate(model)
    return max(0, int(tokens) - t0) * per


class StaleProfileWarning(UserWarning):
    """A run with a budget or a stored configuration found the pack's profile stale and took
    the default configuration instead (the message says what differs and what to run)."""


class OverBudgetWarning(UserWarning):
    """A pass longer than the prompt a memory budget's configuration was chosen for, whose
    predicted memory (its extra activations counted) is above that budget. The pass runs:
    nothing is refused after load. The message gives the figures and what to load with
    instead; the attributes hold them: ``tokens`` (the pass's), ``predicted_bytes``,
    ``budget_bytes``, ``chosen_tokens`` (the pass length the configuration was chosen for)
    and ``G``, ``Q``, ``B``."""

    def __init__(
        self, tokens: int, predicted_bytes: int, budget_bytes: int, chosen_tokens: int, gqb: Any
    ) -> None:
        self.tokens, self.predicted_bytes, self.budget_bytes = tokens, predicted_bytes, budget_bytes
        self.chosen_tokens = chosen_tokens
        self.G, self.Q, self.B = gqb
        super().__init__(
            f"{self.facts}; load with budget_tokens={tokens} to choose one for passes this long"
        )

    @property
    def facts(self) -> str:
        """What happened, without the advice (a command gives its own)."""
        fmt = memory.format_bytes
        return (
            f"a pass of {self.tokens} tokens is predicted to hold {fmt(self.predicted_bytes)}, "
            f"above the memory budget {fmt(self.budget_bytes)}: its configuration (G={self.G}, "
            f"Q={self.Q}, B={self.B}) was chosen for passes of up to {self.chosen_tokens} tokens"
        )


@attrs.frozen
class StreamConfig:
    G: int
    Q: int
    B: int
    source: str  # where it came from: explicit | manifest | budget | mode | default
    #: the configurator's predicted memory of the run, for a budget's choice (else None)
    memory_bytes: int | None = None
    #: why the profile's choice was not taken (a stale profile), else None
    warning: str | None = None
    #: of ``memory_bytes``, the activations of the prompt it was chosen for beyond those of the
    #: profile's pass (`configure_for_budget`)
    extra_bytes: int = 0

    def arena_bytes(self, model: PackedModel) -> int:
        return self.B * self.G * sum(size for _, size in model.plane_extents)


def resolve_config(
    model: PackedModel,
    mode: str,
    budget: int | None,
    G: int | None,
    Q: int | None,
    B: int | None,
    tokens: int | None = None,
    schedule: str = "early",
    *,
    n_threads: int | None = None,
    act: str = "q8",
    backend: str = "host",
    read_margin: float | None = None,
) -> StreamConfig | None:
    """`(G, Q, B)` for a stream-kind mode; None for ``resident`` (no arena). ``tokens``: the
    prompt length a budget's configuration is chosen for (default: the calibration length);
    ``schedule``: the streamed source's, as the configurator models it (`configure_for_budget`);
    ``n_threads`` (default: the engine's), ``act``, ``backend``: what the run computes with
    (`running_identity`); ``read_margin``: the configurator's margin for slower reads (None:
    `estream_sched.DEFAULT_READ_MARGIN`). A budget or a stored configuration with a stale
    profile (module docstring) gives the default configuration, shrunk to fit the budget
    (`StreamConfig.warning` says why; the engine warns with it)."""
    hp = model.hparams
    run = {"n_threads": n_threads, "act": act, "backend": backend}
    if mode == "resident":
        return None
    if mode == "naive":
        cfg = StreamConfig(1, 1, 3, "mode")
    elif mode == "layer":
        cfg = StreamConfig(hp.n_experts, 2, 2, "mode")
    elif G or Q or B:
        if G and hp.n_experts < G:
            raise BadRequestError(
                f"a group size of {G} is more than the model's {hp.n_experts} experts per "
                f"layer (G at most {hp.n_experts})"
            )
        q = Q or 2
        b = B or max(q, 2)
        cfg = StreamConfig(G or min(4, hp.n_experts), q, b, "explicit")
    elif budget is not None:
        if stale := _stale_reason(model, **run):
            cfg = _stale_fallback(
                model,
                int(budget),
                f"no configuration for --budget {_fmt_bytes(budget)} from it",
                stale,
                tokens,
            )
        else:
            choice = configure_for_budget(model, budget, tokens, schedule, read_margin)
            cfg = StreamConfig(
                int(choice.G),
                int(choice.Q),
                int(choice.B),
                "budget",
                int(choice.memory_bytes),
                extra_bytes=int(choice.extra_bytes),
            )
    elif stored := model.manifest.get("config"):
        if model.manifest.get("profile") and (stale := _stale_reason(model, **run)):
            # the stored configuration was chosen from this profile: as stale as it is
            b = stored.get("budget_bytes")
            b = int(b) if isinstance(b, int) and not isinstance(b, bool) and b > 0 else None
            cfg = _stale_fallback(
                model, b, "the stored configuration chosen from it is not used", stale
            )
        else:
            cfg = StreamConfig(int(stored["G"]), int(stored["Q"]), int(stored["B"]), "manifest")
    else:
        cfg = StreamConfig(min(4, hp.n_experts), 2, 4, "default")
    if cfg.G < 1 or cfg.Q < 1 or cfg.B < 1:
        raise BadRequestError(f"G, Q and B must be ≥ 1 (got G={cfg.G}, Q={cfg.Q}, B={cfg.B})")
    return cfg


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


@functools.lru_cache(maxsize=1)
def kernel_build() -> str:
    """The estream-htp build the kernels come from: its version and the first 16 hex digits of
    the SHA-256 of its compiled library (any rebuild with other kernels changes it)."""
    from importlib.metadata import PackageNotFoundError, version

    import estream_htp._ffi as ffi_mod

    try:
        ver = version("estream-htp")
    except PackageNotFoundError:
        ver = "unknown"
    path = getattr(ffi_mod, "__file__", None)
    if not path:
        return f"estream-htp {ver}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"estream-htp {ver} {digest.hexdigest()[:16]}"


def running_identity(
    model: PackedModel, *, n_threads: int, act: str = "q8", backend: str = "host"
) -> dict[str, Any]:
    """What a run of ``model`` computes with (`IDENTITY_KEYS`): the CPU, the SIMD kernel set the
    kernels picked, the estream-htp build, ``n_threads``, ``act``, ``backend`` and the pack's
    expert tile formats (sorted). A profile stores it as ``measured_with``."""
    formats = sorted({f for lay in model.layers.values() for f in lay.formats})
    return {
        "cpu": cpu_name(),
        "simd": htp.simd_level(),
        "kernels": kernel_build(),
        "threads": int(n_threads),
        "act": str(act),
        "backend": str(backend),
        "expert_formats": formats,
    }


def profile_mismatch(recorded: Mapping[str, Any], running: Mapping[str, Any]) -> list[str]:
    """What makes a profile measured with ``recorded`` stale for a run with ``running``: one
    phrase per differing key (``simd avx2 (profiled) != avx512vnni (now)``), or one saying that
    the profile records nothing; [] when it is fresh."""
    if not recorded:
        return ["it does not record what it was measured with (profiled by an older estream)"]
    out = []
    for key in IDENTITY_KEYS:
        if key not in running:
            continue
        was, now = recorded.get(key), running[key]
        if was != now:
            out.append(f"{key} {_show(was)} (profiled) != {_show(now)} (now)")
    return out


def _show(v: Any) -> str:
    if v is None:
        return "unrecorded"
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def _fmt_bytes(n: int) -> str:
    return es.format_bytes(int(n))


def profile_staleness(
    model: PackedModel, n_threads: int | None = None, act: str = "q8", backend: str = "host"
) -> list[str] | None:
    """Why the stored profile would be stale for a run with these options (`profile_mismatch`;
    one phrase for a profile estream-sched refuses), [] when it is current, None when there is
    none. ``n_threads`` defaults to the engine's."""
    if not model.manifest.get("profile"):
        return None
    try:
        recorded = stored_profile(model).measured_with
    except PackError as exc:
        return [str(exc)]
    if n_threads is None:
        n_threads = DEFAULT_THREADS
    running = running_identity(model, n_threads=n_threads, act=act, backend=backend)
    return profile_mismatch(recorded, running)


def _stale_reason(
    model: PackedModel, n_threads: int | None = None, act: str = "q8", backend: str = "host"
) -> str | None:
    """Why the stored profile is stale for a run with these options ('; '-joined), None if it
    is fresh or there is none (then the budget's configurator says that there is none)."""
    if not model.manifest.get("profile"):
        return None
    recorded = stored_profile(model).measured_with  # validated by its owner, estream-sched
    if n_threads is None:
        n_threads = DEFAULT_THREADS
    running = running_identity(model, n_threads=n_threads, act=act, backend=backend)
    return "; ".join(profile_mismatch(recorded, running)) or None


def require_fresh_profile(
    model: PackedModel, n_threads: int | None = None, act: str = "q8", backend: str = "host"
) -> es.Profile:
    """The stored profile, if it is fresh for a run with these options (default: the engine's
    threads, ``q8``, ``host``); `StaleProfileError` naming what differs otherwise
    (`PackError` if there is none)."""
    profile = stored_profile(model)
    if stale := _stale_reason(model, n_threads, act, backend):
        raise StaleProfileError(
            f"{model.path}: the stored profile is stale: {stale}; re-profile with "
            f"`estream profile --if-stale {model.path}`"
        )
    return profile


def _stale_fallback(
    model: PackedModel, budget: int | None, what: str, stale: str, tokens: int | None = None
) -> StreamConfig:
    """The default configuration in place of a stale profile's choice (``what``: which one,
    for the message): ``G = min(4, N_e)``, ``Q = 2``, ``B = 4``, or the first of ``(G, 2, 2)``,
    ``(1, 2, 2)``, ``(1, 1, 1)`` whose memory (the profile's largest non-arena memory, a
    ``tokens``-token prompt's extra activations (`prompt_extra_bytes`) and the arena) fits
    ``budget``; `BudgetTooSmallError` when none does. Memory does not depend on the kernels'
    speed, so the profile's memory side still sizes it."""
    n_e = model.hparams.n_experts
    g0 = min(4, n_e)
    cands = [(g0, 2, 4), (g0, 2, 2), (1, 2, 2), (1, 1, 1)]
    mem: dict[tuple[int, int, int], int | None] = {c: None for c in cands}
    extra = prompt_extra_bytes(model, tokens) if budget is not None else 0
    if budget is not None:
        doc = model.manifest.get("profile") or {}
        m_other = doc.get("m_other") if isinstance(doc, Mapping) else None
        other = (
            max(int(v) for v in m_other.values())
            if isinstance(m_other, Mapping) and m_other
            else int(model.dense_bytes)
        ) + extra
        rec = sum(size for _, size in model.plane_extents)
        mem = {c: other + c[2] * c[0] * rec for c in cands}
        fits = [c for c in cands if mem[c] <= budget]  # type: ignore[operator]
        if not fits:
            minimum = int(mem[cands[-1]])  # type: ignore[arg-type]
            raise BudgetTooSmallError(
                f"budget {_fmt_bytes(budget)} ({budget} B) is below the minimum "
                f"{_fmt_bytes(minimum)} ({minimum} B) of the default configuration taken "
                f"in place of the stale profile ({stale}); raise the budget or re-profile "
                f"with `estream profile --if-stale {model.path}`",
                minimum,
            )
        cands = fits
    G, Q, B = cands[0]
    note = (
        f"{model.path}: the stored profile is stale ({stale}); {what}: running the default "
        f"G={G} Q={Q} B={B} instead; re-profile with `estream profile --if-stale {model.path}`"
    )
    return StreamConfig(G, Q, B, "stale-profile", mem[(G, Q, B)], note, extra)


def warn_stale(cfg: StreamConfig | None) -> None:
    """Issue `StaleProfileWarning` for a configuration taken in place of a stale profile's."""
    if cfg is not None and cfg.warning:
        warnings.warn(cfg.warning, StaleProfileWarning, stacklevel=3)


def stored_profile(model: PackedModel) -> es.Profile:
    prof = model.manifest.get("profile")
    if not prof:
        raise PackError(
            f"{model.path}: no profile stored — run `estream profile {model.path}` first"
        )
    try:
        return es.Profile.from_dict(prof)
    except es.ProfileError as exc:
        raise PackError(
            f"{model.path}: the stored profile is invalid ({exc}); re-profile with "
            f"`estream profile {model.path}`"
        ) from None


def configure_for_budget(
    model: PackedModel,
    budget: int,
    tokens: int | None = None,
    schedule: str = "early",
    read_margin: float | None = None,
) -> es.Choice:
    """(G, Q, B) for a memory budget from the stored profile, for prompts of ``tokens`` tokens
    (default: the profile's calibration length); clear error below the minimum.

    The profile measured the memory of its own pass; a longer prompt's extra activations
    (`prompt_extra_bytes`) count in every configuration's memory
    (`estream_sched.configure`'s ``extra_bytes``), so the choice and the error hold for the
    prompt asked for.

    ``schedule``: ``after-routing`` is modelled with its reads starting when the routes are
    known: at layer start when the architecture's router reads the layer's input (before
    attention), after the layer's non-expert work otherwise; any other schedule as ``early``
    (reads from layer start)."""
    profile = stored_profile(model)
    sched = "after-routing" if schedule == "after-routing" else "early"
    at_start = model.hparams.router_input == "layer"
    extra = prompt_extra_bytes(model, tokens)
    try:
        return es.configure(
            profile,
            int(budget),
            tokens=tokens,
            schedule=sched,
            routes_at_layer_start=at_start,
            extra_bytes=extra,
            read_margin=es.DEFAULT_READ_MARGIN if read_margin is None else read_margin,
        )
    except es.BudgetError as exc:
        msg = str(exc)
        if extra:
            msg += f" for a {tokens}-token prompt (the profile's pass: {profile_tokens(model)})"
        raise BudgetTooSmallError(msg, exc.minimum_bytes) from None


def store_profile(model: PackedModel, profile: es.Profile) -> None:
    """Store the profile in the manifest (locked read-modify-write: concurrent writers are safe)."""
    model.manifest = update_config(model.path, "profile", profile.to_dict())


def store_config(model: PackedModel, choice: es.Choice, budget: int) -> dict[str, Any]:
    cfg = {
        "G": int(choice.G),
        "Q": int(choice.Q),
        "B": int(choice.B),
        "budget_bytes": int(budget),
        "predicted_s": float(choice.predicted_s),
        "memory_bytes": int(choice.memory_bytes),
    }
    model.manifest = update_config(model.path, "config", cfg)
    return cfg
