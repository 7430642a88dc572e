"""fMoE's expert-map prefetcher (paper 000: expert maps, expert map search, similarity-aware prefetching,
Expert Map Store).

Per iteration, for every request b of the batch (0-based layers here, the paper's are 1-based):

* before layer 0: semantic search of the store by the request's semantic embedding of this iteration
  (below); the best map's layers
  0 .. d-1 are the predictions of those layers, with the semantic score;
* after layer l_now is routed, for l_now + d <= L - 1: trajectory search by the distributions observed in
  layers 0 .. l_now; the best map's layer l_now + d is the prediction of that layer, with the trajectory
  score. Every layer is thus predicted once, d layers ahead (the first d from the prompt alone).
* prefetch set of a target layer t from its predicted distribution p and score: delta = clip(1 - score,
  0, 1); the smallest set of highest-probability experts whose probabilities sum to at least delta, and at
  least K experts (ties: lower id first);
* priority p / (t - l_now). After every layer the sets of all targets still ahead within the prefetch
  distance, l_now + 1 .. l_now + d, are resubmitted with l_now updated, so an expert queued for a far layer
  rises as the computation approaches it (the queue replaces the priority of a queued expert).

With several requests in one iteration an expert keeps the highest priority any of them gives it, and
``predicted_map()`` (fMoE's eviction priority reads it) is the element-wise maximum of the requests'
predicted maps: per layer, the searched row predicting it, or the semantic map's row until the trajectory
search for that layer has run.

The store (moe_offload.prefetch.expert_map_store) is filled by ``fit(history)`` with one entry per
(iteration, request) of the history, added in batches of up to FIT_BATCH entries, and then, as each
iteration of the run ends, with that iteration's entries; at capacity the redundancy score decides which
stored entry each new one replaces, reusing the scores the iteration's searches computed (the store reads
each of its bytes once per iteration). An empty store (no history yet) proposes nothing. The capacity C, unless
``capacity`` sets it, follows the paper's sizing guidance (``default_capacity``).

Options of the store (all off by default; expert_map_store says what each costs and saves):
``embedding_dims=N`` keeps a fixed random projection of the embeddings, ``candidates=M`` runs the
trajectory search and the deduplication over each request's M best semantic entries only,
``map_dtype="float16"`` (with ``candidates``) halves the maps' memory, ``lists=N`` (with ``candidates``;
``probes=P``) finds the candidates through a coarse quantizer that reads about P / N of the stored
embeddings (approximate); ``seed`` seeds the projection and the quantizer's k-means.
benchmarks/map_search.py measures their speed, the README their effect on hit rates and precision.

The semantic embedding of an iteration. The paper records "the semantic embeddings for each inference
iteration", "using the output from the model's original embedding layer", one vector of the hidden size
per prompt of the batch. The trace holds that output for every token (its ``embedding`` column), and the
iteration's embedding of a request pools the rows of the tokens the iteration feeds the model:

* ``semantic="iteration"`` (default): the mean of the embedding layer's output over this iteration's input,
  the prompt's tokens in prefill (mean pooling keeps the size fixed across prompt lengths) and the one new
  token in decode: literally what the embedding layer outputs in that iteration;
* ``semantic="request"``: the mean over every token the request has fed so far, prompt and generated (the
  sentence-embedding mean pooling that the paper's draft of the section names for decode iterations).

The paper's final text supports the first reading; the second is offered because its draft does. With it a
request's consecutive iterations differ by one token in the mean, so from its second iteration on a request
mostly finds its own previous iteration with a score near 1 (delta near 0: the K most probable experts of
its latest map), which is what the first reading avoids. A trace of format version 1 holds the prompt's
mean on every row instead of each token's embedding; it is refused (prefetch/requirements.py), since every
iteration of a request would match the others with score 1.

Both searches need what they search by: the trace must have full router probabilities (the maps) and
token embeddings (the semantic keys). Paper 000 designs the two searches together and does not describe
a trajectory-only variant, so a trace without embeddings is refused (moe_offload.prefetch.requirements
says how to record one) rather than approximated.

The matcher is asynchronous (``search_on_inference_path`` False): ``last_search_seconds`` is the time of
each hook's search and set selection, or of the store update in ``on_iteration_end``
(moe_offload.prefetch.search_cost), which the timed simulator charges on the matcher's own timeline; the
runtime calls the hooks on a matcher thread and applies the proposals when they arrive (runtime/matcher.py).
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.prefetch._shared import RequestGroups, check_same_model
from moe_offload.prefetch.base import Prefetcher, proposal_list
from moe_offload.prefetch.expert_map_store import DEFAULT_PROBES, ExpertMapStore, IterationSearch
from moe_offload.prefetch.fmoe_sets import compiled_set_functions
from moe_offload.prefetch.requirements import check_trace_columns
from moe_offload.prefetch.search_cost import TimedSearch
from moe_offload.values import integer

DEFAULT_DISTANCE = 3
SEMANTIC_POOLINGS = ("iteration", "request")
FIT_BATCH = 256        # entries per redundancy computation while filling the store from history
FIT_CHUNK_ROWS = 1 << 15  # history rows converted to float32 at a time


def default_capacity(num_layers: int, num_experts: int) -> int:
    """The store capacity C of paper 000's sizing guidance (Expert Map Store Management, "Theoretical analysis"),
    with LJ the model's expert count: at least 2LJ maps guarantee a stored map at least 75% similar to any new
    iteration, and 1/2 LJ ln(LJ) maps 98%. C is the larger: the 98% bound once LJ >= e^4 (about 55 experts,
    every real MoE model), and never under the 75% bound for the smaller models, where 1/2 ln(LJ) < 2."""
    experts = num_layers * num_experts
    return max(2 * experts, math.ceil(0.5 * experts * math.log(experts)))


class SemanticPooling:
    """The semantic embeddings of (iteration, request) groups from the sums of their tokens' embeddings
    (module doc); ``request`` pooling keeps each request's running sum, so groups must come in iteration
    order and one instance serves one stream of requests (the history's, or the run's)."""

    def __init__(self, mode: str):
        self.mode = mode
        self._sums: dict[int, np.ndarray] = {}
        self._counts: dict[int, int] = {}

    def __call__(self, requests: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """[G, D] embeddings of groups with request ids ``requests`` [G], embedding sums ``sums`` [G, D] and
        token counts ``counts`` [G]."""
        sums = np.asarray(sums, dtype=np.float64)
        counts = np.asarray(counts, dtype=np.float64)
        if self.mode == "iteration":
            return (sums / counts[:, None]).astype(np.float32)
        pooled = np.empty(sums.shape, dtype=np.float32)
        for group, request in enumerate(np.asarray(requests).tolist()):
            total = self._sums.get(request, 0.0) + sums[group]
            count = self._counts.get(request, 0) + counts[group]
            self._sums[request], self._counts[request] = total, count
            pooled[group] = total / count
        return pooled

    def forget(self, request: int) -> None:
        """``request`` has ended: its running sum goes."""
        self._sums.pop(request, None)
        self._counts.pop(request, None)


class FMoEPrefetcher(TimedSearch, Prefetcher):
    name = "fmoe"
    summary = ("expert maps: semantic search for the first d layers, trajectory search after; similarity-aware "
               "set, priority p / (l - l_now)")
    source = "paper 000, Expert Map Search, Expert Prefetching, Expert Map Store Management"
    requires = ("probs", "embedding")
    search_on_inference_path = False

    def __init__(self, spec, capacity: int | None = None, distance: int = DEFAULT_DISTANCE,
                 search_seconds: float | None = None, semantic: str = "iteration",
                 embedding_dims: int | None = None, candidates: int | None = None, map_dtype: str = "float32",
                 lists: int | None = None, probes: int = DEFAULT_PROBES, seed: int = 0):
        super().__init__(spec)
        self.capacity = (default_capacity(spec.num_layers, spec.num_experts) if capacity is None
                         else integer(capacity, f"{self.name}.capacity", low=1))
        self.distance = integer(distance, f"{self.name}.distance", low=1)
        if semantic not in SEMANTIC_POOLINGS:
            raise ConfigError(f"{self.name}: semantic must be one of {', '.join(SEMANTIC_POOLINGS)}, not {semantic!r}")
        self.semantic = semantic
        self._pooling = SemanticPooling(semantic)  # the run's requests
        self._semantic: np.ndarray | None = None     # [B, D] of the current iteration
        self._set_search_seconds(search_seconds)
        seed = integer(seed, f"{self.name}.seed", low=0)
        if embedding_dims is not None:
            embedding_dims = integer(embedding_dims, f"{self.name}.embedding_dims", low=1)
        if candidates is not None:
            candidates = integer(candidates, f"{self.name}.candidates", low=1)
        if lists is not None:
            lists = integer(lists, f"{self.name}.lists", low=1)
        probes = integer(probes, f"{self.name}.probes", low=1)
        try:
            self.store = ExpertMapStore(spec.num_layers, spec.num_experts, self.capacity, self.distance,
                                        embedding_dims=embedding_dims, candidates=candidates, map_dtype=map_dtype,
                                        lists=lists, probes=probes, seed=seed)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None
        self._groups: RequestGroups | None = None
        self._search: IterationSearch | None = None
        # Per target layer of the current iteration, once searched: its prefetch set over the batch, as keys and
        # the highest p any request gives each, by decreasing p (fmoe_sets); the priority p / (t - l_now)
        # follows at proposal time.
        L, J = spec.num_layers, spec.num_experts
        self._set_keys, self._set_wanted = np.zeros((L, J), dtype=np.int64), np.zeros((L, J))
        self._set_sizes = np.zeros(L, dtype=np.int64)
        self._proposal_keys, self._proposal_priorities = np.empty(self.distance * J, dtype=np.int64), np.empty(
            self.distance * J)
        self._similarity_aware_set, self._ranked_proposals = compiled_set_functions()
        self._predicted: np.ndarray | None = None  # [L, J]

    # ------------------------------------------------------------------------------------------ history

    def fit(self, history):
        check_trace_columns(type(self), history)
        check_same_model(self.spec, history, self.name)
        L, J = self.spec.num_layers, self.spec.num_experts
        pooling = SemanticPooling(self.semantic)  # the history's requests, apart from the run's
        order = np.lexsort((history.request, history.iteration))
        iteration, request = history.iteration[order], history.request[order]
        starts = np.flatnonzero(np.r_[True, (np.diff(iteration) != 0) | (np.diff(request) != 0)])
        n = order.size
        # Chunks of whole (iteration, request) groups, about FIT_CHUNK_ROWS rows each.
        chunk_starts = np.unique(starts[np.searchsorted(starts, np.arange(0, n, FIT_CHUNK_ROWS), side="right") - 1])
        bounds = np.r_[chunk_starts, n]
        for begin, end in zip(bounds[:-1], bounds[1:]):
            rows = order[begin:end]
            group_starts = starts[(starts >= begin) & (starts < end)] - begin
            sizes = np.diff(np.r_[group_starts, end - begin])[:, None]
            maps = np.add.reduceat(history.probs[rows].astype(np.float32).reshape(rows.size, L * J),
                                   group_starts, axis=0) / sizes
            embeddings = pooling(request[begin + group_starts],
                                 np.add.reduceat(history.embedding[rows].astype(np.float64), group_starts, axis=0),
                                 sizes[:, 0])
            for first in range(0, maps.shape[0], FIT_BATCH):
                self._add(maps[first:first + FIT_BATCH].reshape(-1, L, J), embeddings[first:first + FIT_BATCH])

    def _add(self, maps, embeddings, search=None):
        try:
            self.store.add(maps, embeddings, search)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None

    # ------------------------------------------------------------------------------------------ hooks

    def on_iteration_start(self, view):
        view.require(type(self))
        L = self.spec.num_layers
        self._search = None
        self._set_sizes[:] = 0
        if len(self.store) == 0:
            self._groups = RequestGroups(view.requests)
            self._semantic = self._pool(view)
            self._predicted = None
            self._no_search()
            return []
        with self._timed_search():
            self._groups = RequestGroups(view.requests)
            self._semantic = self._pool(view)
            try:
                self._search = search = self.store.search(self._semantic)
            except ConfigError as exc:
                raise ConfigError(f"{self.name}: {view.source}: {exc}") from None
            maps = self.store.maps(search.index)  # [B, L, J]
            # Every layer starts predicted by the semantic map; layers >= d are replaced by trajectory searches.
            self._predicted = maps.max(axis=0)
            for target in range(min(self.distance, L)):
                self._set_target(target, maps[:, target], search.score)
            result = self._propose(-1)
        return result

    def on_layer_routed(self, view):
        now, L = view.layer_now, self.spec.num_layers
        if self._predicted is None or now == L - 1:
            self._no_search()
            return []
        with self._timed_search():
            target = now + self.distance
            if target < L:
                index, score = self._search.observe(now, self._groups.mean(view.probs(now)))
                rows = self.store.layer(target, index)  # [B, J]
                self._predicted[target] = rows[0] if rows.shape[0] == 1 else rows.max(axis=0)
                self._set_target(target, rows, score)
            result = self._propose(now)
        return result

    def on_iteration_end(self, view):
        L, search = self.spec.num_layers, self._search
        groups = self._groups if self._groups is not None else RequestGroups(view.requests)
        with self._timed_search():
            if search is None:
                maps = np.stack([groups.mean(view.probs(layer)) for layer in range(L)], axis=1)
                self._add(maps, self._semantic if self._semantic is not None else self._pool(view))
            else:  # the layers the trajectory search observed are in hand; the store reuses its scores
                for layer in range(search.layers_observed, L):
                    search.maps[:, layer] = groups.mean(view.probs(layer))
                self._add(search.maps, search.embeddings, search)
        self._search, self._semantic = None, None

    def on_request_end(self, request: int) -> None:
        self._pooling.forget(request)

    def _pool(self, view) -> np.ndarray:
        """[B, D] this iteration's semantic embedding of each request (module doc); once per iteration: the
        pooling of ``semantic="request"`` keeps each request's running sum."""
        groups = self._groups
        counts = np.bincount(groups.inverse, minlength=len(groups))
        return self._pooling(groups.requests, groups.mean(view.embedding()) * counts[:, None], counts)

    def _set_target(self, target: int, rows: np.ndarray, scores: np.ndarray) -> None:
        """Record the batch's prefetch set for ``target`` from its searched distributions ``rows`` [B, J] and
        their similarities ``scores`` [B] (fmoe_sets.similarity_aware_set)."""
        self._set_sizes[target] = self._similarity_aware_set(
            np.ascontiguousarray(rows, dtype=np.float32), np.asarray(scores, dtype=np.float64), self.spec.top_k,
            target * self.spec.num_experts, self._set_keys[target], self._set_wanted[target])

    def _propose(self, now: int):
        """The prefetch sets of the targets now + 1 .. now + d with priority p / (t - now), highest first (ties:
        lower key first; no key twice: each target is one layer)."""
        last = min(now + self.distance, self.spec.num_layers - 1)
        keys, priorities = self._proposal_keys, self._proposal_priorities
        count = self._ranked_proposals(self._set_keys, self._set_wanted, self._set_sizes, now, last, keys,
                                       priorities)
        return proposal_list(keys[:count].tolist(), priorities[:count].tolist())

    def predicted_map(self):
        return self._predicted
