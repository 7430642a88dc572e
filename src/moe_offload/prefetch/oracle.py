"""The oracle prefetcher: knows the experts the next layers will select, the bound for every real one.

Before layer 0 and after each layer l_now is routed it proposes the true experts (the union over the
iteration's tokens) of the next ``distance`` layers, l_now + 1 .. l_now + distance, with priority
1 / (l - l_now): the nearer the layer, the sooner it is fetched, and every expert of one layer alike.
Proposals are resubmitted at every layer, so an expert queued for a far layer is raised as the
computation approaches it. It never mispredicts; it can still be late (bandwidth) or evict too early
(the eviction policy decides), which is exactly the gap the timed simulator reports.
"""

from __future__ import annotations

from moe_offload.prefetch.base import Prefetcher, Proposal, RoutingView, proposal_list
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
        self._pass: tuple | None = None  # (view, iteration) whose keys _keys_of_layer holds
        self._keys_of_layer: dict[int, list[int]] = {}

    def _propose(self, view: RoutingView) -> list[Proposal]:
        """The next layers' keys, nearer layers first, each layer's keys ascending: what ``proposals`` (_shared.py)
        makes of them, built directly because no key repeats (each layer's are distinct and the layers differ)."""
        now = view.layer_now
        keys, priorities = [], []
        for layer in range(now + 1, min(now + self.distance, self.spec.num_layers - 1) + 1):
            layer_keys = self._layer_keys(view, layer)
            keys += layer_keys
            priorities += [1.0 / (layer - now)] * len(layer_keys)
        return proposal_list(keys, priorities)

    def _layer_keys(self, view: RoutingView, layer: int) -> list[int]:
        """The distinct keys ``layer`` selects in ``view``'s pass, ascending; kept for the pass, since each layer
        is proposed from ``distance`` successive hooks."""
        if self._pass != (view, view.iteration):
            self._pass, self._keys_of_layer = (view, view.iteration), {}
        keys = self._keys_of_layer.get(layer)
        if keys is None:
            base = layer * self.spec.num_experts
            keys = self._keys_of_layer[layer] = [base + expert for expert in
                                                 sorted(set(view.oracle_selected(layer).ravel().tolist()))]
        return keys

    def on_iteration_start(self, view):
        return self._propose(view)

    def on_layer_routed(self, view):
        return self._propose(view)
