"""TopK: ZeRO-Infinity's prefetching as paper 002 describes it (section 8, "TOPK"): the top-K experts by
expert id of the next layer.

"Top-K by expert id" is read as the K lowest ids: the order in which a parameter-offloading engine that
knows nothing of routing lays the experts out. Before layer 0 it proposes layer 0's, after layer l_now is
routed layer l_now + 1's, in id order (priority (K - rank) / K, so expert 0 first). K defaults to the
model's top-k; paper 002 tunes it per model and reports the best.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import experts_per_layer_option, proposals
from moe_offload.prefetch.base import Prefetcher


class TopKPrefetcher(Prefetcher):
    name = "topk"
    summary = "ZeRO-Infinity: the K lowest expert ids of the next layer"
    source = "paper 002, section 8 (TopK baseline)"

    def __init__(self, spec, k: int | None = None):
        super().__init__(spec)
        self.k = experts_per_layer_option(self.name, k, spec)
        self._priority = (self.k - np.arange(self.k)) / self.k

    def _propose(self, view):
        layer = view.layer_now + 1
        if layer >= self.spec.num_layers:
            return []
        return proposals(layer * self.spec.num_experts + np.arange(self.k), self._priority)

    def on_iteration_start(self, view):
        return self._propose(view)

    def on_layer_routed(self, view):
        return self._propose(view)
