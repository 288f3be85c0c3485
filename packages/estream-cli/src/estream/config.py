"""Which `(G, Q, B)` a run streams with, and the stored profile/configuration it comes from.

`resolve_config` is the one place that turns a mode, explicit `-G/-Q/-B`, a memory budget (via
the profile that `estream profile` stored in the manifest) or the manifest's stored configuration
into a `StreamConfig`. Measuring the profile is `profiling`'s job; this module only reads and
writes what is stored, so that the engine can use it without depending on the profiler.
"""

from __future__ import annotations

from typing import Any

import attrs

import estream_sched as es

from .errors import BadRequestError, BudgetTooSmallError, PackError
from .packed import PackedModel, update_config

__all__ = [
    "StreamConfig",
    "configure_for_budget",
    "resolve_config",
    "store_config",
    "store_profile",
    "stored_profile",
]


@attrs.frozen
class StreamConfig:
    G: int
    Q: int
    B: int
    source: str  # where it came from: explicit | manifest | budget | mode | default
    #: the configurator's predicted memory of the run, for a budget's choice (else None)
    memory_bytes: int | None = None

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
) -> StreamConfig | None:
    """`(G, Q, B)` for a stream-kind mode; None for ``resident`` (no arena). ``tokens``: the
    prompt length a budget's configuration is chosen for (default: the calibration length);
    ``schedule``: the streamed source's, as the configurator models it (`configure_for_budget`)."""
    hp = model.hparams
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
        choice = configure_for_budget(model, budget, tokens, schedule)
        cfg = StreamConfig(
            int(choice.G), int(choice.Q), int(choice.B), "budget", int(choice.memory_bytes)
        )
    elif stored := model.manifest.get("config"):
        cfg = StreamConfig(int(stored["G"]), int(stored["Q"]), int(stored["B"]), "manifest")
    else:
        cfg = StreamConfig(min(4, hp.n_experts), 2, 4, "default")
    if cfg.G < 1 or cfg.Q < 1 or cfg.B < 1:
        raise BadRequestError(f"G, Q and B must be ≥ 1 (got G={cfg.G}, Q={cfg.Q}, B={cfg.B})")
    return cfg


def stored_profile(model: PackedModel) -> es.Profile:
    prof = model.manifest.get("profile")
    if not prof:
        raise PackError(
            f"{model.path}: no profile stored — run `estream profile {model.path}` first"
        )
    return es.Profile.from_dict(prof)


def configure_for_budget(
    model: PackedModel, budget: int, tokens: int | None = None, schedule: str = "early"
) -> es.Choice:
    """(G, Q, B) for a memory budget from the stored profile, for prompts of ``tokens`` tokens
    (default: the profile's calibration length); clear error below the minimum.

    ``schedule``: ``after-routing`` is modelled with its reads starting when the routes are
    known: at layer start when the architecture's router reads the layer's input (before
    attention), after the layer's non-expert work otherwise; any other schedule as ``early``
    (reads from layer start)."""
    profile = stored_profile(model)
    sched = "after-routing" if schedule == "after-routing" else "early"
    at_start = model.hparams.router_input == "layer"
    try:
        return es.configure(
            profile, int(budget), tokens=tokens, schedule=sched, routes_at_layer_start=at_start
        )
    except es.BudgetError as exc:
        raise BudgetTooSmallError(str(exc), exc.minimum_bytes) from None


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
