"""Honest placements: a placement chosen from traffic is chosen on one part of it and scored on the rest.

The split. By default the first half of the requests (in order of first appearance) is the *profile* that
chooses and the second half is *scored*; a trace of one request is cut at its middle iteration instead. With
a separate profile trace (``--profile``), that trace chooses and the whole trace is scored. A placement chosen
on the part it is scored on is a *hindsight* figure: it knows the traffic it serves, so it is shown beside the
held-out one and never recommended.

Drift. ``window_hit_rates`` scores one fixed resident set over consecutive windows of the scored part: a
placement that fits the profile's hot set loses hits window by window when the hot set moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies._profile import expert_counts
from moe_offload.policies.base import ModelSpec
from moe_offload.trace.format import Trace


@dataclass(frozen=True)
class Split:
    profile: Trace   # the traffic a placement is chosen from
    scored: Trace    # the traffic it is scored on
    how: str         # the split in words, for the report


def check_profile(trace: Trace, profile: Trace, profile_name: str | None) -> None:
    """ConfigError unless ``profile`` routes the same model shape as ``trace``."""
    meta = trace.meta
    if (profile.meta.num_layers, profile.meta.num_experts) != (meta.num_layers, meta.num_experts):
        raise ConfigError(f"--profile {profile_name}: a trace of {profile.meta.num_layers} layers x "
                          f"{profile.meta.num_experts} experts cannot profile a model of {meta.num_layers} x "
                          f"{meta.num_experts}")


def split_trace(trace: Trace, profile: Trace | None = None, profile_name: str | None = None) -> Split:
    """The profile and the scored part of ``trace`` (module doc); ``profile`` is a separate profile trace."""
    if profile is not None:
        check_profile(trace, profile, profile_name)
        return Split(profile, trace, f"placements are chosen on {profile_name} and scored on the whole trace")
    ids = list(dict.fromkeys(trace.request.tolist()))
    if len(ids) >= 2:
        first = np.isin(trace.request, ids[:len(ids) // 2])
        return Split(trace.select(np.flatnonzero(first)), trace.select(np.flatnonzero(~first)),
                     f"placements are chosen on the first {len(ids) // 2:,} of {len(ids):,} requests and scored "
                     f"on the other {len(ids) - len(ids) // 2:,}")
    boundaries = np.flatnonzero(np.diff(trace.iteration)) + 1
    if boundaries.size == 0:
        raise ConfigError(f"{trace.path}: one iteration of one request cannot be split into a part that chooses a "
                          "placement and a part that scores it; give a separate profile (--profile TRACE)")
    cut = int(boundaries[(boundaries.size - 1) // 2])
    iterations = boundaries.size + 1
    return Split(trace.select(slice(0, cut)), trace.select(slice(cut, None)),
                 f"the trace is one request: placements are chosen on its first {cut:,} tokens and scored on the "
                 f"other {trace.num_tokens - cut:,} ({iterations:,} iterations in all)")


def served_share(trace: Trace, resident, spec: ModelSpec) -> float:
    """The share of ``trace``'s expert requests whose expert is in ``resident`` (flat ids): a static
    placement's replay hit rate."""
    counts = expert_counts(trace, spec)
    total = counts.sum()
    return float(counts[list(resident)].sum() / total) if total else 0.0


def window_hit_rates(trace: Trace, resident, spec: ModelSpec, windows: int = 8) -> list[float]:
    """``served_share`` over ``windows`` consecutive windows of equal rows (fewer when the trace is shorter)."""
    windows = max(1, min(windows, trace.num_tokens))
    edges = np.linspace(0, trace.num_tokens, windows + 1).astype(int)
    return [served_share(trace.select(slice(a, b)), resident, spec) for a, b in zip(edges, edges[1:])]
