"""MoE-Infinity's activation-aware cache replacement (paper 002, Algorithm 2).

EAMs (section 4.2). The Expert Activation Matrix of a sequence counts, per layer l and expert j, the
sequence's tokens routed to j: ``M[l][j]``, with ``sum_j M[l][j]`` = its tokens so far. An access carries its
tokens by request (``ctx.routed``; the replay's None is one token of ``ctx.request``), so a prefill or a
batched iteration counts every token of every sequence, and rows of several requests interleaved in a trace
each go to their own sequence's EAM. A sequence's EAM starts empty with its first token (Algorithm 1,
step 2: NEW EAM at the start of an inference) and ends when the driver reports that its request has run its
last iteration (``on_request_end``), so the memory held is that of the running sequences only.

Which EAM ranks a victim. Algorithm 2 ranks by ``cur_eam``, the EAM that Algorithm 1's INFERENCE builds
over its token buffer b: when b holds a batch, ``cur_eam[l][e] += t.size()`` counts the tokens of all the
batch's sequences. Sequences join and leave a batch (continuous batching, a recorded batch whose prompts
finish at different times), so here the current EAM is the sum of the EAMs of the sequences running now
(started, not ended): ``eam="running"``, the default. Paper 002 does not say how a batch's sequences share
the cache; the other reading, that the replacement serves one sequence and ranks by that sequence's own EAM
(section 4.2 keeps one EAM per sequence), is ``eam="request"``: the EAM of ``ctx.request``, the sequence of
the token being served (in a batched access the iteration's first request, policies/base.py). A resident
expert e of layer l has priority

    p = (EAM[l][e] / sum(EAM[l]) + EPSILON) * (1 - l / L)

(steps 6-8; a layer the EAM has not reached has ratio 0) and the lowest p is replaced. Ties go to the
expert whose count changed least recently (``running``) or that was used least recently (``request``).

Tiers. Algorithm 2 runs "when there is a need to fetch an expert into a memory device, be it GPU HBM or
Host Memory" (section 6.1), with the same current EAM. The instances of one run (``run_factory``: one per
tier) therefore share one ``SequenceEAMs``: the host tier ranks with the EAMs of every access although the
simulator shows it only the GPU's misses. Each access is counted once, by the first tier that sees it: the
tiers of a run are shown one access with the same ``ctx.clock`` and key.

The initial fill (section 6.1): "the GPU cache is initialized with experts with topological order where
experts are filled into GPU layer by layer". With ``fill="layers"`` the cache starts full of the first
experts in that order, layer 0's, then layer 1's, ... (``placement``, which the replay and the timed
simulator load before the first access; the runtime's ``preload`` fills its fast tier in the same key
order); the default ``fill="empty"`` starts empty, as the other policies do.

Why ``running`` is not a scan of the cache: within one layer the order is the order of the counts (the row
sum and the layer decay are common to the layer), so each instance keeps its resident experts of each layer
ranked by count, updated in O(log n) when a count changes, and a miss compares the L layer minima (each
cached until its layer changes). When a sequence ends, the layers its EAM reached are re-ranked.
``request`` ranks by a different EAM at every access, so its ``victim`` scans the residents.

The compiled replay (``replay_kernel``) is given each trace row's request and whether it is the request's
last row (``run_kernel_arguments``). With ``running`` it keeps the running counts in an array over the flat
expert ids and each layer's residents in a keyed heap of policies/_ranked.py (rows of one two-dimensional
array), and ends a request by taking each of its requests back out of the counts (its rows are chained, each
a run of positions); with ``request`` it keeps the EAMs of the running sequences in rows of one array, reused
as sequences end, and the residents in a linked list by recency (policies/_linked.py).
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
from moe_offload.policies._ranked import RankedKeys, heap_pop, heap_push, heap_update
from moe_offload.policies._sequence_eams import SequenceEAMs
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.trace.flatten import last_row_of_each_request

EPSILON = 1e-6
RANKINGS = ("running", "request")
FILLS = ("empty", "layers")


class MoEInfinity(EvictionPolicy):
    name = "moe-infinity"
    summary = ("activation-aware: evict the lowest (EAM ratio + eps) * (1 - layer/L), EAM of the running "
               "sequences")
    source = "paper 002, Algorithm 2"
    replay_cost = 9.6  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, eam: str = "running", shared: SequenceEAMs | None = None, fill: str = "empty"):
        super().__init__(spec, seed)
        if eam not in RANKINGS:
            raise ConfigError(f"{self.name}: eam must be one of {', '.join(RANKINGS)}, not {eam!r}")
        if fill not in FILLS:
            raise ConfigError(f"{self.name}: fill must be one of {', '.join(FILLS)}, not {fill!r}")
        self.fill = fill
        L, J = spec.num_layers, spec.num_experts
        if shared is None:
            shared = SequenceEAMs(L, J)
        elif not isinstance(shared, SequenceEAMs) or (shared.num_layers, shared.num_experts) != (L, J):
            raise ConfigError(f"{self.name}: shared must be the SequenceEAMs of a {L} x {J} model, "
                              f"not {shared!r}")
        self.sequences = shared
        self.ranking = eam
        if eam == "running":
            self._by_layer = [RankedKeys() for _ in range(L)]  # resident experts of a layer, ranked by count
            self._layer_min: list = [None] * L  # (p, key) of each layer's best victim; None = recompute
            shared._rankers.append(self)
        else:
            self._recency: dict = {}  # resident keys, least recently used first

    @classmethod
    def run_factory(cls, spec, seed=0, **options):
        shared = SequenceEAMs(spec.num_layers, spec.num_experts)
        return lambda: cls(spec, seed=seed, shared=shared, **options)

    def placement(self, slots, trace):
        """The initial fill (module doc): the first ``slots`` keys, layer by layer, with ``fill="layers"``."""
        if self.fill == "empty":
            return []
        return list(range(min(slots, self.spec.num_layers * self.spec.num_experts)))

    def priority(self, key, eam=None) -> float:
        """Algorithm 2, steps 6-8, for one expert, with ``eam`` (``[L][J]`` counts; default the running sum)."""
        L, J = self.spec.num_layers, self.spec.num_experts
        layer, expert = divmod(key, J)
        if eam is None:
            count, total = self.sequences.running[layer][expert], self.sequences.running_row_sum[layer]
        else:
            count, total = eam[layer][expert], sum(eam[layer])
        ratio = count / total if total else 0.0
        return (ratio + EPSILON) * (1.0 - layer / L)

    # ------------------------------------------------------------------------------------------ hooks

    def on_access(self, key, ctx):
        self.sequences.count(key, ctx)
        if self.ranking == "request" and key in self._recency:
            self._recency[key] = self._recency.pop(key)

    def on_insert(self, key, ctx):
        if self.ranking == "request":
            self._recency[key] = None
            return
        layer, expert = divmod(key, self.spec.num_experts)
        self._by_layer[layer].set(key, self.sequences.running[layer][expert])
        self._layer_min[layer] = None

    def on_evict(self, key):
        if self.ranking == "request":
            self._recency.pop(key, None)
            return
        layer = key // self.spec.num_experts
        self._by_layer[layer].discard(key)
        self._layer_min[layer] = None

    def on_request_end(self, request):
        self.sequences.end(request)

    def victim(self, ctx):
        if self.ranking == "request":
            return self._victim_of(self.sequences.eam(ctx.request), ctx.pinned)
        pinned = ctx.pinned
        best = None
        for layer, ranked in enumerate(self._by_layer):
            candidate = None if pinned else self._layer_min[layer]
            if candidate is None:
                lowest = ranked.lowest(pinned)
                if lowest is None:
                    continue
                candidate = (self.priority(lowest[1]), lowest[1])
                if not pinned:
                    self._layer_min[layer] = candidate
            if best is None or candidate[0] < best[0]:
                best = candidate
        if best is None:
            raise NoEvictableExpert
        return best[1]

    # ------------------------------------------------------------------------------------------ internals

    def _count_changed(self, key, layer, count) -> None:
        """The running count of ``key`` (layer ``layer``) is now ``count`` and its layer's row sum changed."""
        self._layer_min[layer] = None
        ranked = self._by_layer[layer]
        if key in ranked:
            ranked.set(key, count)

    def _rerank(self, layers) -> None:
        """The running counts of ``layers`` dropped (a sequence ended)."""
        running, J = self.sequences.running, self.spec.num_experts
        for layer in layers:
            row = running[layer]
            self._by_layer[layer].rescore_all(lambda key: row[key % J])
            self._layer_min[layer] = None

    def _victim_of(self, eam, pinned):
        """``eam="request"``: the lowest priority under ``eam`` among the unpinned residents, least recently
        used first on ties."""
        J, L = self.spec.num_experts, self.spec.num_layers
        totals = [sum(row) for row in eam]
        best, best_p = None, None
        for key in self._recency:
            if key in pinned:
                continue
            layer, expert = divmod(key, J)
            total = totals[layer]
            p = ((eam[layer][expert] / total if total else 0.0) + EPSILON) * (1.0 - layer / L)
            if best is None or p < best_p:
                best, best_p = key, p
        if best is None:
            raise NoEvictableExpert
        return best

    # ------------------------------------------------------------------------------------------ compiled

    def run_kernel_arguments(self, slots, trace):
        """[ranks by the request's EAM, fills by layers, most sequences running at once], then one code per
        trace row: the index of its request times 2, plus 1 on the request's last row."""
        _, first, index = np.unique(trace.request, return_index=True, return_inverse=True)
        rows = index.size
        last = last_row_of_each_request(trace.request)
        codes = 2 * index.reshape(-1).astype(np.int64)
        codes[last] += 1
        ending = np.bincount(last, minlength=rows)
        running = np.cumsum(np.bincount(first, minlength=rows)) - (np.cumsum(ending) - ending)  # at each row
        head = [self.ranking == "request", self.fill == "layers", running.max() if rows else 0]
        return np.zeros(0, np.float64), np.concatenate([np.array(head, np.int64), codes])

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them (module doc), with ``run_kernel_arguments``'s
        ``ints``: the same priorities from the same floating point operations, the same ties (a heap entry
        is stamped with the clock that set it; the initial fill before clock 0, in key order)."""
        by_request, most_running = ints[0] == 1, ints[2]
        rows = ints[3:]
        L, J, num_keys = num_layers, num_experts, num_layers * num_experts
        room = max(capacity, 1)
        heap_keys = np.empty((L, room), np.int64)
        heap_scores = np.empty((L, room), np.float64)
        heap_stamps = np.empty((L, room), np.int64)
        position = np.full(num_keys, -1, np.int64)
        layer_size = np.zeros(L, np.int64)
        running = np.zeros(num_keys, np.int64)
        row_sum = np.zeros(L, np.int64)
        layer_priority = np.zeros(L)  # p of each layer's least counted resident, while not stale
        stale = np.ones(L, np.bool_)  # its layer's counts or least counted resident changed since
        recency = lists_new(num_keys, 1)
        eams = np.zeros((most_running if by_request else 0, num_keys + L), np.int64)  # counts, then row sums
        free_eams = np.arange(eams.shape[0])[::-1].copy()
        num_free = eams.shape[0]
        num_requests = np.max(rows >> 1) + 1 if rows.size else 0
        eam_of = np.full(num_requests, -1, np.int64)
        latest_row = np.full(num_requests, -1, np.int64)
        previous_row = np.full(rows.size, -1, np.int64)  # the request's row before, chained
        row_start = np.zeros(rows.size, np.int64)
        row_end = np.zeros(rows.size, np.int64)
        resident = np.zeros(num_keys, np.bool_)
        size = min(capacity, num_keys) if ints[1] == 1 else 0  # fill="layers": the first keys
        for key in range(size):
            resident[key] = True
            if by_request:
                list_append(recency, 0, key)
            else:
                layer = key // J
                heap_push(heap_keys[layer], heap_scores[layer], heap_stamps[layer], position, layer_size[layer],
                          key, 0.0, key - size)
                layer_size[layer] += 1
        current = -1
        eam = -1
        for t in range(keys.shape[0]):
            row = tokens[t]
            if row != current:
                if current >= 0:
                    row_end[current] = t
                    if rows[current] & 1:
                        num_free = _end_request(rows[current] >> 1, by_request, eams, free_eams, num_free, eam_of,
                                                latest_row, previous_row, row_start, row_end, keys, running,
                                                row_sum, J, heap_keys, heap_scores, heap_stamps, position,
                                                layer_size)
                        stale[:] = True
                current = row
                row_start[row] = t
                request = rows[row] >> 1
                previous_row[row] = latest_row[request]
                latest_row[request] = row
                if by_request and eam_of[request] < 0:
                    num_free -= 1
                    eam_of[request] = free_eams[num_free]
                eam = eam_of[request]
            key = keys[t]
            layer = key // J
            if by_request:
                eams[eam, key] += 1
                eams[eam, num_keys + layer] += 1
            else:
                running[key] += 1
                row_sum[layer] += 1
                stale[layer] = True
            if resident[key]:
                key_hits[key] += 1
                if by_request:
                    list_move_to_tail(recency, 0, key)
                else:
                    heap_update(heap_keys[layer], heap_scores[layer], heap_stamps[layer], position,
                                layer_size[layer], key, running[key], t)
                continue
            if size == capacity:
                if by_request:
                    victim = _request_victim(recency, eams, eam, num_keys, L, J)
                    list_remove(recency, 0, victim)
                else:
                    victim = _running_victim(heap_keys, layer_size, running, row_sum, L, layer_priority, stale)
                    lowest = victim // J
                    stale[lowest] = True  # its least counted resident leaves
                    heap_pop(heap_keys[lowest], heap_scores[lowest], heap_stamps[lowest], position,
                             layer_size[lowest])
                    layer_size[lowest] -= 1
                resident[victim] = False
                size -= 1
            resident[key] = True
            size += 1
            if by_request:
                list_append(recency, 0, key)
            else:
                heap_push(heap_keys[layer], heap_scores[layer], heap_stamps[layer], position, layer_size[layer],
                          key, running[key], t)
                layer_size[layer] += 1
                stale[layer] = True  # the request may be its layer's least counted now


def _priority(count, total, layer, num_layers):
    """Algorithm 2, steps 6-8, as ``priority`` computes it."""
    ratio = count / total if total else 0.0
    return (ratio + EPSILON) * (1.0 - layer / num_layers)


def _running_victim(heap_keys, layer_size, running, row_sum, num_layers, layer_priority, stale):
    """The lowest priority among the layers' least counted residents, the first layer on ties. A layer's
    priority is computed again only where ``stale`` says its counts or its least counted resident changed (a
    miss comes a few requests after the last, which reached a few of the L layers)."""
    chosen, best = -1, 0.0
    for layer in range(num_layers):
        if layer_size[layer] > 0:
            if stale[layer]:
                layer_priority[layer] = _priority(running[heap_keys[layer, 0]], row_sum[layer], layer, num_layers)
                stale[layer] = False
            if chosen < 0 or layer_priority[layer] < best:
                chosen, best = layer, layer_priority[layer]
    return heap_keys[chosen, 0] if chosen >= 0 else -1


def _request_victim(recency, eams, eam, num_keys, num_layers, num_experts):
    """The lowest priority under the EAM in row ``eam`` among the residents, least recently used first."""
    victim, best = -1, 0.0
    key = list_head(recency, 0)
    while key >= 0:
        layer = key // num_experts
        p = _priority(eams[eam, key], eams[eam, num_keys + layer], layer, num_layers)
        if victim < 0 or p < best:
            victim, best = key, p
        key = recency[1][key]
    return victim


def _end_request(request, by_request, eams, free_eams, num_free, eam_of, latest_row, previous_row, row_start,
                 row_end, keys, running, row_sum, num_experts, heap_keys, heap_scores, heap_stamps, position,
                 layer_size):
    """``on_request_end``: the request's EAM row is freed, or its requests leave the running counts and the
    layers they reached are re-ranked (each resident keeps its stamp: their order among equal counts).
    Returns the number of free EAM rows."""
    if by_request:
        eams[eam_of[request]] = 0
        free_eams[num_free] = eam_of[request]
        eam_of[request] = -1
        return num_free + 1
    reached = np.zeros(row_sum.size, np.bool_)
    row = latest_row[request]
    while row >= 0:
        for t in range(row_start[row], row_end[row]):
            key = keys[t]
            running[key] -= 1
            row_sum[key // num_experts] -= 1
            reached[key // num_experts] = True
        row = previous_row[row]
    for layer in range(row_sum.size):
        if reached[layer]:
            members = heap_keys[layer, :layer_size[layer]].copy()
            stamps = heap_stamps[layer, :layer_size[layer]].copy()
            for i in range(members.size):
                heap_push(heap_keys[layer], heap_scores[layer], heap_stamps[layer], position, i, members[i],
                          running[members[i]], stamps[i])
    return num_free
