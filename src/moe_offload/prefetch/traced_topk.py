"""Traced-TopK: BrainStorm's prefetching as paper 002 describes it (section 8, "TRACED-TOPK"): trace how
often each expert is used and prefetch the K most popular experts of the next layer.

Popularity is the count of selections of each expert, per layer, over the ``fit()`` history and then
over every iteration of the run as it ends (the trace is updated online). Before layer 0 it proposes
layer 0's K most popular experts, after layer l_now is routed layer l_now + 1's, each with priority its
share of the layer's counted selections (the most popular first; ties go to the lower id, and with no
history at all it proposes the K lowest ids, like TopK). K defaults to the model's top-k; paper 002
tunes it and reports the best.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import check_same_model, experts_per_layer_option, proposals
from moe_offload.prefetch.base import Prefetcher


class TracedTopKPrefetcher(Prefetcher):
    name = "traced-topk"
    summary = "BrainStorm: the K most popular experts of the next layer (counted on history, updated online)"
    source = "paper 002, section 8 (Traced-TopK baseline)"

    def __init__(self, spec, k: int | None = None):
        super().__init__(spec)
        self.k = experts_per_layer_option(self.name, k, spec)
        self.counts = np.zeros((spec.num_layers, spec.num_experts), dtype=np.int64)

    def _count(self, layer_experts: np.ndarray) -> None:
        """Add the selections of ``layer_experts`` [tokens, L, K] to the counts."""
        L, J = self.spec.num_layers, self.spec.num_experts
        flat = (np.arange(L)[None, :, None] * J + layer_experts.astype(np.int64)).reshape(-1)
        self.counts += np.bincount(flat, minlength=L * J).reshape(L, J)

    def fit(self, history):
        check_same_model(self.spec, history, self.name)
        self._count(history.experts)

    def _propose(self, view):
        layer = view.layer_now + 1
        if layer >= self.spec.num_layers:
            return []
        counts = self.counts[layer]
        popular = np.argsort(-counts, kind="stable")[:self.k]  # stable: ties to the lower id
        share = counts[popular] / max(int(counts.sum()), 1)
        return proposals(layer * self.spec.num_experts + popular, share)

    def on_iteration_start(self, view):
        return self._propose(view)

    def on_layer_routed(self, view):
        return self._propose(view)

    def on_iteration_end(self, view):
        self._count(np.stack([view.selected(layer) for layer in range(self.spec.num_layers)], axis=1))
