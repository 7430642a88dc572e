"""What a layer needs in one forward pass: the experts its tokens selected, in the timed access order, and
the tokens routed to each (by request); and, for the offline policies, each key's next access in that order
over the whole run (:class:`NextUses`).

The timed access order (the ``clock`` of AccessContext in run.py) is iteration by iteration, layer by layer,
the layer's needed experts in order of first appearance over the iteration's tokens (row order, then router
rank). With one token per iteration, top-1 routing, no prefetcher and zero compute, the timed access order is
the replay's (trace/flatten.py: token, rank, layer) and every policy makes exactly the replay's misses
(tests/test_timed.py checks it). With top-k > 1 the orders differ by design: the replay serves paper
001's rounds (rank-major), the timed simulator the physical order (layer-major).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from moe_offload.simulator.timed.schedule import trace_iterations
from moe_offload.trace.flatten import NEVER, next_use_times
from moe_offload.trace.format import Trace


class LayerNeeds(NamedTuple):
    """What one layer needs in one pass."""

    keys: list[int]      # the experts its tokens selected, in access order (first appearance, row-major)
    counts: list[int]    # the tokens routed to each
    rounds: list[int]    # the position of each key's first appearance in the rows' [tokens, K] selections:
    #                      token b's rank-r expert is at b * K + r, the replay's round of that request counted
    #                      from the pass's first (trace/flatten.py)
    routed: dict[int, dict[int, int]]  # key -> {request: tokens routed to it}, keys in access order and
    #                                    requests ascending (AccessContext.routed)


def pass_needs(experts: np.ndarray, requests: np.ndarray, rows: np.ndarray, num_experts: int) -> list[LayerNeeds]:
    """What each layer needs in the pass of ``rows``, layer by layer.

    One fancy index and one ``tolist`` per pass, then plain Python over the pass's few selections: a pass
    routes a handful of tokens (decode) to at most a few hundred (prefill), where NumPy's per-call overhead
    (np.unique, argsort) costs more than the work, and this runs once per pass of every timed run."""
    by_layer = experts[rows].transpose(1, 0, 2).tolist()  # [L][tokens][K]
    owners = requests[rows].tolist()
    return [_layer_needs(chosen, owners, layer * num_experts) for layer, chosen in enumerate(by_layer)]


def _layer_needs(chosen: list[list[int]], owners: list[int], base: int) -> LayerNeeds:
    """One layer's needs from its [tokens][K] selections, the request of each token and the layer's first key."""
    if len(chosen) == 1:  # one token: its top-k are distinct, each routed one token of its request
        keys = [base + expert for expert in chosen[0]]
        request = owners[0]
        return LayerNeeds(keys, [1] * len(keys), list(range(len(keys))), {key: {request: 1} for key in keys})
    counts: dict[int, int] = {}  # insertion order is the access order
    rounds: list[int] = []
    routed: dict[int, dict[int, int]] = {}
    position = 0
    for request, selection in zip(owners, chosen):
        for expert in selection:
            key = base + expert
            if key in counts:
                counts[key] += 1
                by_request = routed[key]
                by_request[request] = by_request.get(request, 0) + 1
            else:
                counts[key] = 1
                rounds.append(position)
                routed[key] = {request: 1}
            position += 1
    for key, by_request in routed.items():
        if len(by_request) > 1:  # requests ascending, whatever the order of the rows
            routed[key] = dict(sorted(by_request.items()))
    return LayerNeeds(list(counts), list(counts.values()), rounds, routed)


def layer_needs(experts: np.ndarray, rows: np.ndarray, layer: int, num_experts: int) -> tuple[list[int], list[int]]:
    """The keys layer ``layer`` needs for ``rows`` in access order and the number of tokens routed to each."""
    needs = _layer_needs(experts[rows, layer].tolist(), [0] * len(rows), layer * num_experts)
    return needs.keys, needs.counts


def routed_by_request(experts: np.ndarray, requests: np.ndarray, rows: np.ndarray, layer: int,
                      num_experts: int) -> dict[int, dict[int, int]]:
    """For each key layer ``layer`` needs for ``rows``: the tokens routed to it, by request
    (``AccessContext.routed``)."""
    return _layer_needs(experts[rows, layer].tolist(), requests[rows].tolist(), layer * num_experts).routed


class NextUses:
    """The timed access order of a whole run (fixed with the trace's order: offline policies are refused when
    arrivals make it depend on the timing) and, for the offline policies, each key's next access in it:
    ``at[clock]`` for the access at ``clock``, ``after(key, clock)`` for a key that is not being accessed."""

    def __init__(self, trace: Trace, num_experts: int):
        keys = []
        for rows in trace_iterations(trace):
            for needs in pass_needs(trace.experts, trace.request, rows, num_experts):
                keys += needs.keys
        keys = np.asarray(keys, dtype=np.int64)
        self.at = next_use_times(keys).tolist()
        order = np.argsort(keys, kind="stable")
        cuts = np.flatnonzero(np.diff(keys[order])) + 1
        self.positions = {int(keys[group[0]]): group.tolist() for group in np.split(order, cuts)}

    def after(self, key: int, clock: int) -> int:
        positions = self.positions.get(key, ())
        i = bisect.bisect_right(positions, clock)
        return positions[i] if i < len(positions) else NEVER
