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
        # freq is +inf for experts not in the cache, so p * freq ranks only resident ones.
        self._freq = np.full(L * J, np.inf)
        self._last = np.zeros(L * J, dtype=np.int64)
        self._observed = np.full(L * J, 1.0 / J)  # latest router distribution seen per layer, floored
        self._observed_token = [-1] * L

    def on_access(self, key, ctx):
        J = self.spec.num_experts
        layer = key // J
        if ctx.probs is not None and self._observed_token[layer] != ctx.token:
            np.maximum(ctx.probs[layer], P_FLOOR, out=self._observed[layer * J:(layer + 1) * J])
            self._observed_token[layer] = ctx.token
        freq = self._freq[key]
        if freq != np.inf:
            self._freq[key] = freq + 1
            self._last[key] = ctx.clock

    def on_insert(self, key, ctx):
        self._freq[key] = 0 if ctx.prefetch else 1
        self._last[key] = ctx.clock

    def on_evict(self, key):
        self._freq[key] = np.inf

    def victim(self, ctx):
        if ctx.predicted is not None:
            p = np.maximum(np.asarray(ctx.predicted, dtype=np.float64).reshape(-1), P_FLOOR)
        else:
            p = self._observed
        score = p * self._freq
        for key in ctx.pinned:
            score[key] = np.inf
        best = int(score.argmin())
        lowest = score[best]
        if lowest == np.inf:
            raise NoEvictableExpert
        tied = np.flatnonzero(score == lowest)
        return int(tied[np.argmin(self._last[tied])]) if tied.size > 1 else best
