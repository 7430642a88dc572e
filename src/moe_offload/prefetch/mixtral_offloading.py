"""Mixtral-offloading's speculative expert loading (Eliseev and Mazur 2023), as paper 004 runs it among its
baselines (section 4.1): "prefetches the experts for the next layer based on the intermediate value of the
current layer, and caches a subset of experts via the LRU policy with a fixed cache size for all layers".

The guess: layer l+1's router applied to layer l's hidden state (the residual stream changes little from one
layer to the next), which the trace records as the ``gate_prediction`` column. After layer l is routed, each
token contributes its ``k`` highest-scored experts of layer l+1 (default the model's top-k: the experts the
router would select if the guess were right); the union is proposed with priority the predicted probability
(the highest any token gives the expert). Unlike MoEpic (prefetch/moepic.py) it does not guess layer 0 from
the previous token, and its count is fixed rather than what the link carries in the layer's window.

The cache half of the baseline is ``lru-dist``: LRU on a cache split equally among the layers.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import experts_per_layer_option, proposals
from moe_offload.prefetch.base import Prefetcher


class MixtralOffloadingPrefetcher(Prefetcher):
    name = "mixtral-offloading"
    summary = ("speculative: the next layer's router on this layer's hidden state, its top-k experts "
               "(run with --policy lru-dist)")
    source = "paper 004, section 4.1 (Mixtral-offloading baseline, Eliseev and Mazur 2023)"
    requires = ("gate_prediction",)

    def __init__(self, spec, k: int | None = None):
        super().__init__(spec)
        self.k = experts_per_layer_option(self.name, k, spec)

    def on_iteration_start(self, view):
        view.require(type(self))  # without the column every layer would silently get nothing
        return []

    def on_layer_routed(self, view):
        target = view.layer_now + 1
        if target == self.spec.num_layers:  # the next token's layer 0 is not guessed
            return []
        predicted = view.gate_prediction(view.layer_now)  # [tokens, J] of layer target
        top = np.argsort(-predicted, axis=1, kind="stable")[:, :self.k]  # ties to the lower id
        return proposals(target * self.spec.num_experts + top, np.take_along_axis(predicted, top, axis=1))
