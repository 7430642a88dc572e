"""MoE-Infinity's Expert Activation Matrices (paper 002, section 4.2): the EAM of a sequence, the distance
of equation (1), the EAM collection (EAMC) built by K-means, and the nearest-EAM search of Algorithm 1.

An EAM M of a sequence is an [L, J] matrix: ``M[l][j]`` counts the sequence's tokens routed to expert j of
layer l. Equation (1):

    distance(M1, M2) = 1 - 1/L * sum_l CosineSimilarity(M1[l] / sum M1[l], M2[l] / sum M2[l])

A cosine does not change when a vector is scaled, so with every row scaled to unit Euclidean length
(``unit_rows``) and the L rows laid end to end, distance = 1 - (u1 . u2) / L: one dot product per pair,
which is what makes the search and the clustering matrix products.

A row that sums to 0 (a layer the current sequence has not reached yet) has no direction; its cosine is
taken as 0. That adds the same constant to the distance to every EAM of the collection, so the nearest
one is the nearest over the layers observed so far.

K-means with this distance: assigning an EAM to the centroid of largest u . c is assigning it to the
nearest; the centroid that minimises a cluster's summed distance is, layer by layer, the mean of the
members' unit rows scaled back to unit length (spherical K-means, one sphere per layer), so Lloyd's
iterations never increase the objective. Seeds are chosen by k-means++ under the same distance with a
seeded generator, so one seed gives one EAMC. As the paper says, the EAMC keeps, for each cluster, the
member EAM closest to its centroid (not the centroid itself).

Searching touches only what changed. Routing layer l changes row l of a sequence's EAM and nothing else,
so the summed cosine can be kept per layer: ``layer_similarities`` recomputes layer l's term ([J] x [J, P],
the EAMC's bytes of one layer) and ``nearest_from_layers`` adds the L terms, instead of ``nearest``'s product
over all L rows of every EAM at every layer.
"""

from __future__ import annotations

import numpy as np

from moe_offload.inputs import check_memory

from moe_offload.trace.format import Trace

MAX_KMEANS_ITERATIONS = 100
SAME_DIRECTION = 1e-6  # distances below this are float32 rounding of 0: the EAMs point the same way
_TINY = np.float32(1e-30)


def unit_rows(eams: np.ndarray) -> np.ndarray:
    """``eams`` [..., L, J] with every row scaled to unit Euclidean length (float32); zero rows stay zero."""
    eams = np.asarray(eams, dtype=np.float32)
    norms = np.sqrt(np.add.reduce(eams * eams, axis=-1, keepdims=True))  # np.linalg.norm's sum, without its checks
    # a zero row divides by a tiny number and stays zero; a non-zero row's norm is far above it (counts: >= 1)
    return eams / np.maximum(norms, _TINY, out=norms)


def eam_distance(m1: np.ndarray, m2: np.ndarray) -> float:
    """Equation (1) between two [L, J] EAMs, written as the paper writes it (a reference for tests)."""
    cosines = []
    for row1, row2 in zip(np.asarray(m1, dtype=np.float64), np.asarray(m2, dtype=np.float64)):
        if row1.sum() == 0 or row2.sum() == 0:
            cosines.append(0.0)
            continue
        a, b = row1 / row1.sum(), row2 / row2.sum()
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return 1.0 - sum(cosines) / len(cosines)


