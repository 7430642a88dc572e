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

import numpy as np

from moe_offload.simulator.timed.schedule import trace_iterations
from moe_offload.trace.flatten import NEVER, next_use_times
from moe_offload.trace.format import Trace


def layer_needs(experts: np.ndarray, rows: np.ndarray, layer: int, num_experts: int) -> tuple[list[int], list[int]]:
    """The keys layer ``layer`` needs for ``rows`` in access order (first appearance over the rows' [tokens,
    K] selections, row-major) and the number of tokens routed to each."""
    keys, counts, _ = layer_needs_with_rounds(experts, rows, layer, num_experts)
    return keys, counts


def layer_needs_with_rounds(experts: np.ndarray, rows: np.ndarray, layer: int,
                            num_experts: int) -> tuple[list[int], list[int], list[int]]:
    """``layer_needs`` and, for each key, the position of its first appearance in the rows' [tokens, K]
    selections, row-major: token b's rank-r expert is at b * K + r, the replay's round of that request
    counted from the pass's first (trace/flatten.py)."""
    selected = experts[rows, layer]
    if selected.shape[0] == 1:
        ids = selected[0].astype(np.int64)
        return (ids + layer * num_experts).tolist(), [1] * ids.size, list(range(ids.size))
    flat = selected.reshape(-1).astype(np.int64)
    unique, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(first)
    return (unique[order] + layer * num_experts).tolist(), counts[order].tolist(), first[order].tolist()


def routed_by_request(experts: np.ndarray, requests: np.ndarray, rows: np.ndarray, layer: int,
                      num_experts: int) -> dict[int, dict[int, int]]:
    """For each key layer ``layer`` needs for ``rows``: the tokens routed to it, by request
    (``AccessContext.routed``)."""
    selected = experts[rows, layer].astype(np.int64)
    if selected.shape[0] == 1:
        request = int(requests[rows[0]])
        return {int(e) + layer * num_experts: {request: 1} for e in selected[0]}
    keys = selected.reshape(-1) + layer * num_experts
    owners = np.repeat(requests[rows].astype(np.int64), selected.shape[1])
    pairs, counts = np.unique(np.stack([keys, owners]), axis=1, return_counts=True)
    routed: dict[int, dict[int, int]] = {}
    for key, request, count in zip(pairs[0].tolist(), pairs[1].tolist(), counts.tolist()):
        routed.setdefault(key, {})[request] = count
    return routed


class NextUses:
    """The timed access order of a whole run (fixed with the trace's order: offline policies are refused when
    arrivals make it depend on the timing) and, for the offline policies, each key's next access in it:
    ``at[clock]`` for the access at ``clock``, ``after(key, clock)`` for a key that is not being accessed."""

    def __init__(self, trace: Trace, num_layers: int, num_experts: int):
        keys = []
        for rows in trace_iterations(trace):
            for layer in range(num_layers):
                keys += layer_needs(trace.experts, rows, layer, num_experts)[0]
        keys = np.asarray(keys, dtype=np.int64)
        self.at = next_use_times(keys).tolist()
        order = np.argsort(keys, kind="stable")
        cuts = np.flatnonzero(np.diff(keys[order])) + 1
        self.positions = {int(keys[group[0]]): group.tolist() for group in np.split(order, cuts)}

    def after(self, key: int, clock: int) -> int:
        positions = self.positions.get(key, ())
        i = bisect.bisect_right(positions, clock)
        return positions[i] if i < len(positions) else NEVER
