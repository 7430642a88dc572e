"""Pre-gated MoE (Hwang et al. 2024), as paper 004 runs it among its baselines (section 4.1): it "trains a
pre-gated function for each layer to predict the activated experts for the next layer. The predicted experts
are prefetched into VRAM in parallel with the computation of the current layer", and it keeps no expert cache
("there are no cached experts in Pre-gated MoE", section 4.2).

Pre-gating changes the model: layer l's gate selects layer l+1's experts, so the selection is exact by
construction, one layer ahead. On a trace of an ordinary model that is the trace's own selection of layer
l+1, read when layer l is routed: after layer l is routed it proposes the experts that layer l+1 selects
(the union over the iteration's tokens), all with priority 1, and nothing further ahead. Layer 0 has no
layer before it and is loaded on demand, as in the paper (its first block's gate selects layers 0 and 1).

Reading layer l+1's selection early is reading the future of a model that was not pre-gated, so the
prefetcher is a bound for simulators and replays (``reads_future``), not something a live ordinary model
can run. The no-cache half: a cache of two layers' experts (the current one's and the prefetched next
one's), so nothing survives until the layer comes again.
"""

from __future__ import annotations

import numpy as np

from moe_offload.prefetch._shared import proposals
from moe_offload.prefetch.base import Prefetcher


class PreGatedPrefetcher(Prefetcher):
    name = "pre-gated"
    reads_future = True
    summary = ("Pre-gated MoE: the next layer's experts, selected exactly one layer ahead (run with a cache of "
               "two layers' experts)")
    source = "paper 004, section 4.1 (Pre-gated MoE baseline, Hwang et al. 2024)"

    def on_layer_routed(self, view):
        target = view.layer_now + 1
        if target == self.spec.num_layers:
            return []
        experts = np.unique(view.oracle_selected(target)).astype(np.int64)
        return proposals(target * self.spec.num_experts + experts, np.ones(experts.size), distinct=True)
