"""MoEpic's speculative prefetcher (paper 004, section 3.2).

Thanks to the residual stream, layer i's hidden state resembles layer i+1's, so MoEpic feeds layer i's
hidden state to layer i+1's router (equation 3) and prefetches layer i+1's experts "one by one in
descending order of their predicted scores" until layer i+1's router fires and "terminates the prefetch
operation". The trace records that early router output as the ``gate_prediction`` column. "Since the first
layer lacks previous results", layer 0 is predicted, following AdapMoE, from "the last layer's intermediate
activation of [the] previous token": the ``next_token_gate_prediction`` column, layer 0's router applied to
the last layer's hidden state of a token, which predicts layer 0 of the request's next token.

After layer l_now is routed the target is layer l_now + 1, or, after the last layer, layer 0 of the next
iteration (proposals made after the last router are for the next pass, prefetch/base.py). Each token
contributes its Y highest-scored experts of the target (for layer 0: the last token of each request in this
pass, whose successor the next pass feeds); the union is proposed with priority the predicted probability
(the highest any token gives the expert), so the queue fetches in descending predicted score, and what has
not started when the target's router fires is dropped by the driver, as the paper stops prefetching there.

Y, the number of experts a layer's prefetch reaches, is the paper's own:

* with a split configuration (`moe-offload configure`, run by `simulate --timed --split-config`), the count
  Y_l of equation 11, the most predicted experts whose (bottom or whole) loads fit in the layer's window:
  it may exceed K when bottom segments are small or the window is long;
* without one, the whole-expert loads that complete on the link before the target's router fires,
  floor(window / load): the same equation 11 for experts that are not split, with the window of equation 7
  with every expert loaded, from the hardware (moe_offload.prefetch.budget); 0 when not one load fits, as
  the configurator's Y can be (a load still on the wire when the router fires would be terminated);
* ``prefetches=N`` fixes it for every layer; a driver that gives no budget gets top-k. The timed simulator
  and the runtime both give one, from the same hardware profile, so both prefetch the same Y.

A trace without ``next_token_gate_prediction`` (recorded before the column existed) leaves layer 0 to the
cache and on-demand loads.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import proposals
from moe_offload.prefetch.base import Prefetcher
from moe_offload.prefetch.budget import PrefetchBudget
from moe_offload.values import integer


class MoEpicPrefetcher(Prefetcher):
    name = "moepic"
    summary = ("speculative: the next layer's router on this layer's hidden state (layer 0 from the previous "
               "token's last layer); Y experts per layer in descending predicted score")
    source = "paper 004, section 3.2 (Speculative Prefetcher) and equation 11 (Y)"
    requires = ("gate_prediction",)

    def __init__(self, spec, prefetches: int | None = None):
        super().__init__(spec)
        self.fixed = None if prefetches is None else integer(prefetches, f"{self.name}.prefetches", low=1)
        self.budget: PrefetchBudget | None = None

    def set_budget(self, budget):
        self.budget = budget

    def prefetches_for(self, layer: int) -> int:
        """Y for ``layer``: the option, else the configuration's, else what the link carries in the layer's
        window, else top-k (module doc); at most the layer's J experts."""
        budget = self.budget
        if self.fixed is not None:
            count = self.fixed
        elif budget is None:
            count = self.spec.top_k
        elif budget.prefetches is not None:
            count = budget.prefetches[layer]
        else:
            count = budget.loads_in_window(layer)
        return min(count, self.spec.num_experts)

    def on_iteration_start(self, view):
        view.require(type(self))  # without the column every layer would silently get nothing
        return []

    def on_layer_routed(self, view):
        now, L, J = view.layer_now, self.spec.num_layers, self.spec.num_experts
        predicted = view.gate_prediction(now)  # [tokens, J] of the next layer in pass order, or None
        if predicted is None:
            return []
        target = (now + 1) % L
        if target == 0:  # each request's next token follows the last token this pass fed it
            requests, positions = view.requests, view.positions
            order = np.lexsort((positions, requests))
            ordered = requests[order]
            last = order[np.concatenate((ordered[1:] != ordered[:-1], [True]))]  # np.r_ parses its index at every call
            predicted = predicted[last]
        count = self.prefetches_for(target)
        if count == 0:
            return []
        top = np.argsort(-predicted, axis=1, kind="stable")[:, :count]  # ties to the lower id
        scores = predicted[np.arange(top.shape[0])[:, None], top]  # np.take_along_axis, without its index checks
        return proposals(target * J + top, scores, distinct=top.shape[0] == 1)  # one token's top are distinct
