"""MoE-Infinity's activation-aware prefetching (paper 002, section 5, Algorithm 1).

``fit(history)`` records the EAM of every sequence (request) of the history and builds the EAMC of
``capacity`` EAMs by K-means with the distance of equation (1) (moe_offload.prefetch.eam). During the run
each sequence has its own current EAM, started empty when the sequence first appears, carried through
all its iterations (Algorithm 1, step 2), and dropped when the driver reports that the request has run its
last iteration (``on_request_end``), so memory is bounded by the running sequences. Rows of several
requests in one iteration (a batch, a batch-recorded trace) each count in their own sequence's EAM. After
layer l is routed (steps 5-8):

* the sequence's EAM row l gains, for every expert, the number of the sequence's tokens routed to it;
* PREFETCH (steps 15-28): the EAM of the EAMC nearest to the current EAM (equation 1, first one met on
  ties) is the predicted EAM; every expert e of every later layer fl = l+1 .. L-1 is submitted with priority

      ``(p_eam[fl][e] / sum(p_eam[fl]) + EPSILON) * (1 - fl / L)``

  (the experts of layers already passed are never resubmitted, and the queue replaces the priority of an
  expert already queued: the refinement at every layer).

With several sequences in one iteration each is matched on its own EAM and an expert keeps the highest
priority any of them gives it. Algorithm 1 calls PREFETCH only after a layer is routed, so layer 0 of an
iteration is never prefetched (nothing is proposed before it). The EAMC is the one ``fit`` built; paper
002 rebuilds it in the background when the workload drifts, which a run here does not do. Without a
``fit`` history there is no EAMC and the first iteration raises ConfigError: the method has nothing to
predict from.

The search (``search="exhaustive"``, the default) computes equation (1) against every EAM of the EAMC over
all L rows at every layer. ``search="incremental"`` keeps each sequence's cosines layer by layer and
recomputes only the routed layer's (moe_offload.prefetch.eam): it reads 1/L of the EAMC per layer, and
its distances equal the exhaustive ones in exact arithmetic but are summed in another float32 order, so a
near-tie between two EAMs can go the other way.

The search sits on the inference path (Algorithm 1 runs PREFETCH before the layer's experts), so
``search_on_inference_path`` is True; ``last_search_seconds`` is the time of steps 15-28 for the
iteration's sequences (moe_offload.prefetch.search_cost).
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.moe_infinity import EPSILON
from moe_offload.prefetch._shared import RequestGroups, check_same_model, proposals
from moe_offload.prefetch.base import Prefetcher
from moe_offload.prefetch.eam import EAMCollection, build_eamc, sequence_eams
from moe_offload.prefetch.search_cost import TimedSearch
from moe_offload.values import integer

DEFAULT_CAPACITY = 300  # paper 002, section 8: "hundreds of EAMs"; its overhead measurement uses 300
SEARCHES = ("exhaustive", "incremental")


class MoEInfinityPrefetcher(TimedSearch, Prefetcher):
    name = "moe-infinity"
    summary = ("nearest EAM of the EAMC (K-means, equation 1); every later layer's experts with priority "
               "(ratio + eps) * (1 - layer/L), refined at every layer")
    source = "paper 002, section 5, Algorithm 1"
    search_on_inference_path = True
    needs_history = True

    def __init__(self, spec, capacity: int = DEFAULT_CAPACITY, seed: int = 0, search_seconds: float | None = None,
                 search: str = "exhaustive"):
        super().__init__(spec)
        self.capacity = integer(capacity, f"{self.name}.capacity", low=1)
        self.seed = integer(seed, f"{self.name}.seed", low=0)
        self._set_search_seconds(search_seconds)
        if search not in SEARCHES:
            raise ConfigError(f"{self.name}: search must be one of {', '.join(SEARCHES)}, not {search!r}")
        self.search = search
        L, J = spec.num_layers, spec.num_experts
        self.eamc = EAMCollection(np.zeros((0, L, J), dtype=np.int64))
        self._priority = np.zeros((0, L, J))
        self._current: dict[int, np.ndarray] = {}  # request id -> its EAM [L, J] so far
        self._similarities: dict[int, np.ndarray] = {}  # incremental: request id -> its cosines by layer [L, P]

    def fit(self, history):
        check_same_model(self.spec, history, self.name)
        _, eams = sequence_eams(history)
        self.eamc = EAMCollection(eams[build_eamc(eams, self.capacity, self.seed)])
        L = self.spec.num_layers
        rows = self.eamc.eams.astype(np.float64)
        ratio = rows / rows.sum(axis=2, keepdims=True)  # every row of a recorded EAM counts its tokens, > 0
        self._priority = (ratio + EPSILON) * (1.0 - np.arange(L) / L)[None, :, None]

    def current_eam(self, request: int) -> np.ndarray:
        """The EAM of sequence ``request`` so far (zeros before it is seen)."""
        return self._current.get(int(request), np.zeros((self.spec.num_layers, self.spec.num_experts), np.int64))

    def on_request_end(self, request):
        self._current.pop(int(request), None)
        self._similarities.pop(int(request), None)

    def on_iteration_start(self, view):
        if len(self.eamc) == 0:
            raise ConfigError(f"{self.name} has no EAMC to search: it builds one from past sequences, so give it a "
                              "history (fit(history); `moe-offload simulate --timed --history TRACE`)")
        self._no_search()
        return []

    def on_layer_routed(self, view):
        L, J, layer = self.spec.num_layers, self.spec.num_experts, view.layer_now
        groups = RequestGroups(view.requests)
        selected = view.selected(layer).astype(np.int64)
        counts = np.bincount((groups.inverse[:, None] * J + selected).reshape(-1),
                             minlength=len(groups) * J).reshape(len(groups), J)
        requests = groups.requests.tolist()
        current = []
        for request, row in zip(requests, counts):
            eam = self._current.setdefault(request, np.zeros((L, J), dtype=np.int64))
            eam[layer] += row
            current.append(eam)
        incremental = self.search == "incremental"
        if layer == L - 1 and not incremental:
            self._no_search()
            return []
        with self._timed_search():
            if incremental:  # only row ``layer`` changed: recompute its term, then add the L terms
                terms = self.eamc.layer_similarities(layer, np.stack([eam[layer] for eam in current]))
                kept = []
                for request, term in zip(requests, terms):
                    similarities = self._similarities.get(request)
                    if similarities is None:
                        similarities = self._similarities[request] = np.zeros((L, len(self.eamc)), np.float32)
                    similarities[layer] = term
                    kept.append(similarities)
                if layer == L - 1:  # the term is kept for the next iteration; nothing later to prefetch
                    return []
                predicted, _ = self.eamc.nearest_from_layers(np.stack(kept))
            else:
                predicted, _ = self.eamc.nearest(np.stack(current))
            later = self._priority[predicted, layer + 1:].reshape(len(groups), -1)
            keys = np.broadcast_to(np.arange((layer + 1) * J, L * J), later.shape)
            result = proposals(keys, later)
        return result
