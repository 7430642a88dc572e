"""fMoE's Expert Map Store and its two searches (paper 000, "Expert Map Search" and "Expert Map Store
Management").

An entry is one iteration of one request: its expert map, the router distributions [L, J] of all layers
(averaged over the request's tokens when a prefill iteration has several), and its semantic embedding [D].

* Semantic search (equation score-sem): cosine between a request's embedding and every stored embedding.
* Trajectory search (equation score-map): cosine between the distributions observed so far, layers
  0..l laid end to end, and the same prefix of every stored map.
* Both return, per request, the entry of highest score; entries whose scores tie (within 1e-6, float32
  cosines) go to the most recently stored, e.g. the same request's latest iteration when embeddings are
  per request.
* Deduplication: a store at capacity C takes a batch of new entries x by replacing, for each, the stored
  entry y of highest redundancy RDY[x, y] = d/L * score_sem[x, y] + (L - d)/L * score_map[x, y]
  (score_map over the whole map); entries of one batch replace distinct y, in batch order (ties: the
  oldest y). Until the store is full, entries are appended.

Reading each stored byte once per iteration. An exhaustive search cannot do better than stream the store
through memory once per iteration (benchmarks/map_search.py prints that floor beside its times), so:

* ``search(embeddings)`` starts an ``IterationSearch`` for the B requests of one iteration: the semantic
  search is one [B, D] x [D, C] product over the stored embeddings, kept at unit length;
* its ``observe(l, probs)`` is the trajectory step after layer l: it adds layer l's block of every map to
  running dot products and divides by the prefix norms, precomputed per entry and layer. Maps are kept
  layer-major, [L, C, J], so that block is one contiguous [C, J] matrix, and the steps of an iteration read
  each stored map once between them, not once per layer;
* ``add(maps, embeddings, search)`` at the end of the iteration reuses that search's semantic scores and
  dot products for the redundancy of the new entries (the same numbers, computed once): it reads only the
  layers the trajectory did not observe (the last d), then writes the replaced slots and nothing else;
* a batch of requests shares every matrix product.

Options, all off by default (exhaustive, full size, float32), which reproduces the previous implementation's
results exactly (tests/test_map_search.py):

* ``embedding_dims=N``: embeddings are stored as a fixed random projection to N dimensions (a seeded
  Gaussian matrix; Johnson-Lindenstrauss: cosines are kept within about 1/sqrt(N)), so the semantic search
  reads N/D of the bytes;
* ``candidates=M`` (pruning): the trajectory steps and the deduplication look only at each request's M
  entries of highest semantic score (the semantic search still scores every entry); their maps are gathered
  once per iteration, so the store keeps them entry-major, [C, L, J] (M contiguous blocks to gather, where
  layer-major would be M x L scattered rows), and each step is one call of map_ranking's trajectory step
  (Numba-compiled; the same bits in NumPy without Numba, slower for large J). Its results differ from the
  exhaustive search's where the best entry is not among the candidates (the README measures the cost);
* ``lists=N`` (with ``candidates`` only; ``probes=P``, default DEFAULT_PROBES): the semantic search goes
  through a coarse quantizer (prefetch/coarse_index.py): the stored keys are partitioned into N lists by
  k-means, and a request's search reads the N centroids and the keys of its P nearest lists (at least M
  keys), about P / N of the store's key bytes instead of all of them, and picks its candidates among them.
  Approximate: an entry in a list not probed is not found (the README measures the cost in hit rate and
  precision); until the store holds enough keys to train it (coarse_index.py) the search is exhaustive. The
  index keeps a second copy of the keys, grouped by list (padded to the longest list);
* ``map_dtype="float16"`` (with ``candidates`` only): maps kept in half precision, half the memory. NumPy
  has no float16 matrix product (about 25 times slower than float32 here), so an exhaustive trajectory over
  them would be slower, not faster; with pruning only the candidates' maps are converted (by a compiled
  gather, map_ranking.gather_half_maps: NumPy converts float16 subnormals, most of a router's small
  probabilities, one at a time). Embeddings stay
  float32 for the same reason: the semantic search reads all of them.
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.prefetch.coarse_index import CoarseIndex
from moe_offload.prefetch.map_ranking import TINY, best_entries, compiled_half_gather, compiled_trajectory_step

MAP_DTYPES = ("float32", "float16")
DEFAULT_PROBES = 8


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


class ExpertMapStore:
    def __init__(self, num_layers: int, num_experts: int, capacity: int, distance: int, *,
                 embedding_dims: int | None = None, candidates: int | None = None, map_dtype: str = "float32",
                 lists: int | None = None, probes: int = DEFAULT_PROBES, seed: int = 0):
        if map_dtype not in MAP_DTYPES:
            raise ConfigError(f"map_dtype must be one of {', '.join(MAP_DTYPES)}, not {map_dtype!r}")
        if map_dtype != "float32" and candidates is None:
            raise ConfigError(f"map_dtype={map_dtype} needs candidates=M: NumPy has no {map_dtype} matrix product, "
                              "so an exhaustive trajectory search over such maps would be slower, not faster")
        if lists is not None and candidates is None:
            raise ConfigError(f"lists={lists} needs candidates=M: the trajectory search and the deduplication read "
                              "the semantic scores of every stored entry unless they are pruned to candidates")
        if lists is not None and not 1 <= probes <= lists:
            raise ConfigError(f"probes={probes} must be between 1 and lists={lists}")
        self.num_layers, self.num_experts, self.capacity = num_layers, num_experts, capacity
        self.semantic_weight = min(distance, num_layers) / num_layers  # d / L of the redundancy score
        self.embedding_dims, self.candidates, self.seed = embedding_dims, candidates, seed
        self.size = 0
        self.version = 0  # changes with every write: a search is reused by ``add`` only from the same version
        self.embedding_size: int | None = None
        # Exhaustive: layer-major, [L, C, J] and [L, C] (a trajectory step streams one layer of every map). Pruned:
        # entry-major, [C, L, J] and [C, L] (a search gathers its candidates' whole maps, M contiguous blocks).
        self._entry_axis = 0 if candidates is not None else 1
        self._maps = np.zeros(self._entry_major((num_layers, 0, num_experts)), dtype=map_dtype)
        self._prefix_norm = np.zeros(self._entry_major((num_layers, 0)), dtype=np.float32)  # of layers 0..l
        self._embeddings = np.zeros((0, 0), dtype=np.float32)  # unit length (projected with embedding_dims)
        self._projection: np.ndarray | None = None  # [D, embedding_dims]
        self._stamp = np.zeros(0, dtype=np.int64)  # insertion counter of each entry: ties go to the newest
        self._next_stamp = 0
        self._index = None if lists is None else CoarseIndex(lists, probes, seed)
        # the pruned trajectory step, compiled now (when Numba is installed) rather than in the first search
        self._trajectory_step = compiled_trajectory_step() if candidates is not None else None
        self._gather_half_maps = compiled_half_gather() if map_dtype == "float16" else None

    def __len__(self) -> int:
        return self.size

    def _entry_major(self, shape: tuple) -> tuple:
        """``shape`` (L, C, ...) in this store's layout: swapped to (C, L, ...) when it is entry-major."""
        return shape if self._entry_axis == 1 else (shape[1], shape[0]) + shape[2:]

    def bytes_searched(self, batch: int = 1) -> int:
        """The bytes one iteration's searches for ``batch`` requests must read: the projection (with
        ``embedding_dims``), every stored embedding (with a trained ``lists`` index: the centroids and, per
        request, P / N of the embeddings, as if the lists were of equal size), and every stored map
        (exhaustive) or each request's candidates' maps (pruned)."""
        per_map = self.num_layers * self.num_experts * self._maps.itemsize
        maps = (self.size * per_map if self.candidates is None or self.candidates >= self.size
                else batch * self.candidates * per_map)
        keys = self._embeddings[:self.size].nbytes
        if self._index is not None and self._index.centroids is not None:
            read = max(self.candidates, self._index.expected_fraction() * self.size)
            keys = self._index.centroids.nbytes + batch * read * self._embeddings.itemsize * self._embeddings.shape[1]
        projection = 0 if self._projection is None else self._projection.nbytes
        return int(projection + keys + maps)

    # ------------------------------------------------------------------------------------------ reading

    def maps(self, index: np.ndarray) -> np.ndarray:
        """The stored maps of entries ``index`` [B] as [B, L, J] float32 (a copy)."""
        if self._entry_axis == 0:
            return self._maps[np.asarray(index)].astype(np.float32)
        return self._maps[:, np.asarray(index)].transpose(1, 0, 2).astype(np.float32)

    def layer(self, layer: int, index: np.ndarray) -> np.ndarray:
        """Layer ``layer`` of the maps of entries ``index`` [B]: [B, J] float32 (a copy)."""
        rows = self._maps[np.asarray(index), layer] if self._entry_axis == 0 else self._maps[layer, np.asarray(index)]
        return rows.astype(np.float32, copy=False)

    def keys(self, embeddings: np.ndarray) -> np.ndarray:
        """The semantic keys of ``embeddings`` [B, D]: projected (with embedding_dims) and at unit length."""
        embeddings = np.asarray(embeddings, dtype=np.float32)
        self._check_embeddings(embeddings)
        if self._projection is not None:
            embeddings = embeddings @ self._projection
        return _unit(embeddings)

    def semantic_scores(self, embeddings: np.ndarray) -> np.ndarray:
        """Equation score-sem: [B, size] cosines between ``embeddings`` [B, D] and the stored embeddings."""
        return self.keys(embeddings) @ self._embeddings[:self.size].T

    def map_scores(self, maps: np.ndarray) -> np.ndarray:
        """Equation score-map over whole maps: [B, size] cosines between ``maps`` [B, L, J] and the stored maps."""
        maps = np.asarray(maps, dtype=np.float32)
        if self._entry_axis == 0:
            dots = maps.reshape(maps.shape[0], -1) @ self._maps[:self.size].reshape(self.size, -1).T
            return self._map_cosines(maps, dots, self._prefix_norm[:self.size, -1])
        dots = np.zeros((maps.shape[0], self.size), dtype=np.float32)
        for layer in range(self.num_layers):
            dots += maps[:, layer] @ self._block(layer).T
        return self._map_cosines(maps, dots, self._prefix_norm[-1, :self.size])

    def redundancy(self, maps: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
        """RDY [B, size] of new entries (``maps`` [B, L, J], ``embeddings`` [B, D]) against the stored ones."""
        return (self.semantic_weight * self.semantic_scores(embeddings)
                + (1.0 - self.semantic_weight) * self.map_scores(maps))

    def search(self, embeddings: np.ndarray) -> "IterationSearch":
        """The searches of one iteration for the requests of ``embeddings`` [B, D] (their semantic search runs
        now); the store must not change until its last ``observe``."""
        return IterationSearch(self, embeddings)

    def _block(self, layer: int) -> np.ndarray:
        """Layer ``layer`` of every stored map, [size, J] float32 (exhaustive stores: layer-major, float32)."""
        return self._maps[layer, :self.size]

    @staticmethod
    def _map_cosines(maps: np.ndarray, dots: np.ndarray, stored_norms: np.ndarray) -> np.ndarray:
        norms = np.sqrt((maps ** 2).sum(axis=(1, 2)))[:, None] * stored_norms
        return dots / np.maximum(norms, TINY)

    # ------------------------------------------------------------------------------------------ writing

    def add(self, maps: np.ndarray, embeddings: np.ndarray, search: "IterationSearch | None" = None) -> None:
        """Store new entries (``maps`` [B, L, J], ``embeddings`` [B, D]): appended while there is room, then each
        replaces its most redundant stored entry (module docstring). ``search``: the iteration's search of the
        same requests, whose scores the redundancy reuses when the store has not changed since."""
        maps = np.asarray(maps, dtype=np.float32)
        embeddings = np.asarray(embeddings, dtype=np.float32)
        if maps.ndim != 3 or maps.shape[1:] != (self.num_layers, self.num_experts):
            raise ConfigError(f"expert maps of shape {maps.shape[1:]} do not fit a store of "
                              f"{self.num_layers} x {self.num_experts}")
        if self.embedding_size is None:
            self._first_embeddings(embeddings.shape[1])
        self._check_embeddings(embeddings)
        # the stored keys: the search's, when it searched for these entries (the projection read once)
        keys = search.keys if search is not None and search.describes(maps, embeddings) else self.keys(embeddings)
        room = self.capacity - self.size
        if room > 0:
            self._append(maps[:room], keys[:room])
            maps, embeddings, keys = maps[room:], embeddings[room:], keys[room:]
        if maps.shape[0] == 0:
            return
        # A batch larger than the store: its older entries would only be replaced by its newer ones.
        maps, embeddings, keys = maps[-self.capacity:], embeddings[-self.capacity:], keys[-self.capacity:]
        if search is not None and search.describes(maps, embeddings):
            redundancy, columns = search.redundancy(maps)
        else:
            redundancy, columns = self.redundancy(maps, embeddings), None
        taken = np.zeros(self.size, dtype=bool)
        for row in range(maps.shape[0]):
            slots = np.arange(self.size) if columns is None else columns[row]
            scores = np.where(taken[slots], -np.inf, redundancy[row])
            best = scores.max()
            if best == -np.inf:  # every candidate of this entry went to earlier entries of the batch
                slots, scores, best = np.flatnonzero(~taken), np.zeros(np.count_nonzero(~taken)), 0.0
            tied = slots[scores == best]
            slot = int(tied[self._stamp[tied].argmin()])  # among equally redundant entries, the oldest
            taken[slot] = True
            self._write(slot, maps[row], keys[row])

    def _first_embeddings(self, size: int) -> None:
        self.embedding_size = size
        dims = size
        if self.embedding_dims is not None:
            if self.embedding_dims >= size:
                raise ConfigError(f"embedding_dims={self.embedding_dims} does not reduce embeddings of size {size}")
            dims = self.embedding_dims
            rng = np.random.default_rng(self.seed)
            self._projection = rng.standard_normal((size, dims), dtype=np.float32)
        self._embeddings = np.zeros((0, dims), dtype=np.float32)

    def _check_embeddings(self, embeddings: np.ndarray) -> None:
        if self.embedding_size is not None and embeddings.shape[-1] != self.embedding_size:
            raise ConfigError(f"embeddings of size {embeddings.shape[-1]} do not match the expert map store's "
                              f"{self.embedding_size}")

    def _append(self, maps: np.ndarray, keys: np.ndarray) -> None:
        needed = self.size + maps.shape[0]
        axis = self._entry_axis
        allocated = self._maps.shape[axis]
        if needed > allocated:  # grow geometrically up to the capacity, so a large C costs nothing until used
            allocated = min(self.capacity, max(needed, 2 * allocated, 64))
            self._maps = self._grown(self._maps, allocated, axis=axis)
            self._prefix_norm = self._grown(self._prefix_norm, allocated, axis=axis)
            self._embeddings = self._grown(self._embeddings, allocated, axis=0)
            self._stamp = self._grown(self._stamp, allocated, axis=0)
        start = self.size
        self.size = needed
        for offset in range(maps.shape[0]):
            self._write(start + offset, maps[offset], keys[offset])
        if self._index is not None and self._index.due(self.size):
            self._index.train(self._embeddings[:self.size])

    @staticmethod
    def _grown(array: np.ndarray, allocated: int, axis: int) -> np.ndarray:
        shape = list(array.shape)
        shape[axis] = allocated
        grown = np.zeros(shape, dtype=array.dtype)
        grown[(slice(None),) * axis + (slice(0, array.shape[axis]),)] = array
        return grown

    def _write(self, slot: int, expert_map: np.ndarray, key: np.ndarray) -> None:
        """Store ``expert_map`` [L, J] and the semantic key ``key`` [D'] (``keys``) in ``slot``."""
        entry = (slot,) if self._entry_axis == 0 else (slice(None), slot)
        self._maps[entry] = expert_map
        # the norms of the map as stored (rounded to float16 when the maps are)
        squares = np.cumsum((self._maps[entry].astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
        self._prefix_norm[entry] = np.sqrt(squares)
        self._embeddings[slot] = key
        if self._index is not None:
            self._index.assign(slot, self._embeddings[slot])
        self._stamp[slot] = self._next_stamp
        self._next_stamp += 1
        self.version += 1


class IterationSearch:
    """The searches of one iteration for B requests (module docstring): the semantic search at construction
    (``index``, ``score``), then ``observe`` layers 0, 1, 2, ... in order, each returning the stored entry
    whose prefix of layers 0..l is closest (cosine) to the observed one, per request. With ``candidates`` the
    trajectory looks only at each request's M best semantic entries (``candidates`` [B, M]); with a trained
    ``lists`` index those are the M best of the probed lists, and the semantic search's entry the best of them."""

    def __init__(self, store: ExpertMapStore, embeddings: np.ndarray):
        self.store = store
        self.version = store.version
        self.embeddings = np.array(embeddings, dtype=np.float32)
        self.keys = store.keys(self.embeddings)  # [B, D'], which ``add`` stores if these entries are added
        batch, size = self.embeddings.shape[0], store.size
        stamps = store._stamp[:size]
        self.candidates: np.ndarray | None = None
        # the semantic scores the deduplication reuses: [B, size], or [B, M] of the candidates
        if store._index is not None and store._index.centroids is not None and store.candidates < size:
            self.candidates, self._semantic = self._probe(self.keys)
            best, self.score = best_entries(self._semantic, stamps[self.candidates])
            self.index = self.candidates[np.arange(batch), best]
        else:
            semantic = self.keys @ store._embeddings[:size].T  # equation score-sem, as ``semantic_scores``
            self.index, self.score = best_entries(semantic, stamps)
            self._semantic = semantic
            if store.candidates is not None:  # [B, M]; every entry while the store holds no more than M
                count = store.candidates
                self.candidates = (np.argpartition(-semantic, count - 1, axis=1)[:, :count] if count < size
                                   else np.broadcast_to(np.arange(size), semantic.shape).copy())
                self._semantic = np.take_along_axis(semantic, self.candidates, axis=1)
        self.layers_observed = 0
        # the searched iteration's maps: layers 0 .. layers_observed - 1 as observed, the rest for the caller to
        # fill before ``add`` (which then reuses this search's scores)
        self.maps = np.zeros((batch, store.num_layers, store.num_experts), dtype=np.float32)
        self._query_sq = np.zeros(batch, dtype=np.float32)
        if self.candidates is not None:
            # [L, B, M, J] and [L, B, M], from the entry-major store
            if store._gather_half_maps is not None:
                self._maps = np.empty((store.num_layers,) + self.candidates.shape + (store.num_experts,),
                                      dtype=np.float32)
                store._gather_half_maps(store._maps.view(np.uint16), np.ascontiguousarray(self.candidates),
                                        self._maps)
            else:
                self._maps = store._maps[self.candidates].transpose(2, 0, 1, 3).astype(np.float32, order="C")
            self._norms = store._prefix_norm[self.candidates].transpose(2, 0, 1).copy()
            # their inverses (a zero map has cosine 0 with any query: 0 x 1e30), for map_ranking.trajectory_step
            self._inverse_norms = 1.0 / np.maximum(self._norms, TINY)
            self._rows = np.arange(batch)
            self._stamps = store._stamp[self.candidates]  # [B, M]
            self._dots = np.zeros(self.candidates.shape, dtype=np.float32)
        else:
            self._dots = np.zeros((batch, size), dtype=np.float32)
            self._scores = np.empty_like(self._dots)  # each step's cosines, computed in place

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidates [B, M], their semantic scores [B, M]): the M best entries of each request's probed lists
        (of the unit ``keys`` [B, D'])."""
        store, count = self.store, self.store.candidates
        candidates = np.empty((keys.shape[0], count), dtype=np.int64)
        scores = np.empty((keys.shape[0], count), dtype=np.float32)
        for row, key in enumerate(keys):
            slots, semantic = store._index.search(key, count)
            if slots.size > count:
                best = np.argpartition(-semantic, count - 1)[:count]
                slots, semantic = slots[best], semantic[best]
            candidates[row], scores[row] = slots, semantic
        return candidates, scores

    def observe(self, layer: int, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add layer ``layer``'s distributions ``probs`` [B, J]: (best entry [B], its score [B])."""
        if layer != self.layers_observed:
            raise ValueError(f"trajectory search observes layers in order: expected {self.layers_observed}, "
                             f"got {layer}")
        store = self.store
        probs = np.asarray(probs, dtype=np.float32)
        self.maps[:, layer] = probs
        self.layers_observed += 1
        if self.candidates is None:
            self._query_sq += (probs * probs).sum(axis=1)
            query_norm = np.sqrt(self._query_sq)[:, None]
            self._dots += probs @ store._maps[layer, :store.size].T
            scores = np.multiply(query_norm, store._prefix_norm[layer, :store.size], out=self._scores)
            np.divide(self._dots, np.maximum(scores, TINY, out=scores), out=scores)
            return best_entries(scores, store._stamp[:store.size])
        best, score = np.empty(probs.shape[0], dtype=np.int64), np.empty(probs.shape[0], dtype=np.float32)
        store._trajectory_step(self._maps[layer], np.ascontiguousarray(probs), self._dots, self._query_sq,
                               self._inverse_norms[layer], self._stamps, best, score)
        return self.candidates[self._rows, best], score

    def describes(self, maps: np.ndarray, embeddings: np.ndarray) -> bool:
        """Whether ``maps`` and ``embeddings`` are the entries this search searched for, in a store that has not
        changed since: then ``redundancy`` can reuse its scores."""
        observed = self.layers_observed
        return (self.version == self.store.version and embeddings.shape == self.embeddings.shape
                and (embeddings is self.embeddings or np.array_equal(embeddings, self.embeddings))
                and (maps is self.maps or np.array_equal(maps[:, :observed], self.maps[:, :observed])))

    def redundancy(self, maps: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(RDY of the searched entries, whose full maps are ``maps`` [B, L, J], against the stored ones; the
        stored entry of each column per row, or None for all of them in order): the semantic scores and the
        dot products of the observed layers are this search's, only the other layers are read."""
        store, dots = self.store, self._dots
        for layer in range(self.layers_observed, store.num_layers):
            if self.candidates is None:
                dots += maps[:, layer] @ store._block(layer).T
            else:
                dots += np.matmul(self._maps[layer], maps[:, layer, :, None])[:, :, 0]
        semantic = self._semantic
        stored_norms = store._prefix_norm[-1, :store.size][None, :] if self.candidates is None else self._norms[-1]
        self.layers_observed = store.num_layers  # the dot products are complete: no more trajectory steps
        weight = store.semantic_weight
        rdy = weight * semantic + (1.0 - weight) * store._map_cosines(maps, dots, stored_norms)
        return rdy, self.candidates
