"""A timed run's timeline: the events of one iteration, lane by lane, for ``--timeline`` and the report's chart."""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError


def iteration_timeline(run_events: list[tuple], link_names: list[str], spans: list[tuple],
                       iteration: int | None) -> dict:
    """The events of one iteration (default: the decode iteration of median duration), in seconds from
    its start: lanes compute, stall, matcher and one per link.

    ``run_events`` are a run's (lane, kind, start, end, layer, key) records (TimedRun.events), ``spans`` its
    (start, end, is decode) per iteration, ``link_names`` the names of its links in queue order."""
    if iteration is None:
        candidates = [i for i, span in enumerate(spans) if span[2]] or list(range(len(spans)))
        durations = [spans[i][1] - spans[i][0] for i in candidates]
        iteration = candidates[int(np.argsort(durations, kind="stable")[len(durations) // 2])]
    if not 0 <= iteration < len(spans):
        raise ConfigError(f"timeline iteration {iteration} does not exist: the run has {len(spans)} "
                          "iterations (0-based)")
    start, end, _ = spans[iteration]
    events = [{"lane": lane, "kind": kind, "start_s": s - start, "end_s": e - start, "layer": layer,
               "expert": key}
              for lane, kind, s, e, layer, key in run_events if (e > start and s < end) or s == e == start]
    lanes = ["compute", "stall"] + list(link_names)
    if any(event[0] == "host" for event in run_events):
        lanes.append("host")
    if any(event[0] == "matcher" for event in run_events):
        lanes.append("matcher")
    if any(event[0] == "policy" for event in run_events):
        lanes.append("policy")
    return {"iteration": iteration, "duration_s": end - start, "lanes": lanes, "events": events}

