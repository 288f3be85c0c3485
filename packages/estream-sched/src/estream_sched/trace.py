"""Timelines as Chrome trace-event JSON (opened by Perfetto and chrome://tracing)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from ._model import Schedule

__all__ = ["TraceEvent", "chrome_trace", "schedule_events", "write_chrome_trace"]


@attrs.frozen
class TraceEvent:
    """One span on one track: ``[start_s, end_s)`` in seconds.

    ``track`` names the row in the viewer (``"exec"``, ``"read[0]"``, ...); ``process`` groups
    tracks (one per run or device); ``category`` is free text (``"read"``, ``"expert"``, ...).
    """

    name: str
    track: str
    start_s: float = attrs.field(converter=float)
    end_s: float = attrs.field(converter=float)
    category: str = ""
    process: str = "estream"
    args: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not (np.isfinite(self.start_s) and np.isfinite(self.end_s)):
            raise ValueError(f"event {self.name!r}: times must be finite")
        if self.end_s < self.start_s:
            raise ValueError(
                f"event {self.name!r} ends ({self.end_s}) before it starts ({self.start_s})"
            )


def _event(e: TraceEvent | Mapping[str, Any]) -> TraceEvent:
    if isinstance(e, TraceEvent):
        return e
    return TraceEvent(**dict(e))


def chrome_trace(events: Iterable[TraceEvent | Mapping[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event document (JSON object format) for the events.

    Complete events (``"ph": "X"``) with microsecond ``ts``/``dur``; processes and tracks
    become ``pid``/``tid`` with ``process_name``/``thread_name`` metadata so viewers label them.
    """
    evs = [_event(e) for e in events]
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    for e in evs:
        pid = pids.setdefault(e.process, len(pids) + 1)
        key = (e.process, e.track)
        if key not in tids:
            tids[key] = len(tids) + 1
        tid = tids[key]
        ev: dict[str, Any] = {
            "name": e.name,
            "cat": e.category or "estream",
            "ph": "X",
            "ts": e.start_s * 1e6,
            "dur": (e.end_s - e.start_s) * 1e6,
            "pid": pid,
            "tid": tid,
        }
        if e.args:
            ev["args"] = dict(e.args)
        out.append(ev)
    meta: list[dict[str, Any]] = []
    for name, pid in pids.items():
        meta.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        )
    for (proc, track), tid in tids.items():
        pid = pids[proc]
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
        )
        meta.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | os.PathLike[str], events: Iterable[TraceEvent | Mapping[str, Any]]
) -> None:
    """Write :func:`chrome_trace` of the events as JSON to ``path``."""
    doc = chrome_trace(events)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
        fh.write("\n")


def schedule_events(
    schedule: Schedule,
    *,
    q: int | None = None,
    offset_s: float = 0.0,
    layer: int | None = None,
    process: str = "predicted",
) -> list[TraceEvent]:
    """Events of one layer's schedule: the non-expert span, reads, expert executions.

    Reads go to ``read[k mod q]`` tracks when ``q`` is given (the loader slot that serves them in
    the model), else one ``read`` track. The non-expert span is drawn as ``[0, t_ne)``.
    """
    if schedule.f.ndim != 1:
        raise ValueError("schedule_events needs a single-candidate schedule (1-D arrays)")
    tag = "" if layer is None else f"L{layer} "
    t_ne = float(schedule.t_ne)
    evs = [TraceEvent(f"{tag}non-expert", "exec", offset_s, offset_s + t_ne, "non-expert", process)]
    for k in range(schedule.n_groups):
        track = "read" if q is None else f"read[{k % q}]"
        evs.append(
            TraceEvent(
                f"{tag}read g{k}",
                track,
                offset_s + schedule.a[k],
                offset_s + schedule.d[k],
                "read",
                process,
                {"group": k},
            )
        )
        evs.append(
            TraceEvent(
                f"{tag}expert g{k}",
                "exec",
                offset_s + schedule.s[k],
                offset_s + schedule.f[k],
                "expert",
                process,
                {"group": k},
            )
        )
    return evs
