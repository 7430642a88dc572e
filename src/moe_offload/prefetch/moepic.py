"""MoEpic's speculative prefetcher (paper 004, section 3.2).

Thanks to the residual stream, layer l's hidden state resembles layer l+1's, so MoEpic feeds layer l's
hidden state to layer l+1's router while layer l runs, and prefetches layer l+1's experts "one by one in
descending order of their predicted scores". The trace records that early router output as the
``gate_prediction`` column: entry l is the predicted distribution of layer l+1.

After layer l_now is routed, each token of the iteration contributes its ``k`` highest-scored experts of
layer l_now + 1 (k defaults to the model's top-k); the union is proposed with priority the predicted
probability (the highest any token gives the expert), so the queue fetches in descending predicted score.
Layer 0 gets no speculative prefetch: MoEpic predicts it from the previous token's last hidden state
(following AdapMoE), which the trace does not record, so it is left to the cache and on-demand loads.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import experts_per_layer_option, proposals
from moe_offload.prefetch.base import Prefetcher


class MoEpicPrefetcher(Prefetcher):
    name = "moepic"
    summary = "speculative: layer l+1's router on layer l's hidden state; its top-k experts by predicted score"
    source = "paper 004, section 3.2 (Speculative Prefetcher)"
    requires = ("gate_prediction",)

    def __init__(self, spec, k: int | None = None):
        super().__init__(spec)
        self.k = experts_per_layer_option(self.name, k, spec)

    def on_iteration_start(self, view):
        view.require(type(self))  # without the column every layer would silently get nothing
        return []

    def on_layer_routed(self, view):
        predicted = view.gate_prediction(view.layer_now)  # [tokens, J] of layer layer_now + 1, or None
        if predicted is None:  # the last layer has no next layer
            return []
        J = self.spec.num_experts
        top = np.argsort(-predicted, axis=1, kind="stable")[:, :self.k]  # ties to the lower id
        scores = np.take_along_axis(predicted, top, axis=1)
        return proposals((view.layer_now + 1) * J + top, scores)
