"""Optional picture of a configuration sweep (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
import numpy as np

from .configure import Choice, Row
from .metrics import pareto_frontier

__all__ = ["plot_frontier"]


def plot_frontier(
    table: Sequence[Row],
    path: str | os.PathLike[str],
    *,
    chosen: Choice | Sequence[Choice] = (),
    budget: int | None = None,
    title: str = "",
) -> None:
    """Latency–memory plot: every ``(g, b)`` of ``table`` (one colour per ``g``), the Pareto
    frontier, and for each chosen configuration its budget (dotted line) and point (star).
    Choices made with a read margin (`configure`'s ``read_margin``) also get the frontier of
    ``slow_reads_s``, the times they were ranked by (dashed).

    ``chosen``: one :class:`Choice` or several (e.g. one per budget); ``budget`` overrides the
    budget line of a single choice.
    """
    choices = [chosen] if isinstance(chosen, Choice) else list(chosen)
    if budget is not None and len(choices) == 1:
        choices = [attrs.evolve(choices[0], budget_bytes=int(budget))]
    if not table:
        raise ValueError("empty table: nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_frontier needs matplotlib: pip install 'estream-sched[plot]'"
        ) from e
    mib = 2.0**20
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    gs = sorted({r.g for r in table})
    cmap = plt.get_cmap("viridis")
    for i, g in enumerate(gs):
        rows = [r for r in table if r.g == g]
        ax.plot(
            [r.memory_bytes / mib for r in rows],
            [r.predicted_s for r in rows],
            "o-",
            ms=3,
            lw=0.8,
            color=cmap(i / max(len(gs) - 1, 1)),
            label=f"G={g}",
        )
    pts = np.array([(r.memory_bytes, r.predicted_s) for r in table])
    front = pareto_frontier(pts)
    ax.step(
        pts[front, 0] / mib, pts[front, 1], where="post", color="k", lw=1.2, label="Pareto frontier"
    )
    margins = sorted({c.read_margin for c in choices if c.read_margin > 0})
    if len(margins) == 1:  # the configurator ranked by these: the chosen points lie on them
        slow = np.array([(r.memory_bytes, r.slow_reads_s) for r in table])
        sf = pareto_frontier(slow)
        ax.step(
            slow[sf, 0] / mib, slow[sf, 1], where="post", color="0.45", ls="--", lw=1.0,
            label=f"frontier with reads {1 + margins[0]:g}× as long (ranked by)",
        )  # fmt: skip
    chosen: dict[tuple[int, int], Choice] = {}
    for c in choices:
        ax.axvline(c.budget_bytes / mib, color="0.6", ls=":", lw=0.8)
        chosen.setdefault((c.G, c.B), c)
    for i, ((g, b), c) in enumerate(chosen.items()):
        n = sum(1 for o in choices if (g, b) == (o.G, o.B))
        ax.plot(c.memory_bytes / mib, c.predicted_s, "*", color="crimson", ms=13, mec="k")
        ax.annotate(
            f"G={g} B={b}" + (f" ({n} budgets)" if n > 1 else ""),
            (c.memory_bytes / mib, c.predicted_s),
            textcoords="offset points",
            xytext=(4, 8 + 11 * (i % 3)),  # staggered: neighbouring choices stay legible
            fontsize=7,
        )
    ax.plot([], [], "*", color="crimson", mec="k", ms=10, label="chosen (per budget, dotted)")
    ax.set_xlabel("process memory (MiB) = M_other(g) + B·G·W_e")
    ax.set_ylabel("predicted MoE-layer time per request (s)")
    ax.set_title(title or f"latency–memory frontier at Q={table[0].q}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)
