"""The oracle prefetcher: knows the experts the next layers will select, the bound for every real one.

Before layer 0 and after each layer l_now is routed it proposes the true experts (the union over the
iteration's tokens) of the next ``distance`` layers, l_now + 1 .. l_now + distance, with priority
1 / (l - l_now): the nearer the layer, the sooner it is fetched, and every expert of one layer alike.
Proposals are resubmitted at every layer, so an expert queued for a far layer is raised as the
computation approaches it. It never mispredicts; it can still be late (bandwidth) or evict too early
(the eviction policy decides), which is exactly the gap the timed simulator reports.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import proposals
from moe_offload.prefetch.base import Prefetcher, Proposal, RoutingView
from moe_offload.values import integer

DEFAULT_DISTANCE = 3


class OraclePrefetcher(Prefetcher):
    name = "oracle"
    reads_future = True
    summary = "knows the future: the true experts of the next `distance` layers, nearer layers first"
    source = "the bound for every prefetcher; paper 002, section 8, bounds its caching by an oracle"

    def __init__(self, spec, distance: int = DEFAULT_DISTANCE):
        super().__init__(spec)
        self.distance = integer(distance, f"{self.name}.distance", low=1)

    def _propose(self, view: RoutingView) -> list[Proposal]:
        J, now = self.spec.num_experts, view.layer_now
        keys, priorities = [], []
        for layer in range(now + 1, min(now + self.distance, self.spec.num_layers - 1) + 1):
            experts = np.unique(view.oracle_selected(layer))
            keys.append(layer * J + experts.astype(np.int64))
            priorities.append(np.full(experts.size, 1.0 / (layer - now)))
        if not keys:
            return []
        return proposals(np.concatenate(keys), np.concatenate(priorities))

    def on_iteration_start(self, view):
        return self._propose(view)

    def on_layer_routed(self, view):
        return self._propose(view)
