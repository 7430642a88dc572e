"""LFRU, the frequency-weighted LRU of vLLM's expert cache (vllm-project/vllm PR #37190, "MoE expert CPU
offloading with GPU cache", ``--moe-expert-cache-size``): evict the resident expert of least ``freq / age``.

The rule, as the PR's production implementation defines it (e1n00r/tinyserve, tinyserve/cache_policy.py,
``LFRUPolicy``, which the PR cites as its validation). The cache keeps a clock that advances by one on
every hit and every insertion (a miss does not advance it until its expert is inserted); each resident
expert k keeps its frequency f_k (1 when inserted, +1 per hit) and the clock of its last use t_k (its
insertion or latest hit). When room is needed, with the clock at T, the victim is

    argmin_k  f_k / (T - t_k + 1)

scanning the residents in the order they entered the cache, so that among equal scores the one cached
longest goes first (its counters reset when it is evicted: a re-inserted expert starts at f = 1). An expert
used often keeps its slot for a while after its last use (the f in the numerator); one used once long ago
leaves first (LRU among the once-used, since f = 1 for all of them). Why frequency: LRU alone lets the
experts of the early layers of a forward pass, used one after another, push out the later layers' hot
experts (the PR's motivation, "LFRU prevents early layers from monopolizing the cache").

The PR gives each MoE layer its own cache of N slots: that is ``lfru-dist`` (the cache split equally
among the layers, one LFRU with its own clock per layer); ``lfru`` is one LFRU over the whole cache.
"""

from __future__ import annotations

import numpy as np

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LFRU(EvictionPolicy):
    name = "lfru"
    summary = "frequency-weighted LRU: evict the expert of least uses / (clock - last use + 1)"
    source = "vLLM PR #37190 (--moe-expert-cache-size), LFRUPolicy of e1n00r/tinyserve tinyserve/cache_policy.py"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self.clock = 0
        self._entries: dict = {}  # key -> [uses, clock of last use], in the order the keys entered

    def on_access(self, key, ctx):
        entry = self._entries.get(key)
        if entry is not None:  # a hit: a miss advances the clock only when its expert is inserted
            self.clock += 1
            entry[0] += 1
            entry[1] = self.clock

    def on_insert(self, key, ctx):
        self.clock += 1
        self._entries[key] = [1, self.clock]

    def on_evict(self, key):
        del self._entries[key]

    def victim(self, ctx):
        best, best_score = None, np.inf
        for key, (uses, last) in self._entries.items():
            if key in ctx.pinned:
                continue
            score = uses / (self.clock - last + 1)
            if score < best_score:  # strict: among equal scores the first to have entered
                best, best_score = key, score
        if best is None:
            raise NoEvictableExpert
        return best

    @staticmethod
    def replay_kernel(keys, clocks, tokens, next_use, capacity, num_layers, num_experts, floats, ints,
                      layer_hits):
        """The hooks above as the compiled replay runs them: the residents scanned for the least score, ties
        to the earliest insertion (the order of the Python dict)."""
        num_keys = num_layers * num_experts
        uses = np.zeros(num_keys, np.int64)  # 0: not resident
        last = np.zeros(num_keys, np.int64)
        entered = np.zeros(num_keys, np.int64)
        residents = np.zeros(max(capacity, 1), np.int64)
        size = 0
        clock = 0
        insertions = 0
        for t in clocks:
            key = keys[t]
            if uses[key] > 0:
                layer_hits[key // num_experts] += 1
                clock += 1
                uses[key] += 1
                last[key] = clock
                continue
            if size == capacity:
                chosen = 0
                best = np.inf
                for slot in range(size):
                    resident = residents[slot]
                    score = uses[resident] / (clock - last[resident] + 1)
                    if score < best or (score == best and entered[resident] < entered[residents[chosen]]):
                        best = score
                        chosen = slot
                uses[residents[chosen]] = 0
                size -= 1
                residents[chosen] = residents[size]
            clock += 1
            insertions += 1
            uses[key] = 1
            last[key] = clock
            entered[key] = insertions
            residents[size] = key
            size += 1
