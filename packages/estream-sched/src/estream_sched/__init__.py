"""estream-sched: the max-plus pipeline model, a discrete-event simulator, calibration profiles,
the (G, Q, B) configurator, pipeline metrics and Chrome-trace timelines (docs/design.md §6)."""

from __future__ import annotations

from ._model import Schedule, pipeline_schedule, pipeline_time
from .configure import (
    DEFAULT_READ_MARGIN,
    MAX_READ_MARGIN,
    BudgetError,
    Choice,
    Row,
    calibration_tokens,
    check_read_margin,
    choose_q0,
    configure,
    format_bytes,
    sweep,
)
from .metrics import (
    bubble_rate,
    busy_time,
    overlap,
    pareto_frontier,
    schedule_metrics,
    union,
)
from .plot import plot_frontier
from .profile import SCHEMA_VERSION, LayerProfile, Profile, ProfileError, n_groups
from .simulate import RequestSchedule, SimulationError, simulate, simulate_layers
from .synthetic import SyntheticSpec, synthetic_profile
from .trace import TraceEvent, chrome_trace, schedule_events, write_chrome_trace

GroupCandidate = LayerProfile  # name used by the engine's brief: one g's profile of one layer

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_READ_MARGIN",
    "MAX_READ_MARGIN",
    "SCHEMA_VERSION",
    "BudgetError",
    "Choice",
    "GroupCandidate",
    "LayerProfile",
    "Profile",
    "ProfileError",
    "RequestSchedule",
    "Row",
    "Schedule",
    "SimulationError",
    "SyntheticSpec",
    "TraceEvent",
    "__version__",
    "bubble_rate",
    "busy_time",
    "calibration_tokens",
    "check_read_margin",
    "choose_q0",
    "chrome_trace",
    "configure",
    "format_bytes",
    "n_groups",
    "overlap",
    "pareto_frontier",
    "pipeline_schedule",
    "pipeline_time",
    "plot_frontier",
    "schedule_events",
    "schedule_metrics",
    "simulate",
    "simulate_layers",
    "sweep",
    "synthetic_profile",
    "union",
    "write_chrome_trace",
]
