"""Decayed LFU: evict the resident expert of lowest exponentially decayed request count, a frequency that
forgets (LRFU's family; what the withdrawn expert-cache pull request of llama.cpp and others propose, so
that an expert hot in an earlier topic does not stay forever).

The rule. Each request of key k at clock t_i adds 1 to its score, which then halves every h requests:

    s_k(t) = sum_{t_i <= t} 2^(-(t - t_i) / h)

so h -> infinity is LFU (with counts kept across evictions) and h -> 0 orders by the last request, LRU.
The history is kept for every key, resident or not (a key coming back keeps its decayed past). All scores
decay by the same factor between two clocks, so their order only changes when a key is requested: the
ranking key a_k = log2 s_k(t_k) + t_k / h (t_k: k's last request) is fixed between k's requests, and
s_k(t) < s_j(t) exactly when a_k < a_j. A request at t updates s_k(t) = 2^(a_k - t / h) + 1 and
a_k = log2 s_k(t) + t / h. Ties go to the key ranked earliest (its score set first).

The compiled replay (``replay_kernel``) keeps a_k in an array over the flat expert ids and the residents in
the keyed heap of policies/_ranked.py, ordered by (a_k, clock it was set).
"""

from __future__ import annotations

import math

import numpy as np

from moe_offload.policies._ranked import RankedKeys, heap_new, heap_push, heap_replace_first, heap_update
from moe_offload.policies.base import EvictionPolicy
from moe_offload.values import number


class DecayedLFU(EvictionPolicy):
    name = "lfu-decay"
    summary = "decayed LFU: evict the lowest request count that halves every half_life requests"
    source = "LRFU-style exponential decay of frequency (llama.cpp's withdrawn expert-cache PR and others)"
    replay_cost = 5.5  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, half_life=None):
        super().__init__(spec, seed)
        # default: one full pass over the model's experts, L * J requests
        default = spec.num_layers * spec.num_experts
        self.half_life = number(default if half_life is None else half_life, "lfu-decay.half_life", low=0.0,
                                low_open=True)
        self._rank: dict = {}  # key -> a_k (module doc), every key requested so far
        self._ranked = RankedKeys()  # the residents by a_k

    def score(self, key, clock) -> float:
        """s_k at ``clock``, 0 for a key never requested."""
        rank = self._rank.get(key)
        return 0.0 if rank is None else 2.0 ** (rank - clock / self.half_life)

    def on_access(self, key, ctx):
        now = ctx.clock / self.half_life
        rank = self._rank.get(key)
        score = 1.0 if rank is None else 2.0 ** (rank - now) + 1.0
        self._rank[key] = math.log2(score) + now
        if key in self._ranked:
            self._ranked.set(key, self._rank[key])

    def on_insert(self, key, ctx):
        # a prefetch not yet requested has s = 0: log2(0) is -inf, ranked first
        self._ranked.set(key, self._rank.get(key, -math.inf))

    def on_evict(self, key):
        self._ranked.discard(key)

    def victim(self, ctx):
        return self._ranked.victim(ctx.pinned)

    def kernel_arguments(self):
        return np.array([self.half_life], np.float64), np.zeros(0, np.int64)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: a_k of every key requested so far, computed with
        the same floating point operations (the half-life is ``floats[0]``), and the residents in a heap
        ordered by (a_k, last set)."""
        half_life = floats[0]
        num_keys = num_layers * num_experts
        order, scores, stamps, position = heap_new(capacity, num_keys)
        rank = np.zeros(num_keys, np.float64)
        requested = np.zeros(num_keys, np.bool_)
        resident = np.zeros(num_keys, np.bool_)
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            now = t / half_life
            score = 2.0 ** (rank[key] - now) + 1.0 if requested[key] else 1.0
            rank[key] = math.log2(score) + now
            requested[key] = True
            if resident[key]:
                key_hits[key] += 1
                heap_update(order, scores, stamps, position, size, key, rank[key], t)
                continue
            resident[key] = True
            if size == capacity:  # the victim leaves and the request enters in one sift
                resident[heap_replace_first(order, scores, stamps, position, size, key, rank[key], t)] = False
            else:
                heap_push(order, scores, stamps, position, size, key, rank[key], t)
                size += 1
