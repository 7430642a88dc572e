"""LLRU, the layered LRU of paper 001 (Definition 2).

For a resident expert p last requested at clock tau, at the current clock t serving layer b:
    R(p, t) = floor((t - tau) / L)          the last-round index: full rounds since p's last request
    D(p, t) = (layer(p) - b) mod L          the relative layer distance: requests until p's layer comes
On a miss, evict the largest R; among those the largest D; any remaining tie goes to the older request.

Why only two rounds are examined: R is either (t//L - tau//L) or one less, so the maximum R is reached
by experts of the oldest round still in the cache or of the round after it. Experts are kept in buckets
by round, in increasing round order, and a miss looks at O(size of two rounds) experts, not the cache.
"""

from __future__ import annotations

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LLRU(EvictionPolicy):
    name = "llru"
    summary = "layered LRU: evict the largest last-round index R, ties by largest layer distance D"
    source = "paper 001, Definition 2"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._last: dict = {}     # key -> clock of its last request (tau)
        self._rounds: dict = {}   # round -> {key: None}; dict order is increasing round order

    def _place(self, key, clock):
        self._last[key] = clock
        rnd = clock // self.spec.num_layers
        bucket = self._rounds.get(rnd)
        if bucket is None:
            self._rounds[rnd] = {key: None}
        else:
            bucket[key] = None

    def _unplace(self, key):
        rnd = self._last.pop(key) // self.spec.num_layers
        bucket = self._rounds[rnd]
        del bucket[key]
        if not bucket:
            del self._rounds[rnd]

    def on_access(self, key, ctx):
        if key in self._last:
            self._unplace(key)
            self._place(key, ctx.clock)

    def on_insert(self, key, ctx):
        self._place(key, ctx.clock)

    def on_evict(self, key):
        self._unplace(key)

    def victim(self, ctx):
        L, J = self.spec.num_layers, self.spec.num_experts
        t, b, pinned = ctx.clock, ctx.layer, ctx.pinned
        best_rank, best_key, first_round = None, None, None
        for rnd, bucket in self._rounds.items():
            if first_round is not None and rnd > first_round + 1:
                break
            for key in bucket:
                if key in pinned:
                    continue
                tau = self._last[key]
                rank = ((t - tau) // L, (key // J - b) % L, -tau)
                if best_rank is None or rank > best_rank:
                    best_rank, best_key = rank, key
            if best_key is not None and first_round is None:
                first_round = rnd
        if best_key is None:
            raise NoEvictableExpert
        return best_key