def sequence_eams(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(request ids ascending, their EAMs [R, L, J]) over every token of every request of ``trace``."""
    L, J = trace.meta.num_layers, trace.meta.num_experts
    requests, inverse = np.unique(trace.request, return_inverse=True)
    # the counts (int64) and, in build_eamc, their unit rows (float64) and the K-means products over them
    check_memory(3 * requests.size * L * J * 8, trace.path, f"the EAMs of its {requests.size:,} requests "
                                                             f"({L} layers x {J} experts each)")
    cell = (inverse.reshape(-1, 1, 1).astype(np.int64) * (L * J) + np.arange(L)[None, :, None] * J
            + trace.experts.astype(np.int64))
    counts = np.bincount(cell.reshape(-1), minlength=requests.size * L * J)
    return requests, counts.reshape(requests.size, L, J)


def _normalise_layers(centroids: np.ndarray, num_layers: int) -> np.ndarray:
    return unit_rows(centroids.reshape(centroids.shape[0], num_layers, -1)).reshape(centroids.shape)


def build_eamc(eams: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """Indices into ``eams`` [N, L, J] of the EAMC of at most ``capacity`` EAMs: K-means with the distance of
    equation (1) and ``capacity`` clusters, each represented by its member closest to the centroid; in
    cluster order. With N <= capacity every EAM is its own cluster. Fewer than ``capacity`` come back when the
    EAMs have fewer distinct directions than that."""
    n, num_layers = eams.shape[0], eams.shape[1]
    if n <= capacity:
        return np.arange(n)
    points = unit_rows(eams).reshape(n, -1)
    rng = np.random.default_rng(seed)

    # k-means++: each next seed drawn with probability proportional to its squared distance to the nearest seed.
    seeds = [int(rng.integers(n))]
    nearest = 1.0 - points @ points[seeds[0]] / num_layers
    while len(seeds) < capacity:
        weights = np.where(nearest > SAME_DIRECTION, nearest, 0.0).astype(np.float64) ** 2
        total = weights.sum()
        if total <= 0:  # every EAM left coincides with a seed
            break
        seeds.append(int(rng.choice(n, p=weights / total)))
        nearest = np.minimum(nearest, 1.0 - points @ points[seeds[-1]] / num_layers)
    centroids = points[seeds].copy()

    previous = None
    for _ in range(MAX_KMEANS_ITERATIONS):
        similarity = points @ centroids.T
        assignment = similarity.argmax(axis=1)
        if previous is not None and np.array_equal(assignment, previous):
            break
        previous = assignment
        members = np.zeros((centroids.shape[0], n), dtype=np.float32)
        members[assignment, np.arange(n)] = 1.0
        sizes = members.sum(axis=1)
        centroids = _normalise_layers(members @ points, num_layers)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            # An empty cluster restarts at the EAMs farthest from their own centroids, one each.
            own = similarity[np.arange(n), assignment]
            centroids[empty] = points[np.argsort(own, kind="stable")[:empty.size]]
    else:
        similarity = points @ centroids.T
        assignment = similarity.argmax(axis=1)

    representatives = []
    for cluster in range(centroids.shape[0]):
        members = np.flatnonzero(assignment == cluster)
        if members.size:
            representatives.append(int(members[similarity[members, cluster].argmax()]))
    return np.asarray(representatives, dtype=np.int64)


class EAMCollection:
    """The EAMC: fixed EAMs [P, L, J] searched for the one nearest to a sequence's current EAM."""

    def __init__(self, eams: np.ndarray):
        self.eams = np.asarray(eams)
        size, num_layers = self.eams.shape[0], self.eams.shape[1]
        self.num_layers = num_layers
        # [P, L * J]: the unit rows of every EAM laid end to end (the layout the search's sums were first taken
        # in: BLAS adds in another order over the transposed layout, which moves the last bit of a distance)
        self._units = unit_rows(self.eams).reshape(size, num_layers * self.eams.shape[2])
        # [L, J, P]: layer l's unit rows of every EAM, contiguous, for the incremental search
        self._layer_units = np.ascontiguousarray(self._units.reshape(self.eams.shape).transpose(1, 2, 0))

    def __len__(self) -> int:
        return int(self.eams.shape[0])

    def nearest(self, current: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For current EAMs [B, L, J]: (index of the nearest EAM [B], its distance [B]); ties to the lower index
        (Algorithm 1 keeps the first EAM met with a strictly smaller distance)."""
        distance = 1.0 - (unit_rows(current).reshape(current.shape[0], -1) @ self._units.T) / self.num_layers
        if distance.shape[0] == 1:  # one sequence: the same without the per-row indexing
            index = distance[0].argmin()
            return index.reshape(1), distance[0, index].reshape(1)
        index = distance.argmin(axis=1)
        return index, distance[np.arange(index.size), index]

    def layer_similarities(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """[B, P]: the cosines between row ``layer`` of B current EAMs (``rows`` [B, J]) and row ``layer`` of every
        EAM of the collection (0 for a zero row): the one term of the summed cosine of equation (1) that
        changes when layer ``layer`` is routed."""
        return unit_rows(rows) @ self._layer_units[layer]

    def nearest_from_layers(self, similarities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``nearest`` from the per-layer cosines of B current EAMs ([B, L, P], ``layer_similarities`` of every
        layer): the same EAM and distance in exact arithmetic, summed in another order in float32, so a
        distance can differ from ``nearest``'s in its last bits (and a near-tie can go the other way)."""
        distance = 1.0 - similarities.sum(axis=1) / self.num_layers
        index = distance.argmin(axis=1)
        return index, distance[np.arange(index.size), index]
