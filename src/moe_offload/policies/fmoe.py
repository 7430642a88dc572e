"""fMoE's eviction priority (paper 000, section "Expert Caching and Eviction").

    PRI_evict[l, j] = 1 / (p[l, j] * freq[l, j])

freq is the cache visit frequency of the expert (requests since it entered the cache) and p its
probability in the searched expert map; the highest PRI (lowest p * freq) is evicted first, ties to the
least recently requested. The map is the prefetcher's prediction (ctx.predicted) when a prefetcher runs;
without one, the latest router distribution observed for each layer (ctx.probs when the trace records
full probabilities). A trace with neither gives a uniform p, and fMoE reduces to LFU (the simulator says so).

Why a vectorised argmin rather than a heap: every new map changes p for all experts of a layer at once,
so a heap would be rebuilt at every layer; the priorities live in [L, J] arrays and a miss takes one
masked argmin.
"""

from __future__ import annotations

import numpy as np

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert

P_FLOOR = 1e-6  # a zero probability would make the priority infinite for every such expert alike


class FMoE(EvictionPolicy):
    name = "fmoe"
    summary = "fMoE: evict the highest 1 / (p * freq), p from the expert map (prefetcher's or last observed)"
    source = "paper 000, Expert eviction priority"
    needs_probs = True

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        L, J = spec.num_layers, spec.num_experts
        self._freq = np.zeros(L * J, dtype=np.float64)
        self._last = np.zeros(L * J, dtype=np.int64)
        self._resident = np.zeros(L * J, dtype=bool)
        self._observed = np.full((L, J), 1.0 / J)  # latest router distribution seen per layer
        self._observed_token = [-1] * L

    def on_access(self, key, ctx):
        layer = key // self.spec.num_experts
        if ctx.probs is not None and self._observed_token[layer] != ctx.token:
            self._observed[layer] = ctx.probs[layer]
            self._observed_token[layer] = ctx.token
        if self._resident[key]:
            self._freq[key] += 1
            self._last[key] = ctx.clock

    def on_insert(self, key, ctx):
        self._resident[key] = True
        self._freq[key] = 0 if ctx.prefetch else 1
        self._last[key] = ctx.clock

    def on_evict(self, key):
        self._resident[key] = False

    def victim(self, ctx):
        p = ctx.predicted if ctx.predicted is not None else self._observed
        score = np.maximum(np.asarray(p, dtype=np.float64).reshape(-1), P_FLOOR) * self._freq
        candidates = self._resident.copy()
        for key in ctx.pinned:
            candidates[key] = False
        if not candidates.any():
            raise NoEvictableExpert
        score[~candidates] = np.inf
        lowest = score.min()
        tied = np.flatnonzero(score == lowest)
        return int(tied[np.argmin(self._last[tied])]) if tied.size > 1 else int(tied[0])
