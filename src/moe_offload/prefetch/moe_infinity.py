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
iteration is never prefetched (nothing is proposed before it). Without a ``fit`` history there is no EAMC
and the first iteration raises ConfigError: the method has nothing to predict from.

Distribution shift (sections 4.3 and 8.5). The EAMC is the one ``fit`` built unless ``rebuild_after=N`` is
given. Then, as the paper does, the run records "input sequences with insufficient performance" and adds
them to the dataset the EAMC is built from, and reruns the construction once N have been recorded since the
last build (the paper's experiment rebuilds after 100 sequences of the new dataset). A sequence's
performance is how well the EAMC covers it, since the prediction is its nearest EAM: when it ends, its whole
EAM's distance (equation 1) to the nearest EAM of the EAMC; above ``rebuild_distance`` (default 0.5: less
than half the cosine, averaged over the layers) it is recorded. The paper builds in the background while
10-13 more sequences run on the old EAMC; here the new one serves from the next iteration on. The dataset
keeps every recorded EAM (one [L, J] matrix of counts per sequence).

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
from moe_offload.values import integer, number

DEFAULT_REBUILD_DISTANCE = 0.5
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
                 search: str = "exhaustive", rebuild_after: int | None = None,
                 rebuild_distance: float = DEFAULT_REBUILD_DISTANCE):
        super().__init__(spec)
        self.capacity = integer(capacity, f"{self.name}.capacity", low=1)
        self.rebuild_after = None if rebuild_after is None else integer(rebuild_after, f"{self.name}.rebuild_after",
                                                                        low=1)
        self.rebuild_distance = number(rebuild_distance, f"{self.name}.rebuild_distance", low=0, high=1)
        self._dataset: list[np.ndarray] = []  # the EAMs [N, L, J] the EAMC is built from: history, then recorded
        self.recorded = 0  # sequences recorded since the last build
        self.rebuilds = 0
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
        self._dataset = [eams]
        self._build(eams)

    def _build(self, eams: np.ndarray) -> None:
        """The EAMC of ``eams`` by K-means and its priorities; the running sequences' incremental cosines are
        recomputed against it when next needed."""
        self.eamc = EAMCollection(eams[build_eamc(eams, self.capacity, self.seed)])
        self._similarities.clear()
        L = self.spec.num_layers
        rows = self.eamc.eams.astype(np.float64)
        ratio = rows / rows.sum(axis=2, keepdims=True)  # every row of a recorded EAM counts its tokens, > 0
        self._priority = (ratio + EPSILON) * (1.0 - np.arange(L) / L)[None, :, None]

    def current_eam(self, request: int) -> np.ndarray:
        """The EAM of sequence ``request`` so far (zeros before it is seen)."""
        return self._current.get(int(request), np.zeros((self.spec.num_layers, self.spec.num_experts), np.int64))

    def on_request_end(self, request):
        eam = self._current.pop(int(request), None)
        self._similarities.pop(int(request), None)
        if self.rebuild_after is None or eam is None or len(self.eamc) == 0:
            return
        _, distance = self.eamc.nearest(eam[None])
        if distance[0] <= self.rebuild_distance:
            return
        self._dataset.append(eam[None])
        self.recorded += 1
        if self.recorded >= self.rebuild_after:
            eams = np.concatenate(self._dataset)
            self._dataset = [eams]
            self._build(eams)
            self.recorded = 0
            self.rebuilds += 1

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
                    if similarities is None:  # a new sequence (zero rows: cosines 0), or a rebuilt EAMC
                        eam = self._current[request]
                        similarities = self._similarities[request] = np.stack(
                            [self.eamc.layer_similarities(row, eam[row][None])[0] for row in range(L)])
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
