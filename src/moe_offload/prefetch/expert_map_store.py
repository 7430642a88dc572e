"""fMoE's Expert Map Store and its two searches (paper 000, "Expert Map Search" and "Expert Map Store
Management").

An entry is one iteration of one request: its expert map, the router distributions [L, J] of all layers
(averaged over the request's tokens when a prefill iteration has several), and its semantic embedding [D].

* Semantic search (equation score-sem): cosine between a request's embedding and every stored embedding.
* Trajectory search (equation score-map): cosine between the distributions observed so far, layers
  0..l laid end to end, and the same prefix of every stored map. ``TrajectorySearch`` keeps the running dot
  products and squared norms of the prefix, so observing layer l costs one [C, J] matrix product per
  request instead of a product over the whole (l + 1) * J prefix: the search at every layer reads each
  stored map once per iteration, not once per layer.
* Both return, per request, the entry of highest score; entries whose scores tie (within 1e-6, float32
  cosines) go to the most recently stored, e.g. the same request's latest iteration when embeddings are
  per request.
* Deduplication: a store at capacity C takes a batch of new entries x by replacing, for each, the stored
  entry y of highest redundancy RDY[x, y] = d/L * score_sem[x, y] + (L - d)/L * score_map[x, y]
  (score_map over the whole map); entries of one batch replace distinct y, in batch order (ties: the
  oldest y). Until the store is full, entries are appended.

Memory layout: maps are kept layer-major, [L, C, J] float32, so the block of layer l of every map is one
contiguous [C, J] matrix (the trajectory step's operand); the per-map prefix squared norms [L, C] are
kept with them, and embeddings are stored scaled to unit length.
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError

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
