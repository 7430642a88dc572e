"""MoE-Infinity's activation-aware cache replacement (paper 002, Algorithm 2).

The current sequence's Expert Activation Matrix (EAM) counts, per layer, how many of the sequence's
tokens each expert has served so far. A cached expert e of layer l has priority
    p = (EAM[l][e] / sum(EAM[l]) + EPSILON) * (1 - l / L)
and the lowest p is replaced. The EAM starts empty with each new sequence (Algorithm 1, step 2).

Why this is not a scan of the cache: within one layer the order is the order of the counts (the row sum
and the layer decay are common to the layer), so each layer keeps its resident experts ranked by count,
updated in O(log n) per request, and a miss compares the L layer minima (each cached until its layer changes).
"""

from __future__ import annotations

from moe_offload.policies._ranked import RankedKeys
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert

EPSILON = 1e-6


class MoEInfinity(EvictionPolicy):
    name = "moe-infinity"
    summary = "activation-aware: evict the lowest (EAM ratio + eps) * (1 - layer/L) of the current sequence"
    source = "paper 002, Algorithm 2"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        L, J = spec.num_layers, spec.num_experts
        self._eam = [[0] * J for _ in range(L)]
        self._row_sum = [0] * L
        self._by_layer = [RankedKeys() for _ in range(L)]  # resident experts of a layer, ranked by count
        self._layer_min: list = [None] * L  # (p, key) of each layer's best victim; None = recompute
        self._request = None

    def _start_sequence(self, request):
        self._request = request
        self._eam = [[0] * self.spec.num_experts for _ in range(self.spec.num_layers)]
        self._row_sum = [0] * self.spec.num_layers
        for ranked in self._by_layer:  # every resident expert's count is 0 in the new sequence
            ranked.reset_all(0)
        self._layer_min = [None] * self.spec.num_layers

    def priority(self, key) -> float:
        """Algorithm 2, steps 6-8, for one expert."""
        L, J = self.spec.num_layers, self.spec.num_experts
        layer, expert = divmod(key, J)
        total = self._row_sum[layer]
        ratio = self._eam[layer][expert] / total if total else 0.0
        return (ratio + EPSILON) * (1.0 - layer / L)

    def on_access(self, key, ctx):
        if ctx.request != self._request:
            self._start_sequence(ctx.request)
        layer, expert = divmod(key, self.spec.num_experts)
        row = self._eam[layer]
        row[expert] += 1
        self._row_sum[layer] += 1
        self._layer_min[layer] = None
        ranked = self._by_layer[layer]
        if key in ranked:
            ranked.set(key, row[expert])

    def on_insert(self, key, ctx):
        layer, expert = divmod(key, self.spec.num_experts)
        self._by_layer[layer].set(key, self._eam[layer][expert])
        self._layer_min[layer] = None

    def on_evict(self, key):
        layer = key // self.spec.num_experts
        self._by_layer[layer].discard(key)
        self._layer_min[layer] = None

    def victim(self, ctx):
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
