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

The compiled replay (no prefetcher, so p is the observed distribution) is given the trace's probabilities,
floored as ``observed`` floors them (``run_kernel_arguments``), and scans the residents at a miss. A trace
without them gives a uniform p: p * freq then orders as freq does (1/J times distinct whole numbers stays
distinct), ties to the least recently requested, which is LFU's order, so the kernel runs LFU's.
"""

from __future__ import annotations

import numpy as np

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.lfu import LFU

P_FLOOR = 1e-6  # a zero probability would make the priority infinite for every such expert alike
_lfu_replay = LFU.replay_kernel  # the kernel of a uniform p (module docstring)


def observed(probs: np.ndarray) -> np.ndarray:
    """The router's probabilities as p: float64, floored at P_FLOOR (any shape)."""
    return np.maximum(np.asarray(probs, dtype=np.float64), P_FLOOR)


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

    def run_kernel_arguments(self, slots, trace):
        """The trace's probabilities as ``observed`` floors them, token by token ([N * L * J] float64: four times
        the trace's float16 column while the replay runs); none (a uniform p) when it has none."""
        if trace.probs is None:
            return np.zeros(0, np.float64), np.zeros(0, np.int64)
        return observed(trace.probs).reshape(-1), np.zeros(0, np.int64)

    def replays_as(self, trace):
        return "lfu" if trace.probs is None else None  # a uniform p ranks as LFU (module docstring)

    def on_access(self, key, ctx):
        J = self.spec.num_experts
        layer = key // J
        if ctx.probs is not None and self._observed_token[layer] != ctx.token:
            self._observed[layer * J:(layer + 1) * J] = observed(ctx.probs[layer])
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
            p = observed(np.asarray(ctx.predicted).reshape(-1))
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

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above with p observed from ``floats`` (the floored probabilities of every token, layer and
        expert): at a miss with the cache full, the resident of lowest p * freq (ties: the older last request)
        leaves, found by a scan of the residents. Without probabilities, LFU's kernel (module docstring)."""
        if floats.shape[0] == 0:
            _lfu_replay(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits)
            return
        num_keys = num_layers * num_experts
        p = np.full(num_keys, 1.0 / num_experts)
        p_token = np.full(num_layers, -1, np.int64)
        freq = np.zeros(num_keys, np.float64)  # 0: not resident (a resident's is at least 1)
        last = np.zeros(num_keys, np.int64)
        residents = np.zeros(capacity, np.int64)
        where = np.zeros(num_keys, np.int64)  # a resident's place in ``residents``
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            layer = key // num_experts
            token = tokens[t]
            if p_token[layer] != token:
                start = (token * num_layers + layer) * num_experts
                first = layer * num_experts
                for j in range(num_experts):
                    p[first + j] = floats[start + j]
                p_token[layer] = token
            last[key] = t
            if freq[key] > 0:
                key_hits[key] += 1
                freq[key] += 1
                continue
            freq[key] = 1
            if size < capacity:
                residents[size] = key
                where[key] = size
                size += 1
                continue
            victim = residents[0]  # the newcomer is not among the residents yet
            lowest = p[victim] * freq[victim]
            for i in range(1, size):
                other = residents[i]
                score = p[other] * freq[other]
                if score < lowest or (score == lowest and last[other] < last[victim]):
                    victim, lowest = other, score
            freq[victim] = 0
            residents[where[victim]] = key
            where[key] = where[victim]
