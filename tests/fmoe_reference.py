"""fMoE's prefetcher and Expert Map Store as they were before the store was rewritten for speed (commit
ccab62b): the reference that the exhaustive mode must equal exactly, proposal for proposal
(tests/test_map_search.py). Not used by the package."""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.prefetch._shared import RequestGroups, check_same_model, proposals
from moe_offload.prefetch.base import Prefetcher
from moe_offload.prefetch.requirements import check_trace_columns
from moe_offload.prefetch.search_cost import TimedSearch
from moe_offload.values import integer


TIE_TOLERANCE = 1e-6
_TINY = np.float32(1e-30)


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


class ExpertMapStore:
    def __init__(self, num_layers: int, num_experts: int, capacity: int, distance: int):
        self.num_layers, self.num_experts, self.capacity = num_layers, num_experts, capacity
        self.semantic_weight = min(distance, num_layers) / num_layers  # d / L of the redundancy score
        self.size = 0
        self.embedding_size: int | None = None
        self._maps = np.zeros((num_layers, 0, num_experts), dtype=np.float32)
        self._prefix_sq = np.zeros((num_layers, 0), dtype=np.float32)  # sum over layers 0..l of squared probs
        self._embeddings = np.zeros((0, 0), dtype=np.float32)  # unit length
        self._stamp = np.zeros(0, dtype=np.int64)  # insertion counter of each entry: ties go to the newest
        self._next_stamp = 0

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------------------------------ reading

    def maps(self, index: np.ndarray) -> np.ndarray:
        """The stored maps of entries ``index`` [B] as [B, L, J] (a copy)."""
        return self._maps[:, np.asarray(index)].transpose(1, 0, 2).copy()

    def layer(self, layer: int, index: np.ndarray) -> np.ndarray:
        """Layer ``layer`` of the maps of entries ``index`` [B]: [B, J] (a copy)."""
        return self._maps[layer, np.asarray(index)]

    def _best(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        best = scores.max(axis=1)
        tied = scores >= (best - TIE_TOLERANCE)[:, None]
        index = np.where(tied, self._stamp[None, :self.size], -1).argmax(axis=1)
        return index, scores[np.arange(index.size), index]

    def semantic_scores(self, embeddings: np.ndarray) -> np.ndarray:
        """Equation score-sem: [B, size] cosines between ``embeddings`` [B, D] and the stored embeddings."""
        self._check_embeddings(embeddings)
        return _unit(embeddings) @ self._embeddings[:self.size].T

    def semantic_search(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(entry of highest semantic score [B], that score [B]) for ``embeddings`` [B, D]."""
        return self._best(self.semantic_scores(embeddings))

    def map_scores(self, maps: np.ndarray) -> np.ndarray:
        """Equation score-map over whole maps: [B, size] cosines between ``maps`` [B, L, J] and the stored maps."""
        maps = np.asarray(maps, dtype=np.float32)
        dots = np.zeros((maps.shape[0], self.size), dtype=np.float32)
        for layer in range(self.num_layers):
            dots += maps[:, layer] @ self._maps[layer, :self.size].T
        norms = np.sqrt((maps ** 2).sum(axis=(1, 2)))[:, None] * np.sqrt(self._prefix_sq[-1, :self.size])[None, :]
        return dots / np.maximum(norms, _TINY)

    def redundancy(self, maps: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
        """RDY [B, size] of new entries (``maps`` [B, L, J], ``embeddings`` [B, D]) against the stored ones."""
        return (self.semantic_weight * self.semantic_scores(embeddings)
                + (1.0 - self.semantic_weight) * self.map_scores(maps))

    def trajectory(self, batch: int) -> "TrajectorySearch":
        """A trajectory search for ``batch`` requests of one iteration; the store must not change meanwhile."""
        return TrajectorySearch(self, batch)

    # ------------------------------------------------------------------------------------------ writing

    def add(self, maps: np.ndarray, embeddings: np.ndarray) -> None:
        """Store new entries (``maps`` [B, L, J], ``embeddings`` [B, D]): appended while there is room, then each
        replaces its most redundant stored entry (module docstring)."""
        maps = np.asarray(maps, dtype=np.float32)
        embeddings = np.asarray(embeddings, dtype=np.float32)
        if maps.shape[1:] != (self.num_layers, self.num_experts):
            raise ConfigError(f"expert maps of shape {maps.shape[1:]} do not fit a store of "
                              f"{self.num_layers} x {self.num_experts}")
        if self.embedding_size is None:
            self.embedding_size = embeddings.shape[1]
            self._embeddings = np.zeros((0, self.embedding_size), dtype=np.float32)
        self._check_embeddings(embeddings)
        room = self.capacity - self.size
        if room > 0:
            self._append(maps[:room], embeddings[:room])
            maps, embeddings = maps[room:], embeddings[room:]
        if maps.shape[0] == 0:
            return
        # A batch larger than the store: its older entries would only be replaced by its newer ones.
        maps, embeddings = maps[-self.capacity:], embeddings[-self.capacity:]
        redundancy = self.redundancy(maps, embeddings)
        # Among equally redundant stored entries replace the oldest: order columns by stamp, take the first.
        by_age = np.argsort(self._stamp[:self.size], kind="stable")
        redundancy = redundancy[:, by_age]
        taken = np.zeros(self.size, dtype=bool)
        for row in range(maps.shape[0]):
            scores = np.where(taken, -np.inf, redundancy[row])
            column = int(scores.argmax())
            taken[column] = True
            self._write(int(by_age[column]), maps[row], embeddings[row])

    def _check_embeddings(self, embeddings: np.ndarray) -> None:
        if self.embedding_size is not None and embeddings.shape[-1] != self.embedding_size:
            raise ConfigError(f"embeddings of size {embeddings.shape[-1]} do not match the expert map store's "
                              f"{self.embedding_size}")

    def _append(self, maps: np.ndarray, embeddings: np.ndarray) -> None:
        needed = self.size + maps.shape[0]
        allocated = self._maps.shape[1]
        if needed > allocated:  # grow geometrically up to the capacity, so a large C costs nothing until used
            allocated = min(self.capacity, max(needed, 2 * allocated, 64))
            self._maps = self._grown(self._maps, allocated, axis=1)
            self._prefix_sq = self._grown(self._prefix_sq, allocated, axis=1)
            self._embeddings = self._grown(self._embeddings, allocated, axis=0)
            self._stamp = self._grown(self._stamp, allocated, axis=0)
        start = self.size
        self.size = needed
        for offset in range(maps.shape[0]):
            self._write(start + offset, maps[offset], embeddings[offset])

    @staticmethod
    def _grown(array: np.ndarray, allocated: int, axis: int) -> np.ndarray:
        shape = list(array.shape)
        shape[axis] = allocated
        grown = np.zeros(shape, dtype=array.dtype)
        grown[(slice(None),) * axis + (slice(0, array.shape[axis]),)] = array
        return grown

    def _write(self, slot: int, expert_map: np.ndarray, embedding: np.ndarray) -> None:
        self._maps[:, slot] = expert_map
        self._prefix_sq[:, slot] = np.cumsum((expert_map.astype(np.float64) ** 2).sum(axis=1))
        self._embeddings[slot] = _unit(embedding)
        self._stamp[slot] = self._next_stamp
        self._next_stamp += 1


class TrajectorySearch:
    """The trajectory search of one iteration: ``observe`` layers 0, 1, 2, ... in order, each returning the
    stored entry whose prefix of layers 0..l is closest (cosine) to the observed one, per request."""

    def __init__(self, store: ExpertMapStore, batch: int):
        self.store = store
        self.layers_observed = 0
        self._dots = np.zeros((batch, store.size), dtype=np.float32)
        self._query_sq = np.zeros(batch, dtype=np.float32)

    def observe(self, layer: int, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add layer ``layer``'s distributions ``probs`` [B, J]: (best entry [B], its score [B])."""
        if layer != self.layers_observed:
            raise ValueError(f"trajectory search observes layers in order: expected {self.layers_observed}, "
                             f"got {layer}")
        store = self.store
        probs = np.asarray(probs, dtype=np.float32)
        self._dots += probs @ store._maps[layer, :store.size].T
        self._query_sq += (probs ** 2).sum(axis=1)
        self.layers_observed += 1
        norms = np.sqrt(self._query_sq)[:, None] * np.sqrt(store._prefix_sq[layer, :store.size])[None, :]
        return store._best(self._dots / np.maximum(norms, _TINY))


DEFAULT_CAPACITY = 1000
DEFAULT_DISTANCE = 3
FIT_BATCH = 256        # entries per redundancy computation while filling the store from history
FIT_CHUNK_ROWS = 1 << 15  # history rows converted to float32 at a time


def prefetch_sets(predicted: np.ndarray, scores, min_experts: int) -> np.ndarray:
    """[..., J] mask of fMoE's similarity-aware prefetch set for each predicted distribution ``predicted``
    [..., J] searched with similarity ``scores`` [...]: the fewest highest-probability experts whose summed
    probability reaches delta = clip(1 - score, 0, 1) (ties: lower id first), and at least ``min_experts``."""
    predicted = np.asarray(predicted, dtype=np.float64)
    num_experts = predicted.shape[-1]
    rows = predicted.reshape(-1, num_experts)
    delta = np.minimum(np.maximum(1.0 - np.asarray(scores, dtype=np.float64).reshape(-1), 0.0), 1.0)
    every_row = np.arange(rows.shape[0])[:, None]
    order = np.argsort(-rows, axis=1, kind="stable")
    cumulative = np.cumsum(rows[every_row, order], axis=1)
    # The sums are non-decreasing: the set is the ranks whose sum is still below delta, plus the one reaching it.
    count = np.minimum(np.maximum((cumulative < delta[:, None]).sum(axis=1) + 1, min_experts), num_experts)
    mask = np.empty(rows.shape, dtype=bool)
    mask[every_row, order] = np.arange(num_experts) < count[:, None]
    return mask.reshape(predicted.shape)


class ReferenceFMoE(TimedSearch, Prefetcher):
    name = "fmoe-reference"
    summary = ("expert maps: semantic search for the first d layers, trajectory search after; similarity-aware "
               "set, priority p / (l - l_now)")
    source = "paper 000, Expert Map Search, Expert Prefetching, Expert Map Store Management"
    requires = ("probs", "embedding")
    search_on_inference_path = False

    def __init__(self, spec, capacity: int = DEFAULT_CAPACITY, distance: int = DEFAULT_DISTANCE,
                 search_seconds: float | None = None):
        super().__init__(spec)
        self.capacity = integer(capacity, f"{self.name}.capacity", low=1)
        self.distance = integer(distance, f"{self.name}.distance", low=1)
        self._set_search_seconds(search_seconds)
        self.store = ExpertMapStore(spec.num_layers, spec.num_experts, self.capacity, self.distance)
        self._groups: RequestGroups | None = None
        self._trajectory = None
        # Per target layer of the current iteration, once searched: its prefetch set over the batch, as
        # (experts, the highest p any request gives each); the priority p / (t - l_now) follows at proposal time.
        self._sets: list[tuple[np.ndarray, np.ndarray] | None] = [None] * spec.num_layers
        self._predicted: np.ndarray | None = None  # [L, J]

    # ------------------------------------------------------------------------------------------ history

    def fit(self, history):
        check_trace_columns(type(self), history)
        check_same_model(self.spec, history, self.name)
        L, J = self.spec.num_layers, self.spec.num_experts
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
            embeddings = np.add.reduceat(history.embedding[rows].astype(np.float32), group_starts, axis=0) / sizes
            for first in range(0, maps.shape[0], FIT_BATCH):
                self._add(maps[first:first + FIT_BATCH].reshape(-1, L, J), embeddings[first:first + FIT_BATCH])

    def _add(self, maps, embeddings):
        try:
            self.store.add(maps, embeddings)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None

    # ------------------------------------------------------------------------------------------ hooks

    def on_iteration_start(self, view):
        view.require(type(self))
        L = self.spec.num_layers
        self._groups = RequestGroups(view.requests)
        self._trajectory = None
        self._sets = [None] * L
        if len(self.store) == 0:
            self._predicted = None
            self._no_search()
            return []
        with self._timed_search():
            embeddings = self._groups.mean(view.embedding())
            try:
                index, score = self.store.semantic_search(embeddings)
            except ConfigError as exc:
                raise ConfigError(f"{self.name}: {view.source}: {exc}") from None
            maps = self.store.maps(index)  # [B, L, J]
            # Every layer starts predicted by the semantic map; layers >= d are replaced by trajectory searches.
            self._predicted = maps.max(axis=0)
            for target in range(min(self.distance, L)):
                self._set_target(target, maps[:, target], score)
            if self.distance < L:
                self._trajectory = self.store.trajectory(len(self._groups))
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
                index, score = self._trajectory.observe(now, self._groups.mean(view.probs(now)))
                rows = self.store.layer(target, index)  # [B, J]
                self._predicted[target] = rows.max(axis=0)
                self._set_target(target, rows, score)
            result = self._propose(now)
        return result

    def on_iteration_end(self, view):
        L = self.spec.num_layers
        groups = RequestGroups(view.requests)
        with self._timed_search():
            maps = np.stack([groups.mean(view.probs(layer)) for layer in range(L)], axis=1)
            self._add(maps, groups.mean(view.embedding()))

    def _set_target(self, target: int, rows: np.ndarray, scores: np.ndarray) -> None:
        """Record the batch's prefetch set for ``target`` from its searched distributions ``rows`` [B, J]."""
        chosen = prefetch_sets(rows, scores, self.spec.top_k)
        wanted = np.where(chosen, rows, -1.0).max(axis=0)
        experts = np.flatnonzero(wanted >= 0)
        self._sets[target] = (experts, wanted[experts].astype(np.float64))

    def _propose(self, now: int):
        """The prefetch sets of the targets now + 1 .. now + d with priority p / (t - now)."""
        J = self.spec.num_experts
        keys, priorities = [], []
        for target in range(now + 1, min(now + self.distance, self.spec.num_layers - 1) + 1):
            experts, wanted = self._sets[target]
            keys.append(target * J + experts)
            priorities.append(wanted / (target - now))
        return proposals(np.concatenate(keys), np.concatenate(priorities), distinct=True)  # one layer per target

    def predicted_map(self):
        return self._predicted
