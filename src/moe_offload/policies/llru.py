"""LLRU, the layered LRU of paper 001 (Definition 2).

For a resident expert p last requested at clock tau, at the current clock t serving layer b:
    R(p, t) = floor((t - tau) / L)          the last-round index: full rounds since p's last request
    D(p, t) = (layer(p) - b) mod L          the relative layer distance: requests until p's layer comes
On a miss, evict the largest R; among those the largest D; any remaining tie goes to the older request.

Why a miss looks at L experts, not the whole cache: D is the same for every expert of a layer and R only
grows with age, so within a layer the least recently requested expert ranks first. Each layer keeps its
experts in LRU order, and the victim is the best of the L layer heads.
"""

from __future__ import annotations

from collections import OrderedDict

from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LLRU(EvictionPolicy):
    name = "llru"
    summary = "layered LRU: evict the largest last-round index R, ties by largest layer distance D"
    source = "paper 001, Definition 2"

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        # per layer: key -> clock of its last request (tau), least recent first
        self._by_layer = [OrderedDict() for _ in range(spec.num_layers)]
        self._head = [None] * spec.num_layers  # (key, tau) of each layer's least recent expert

    def _refresh_head(self, layer):
        experts = self._by_layer[layer]
        self._head[layer] = next(iter(experts.items())) if experts else None

    def on_access(self, key, ctx):
        layer = key // self.spec.num_experts
        experts = self._by_layer[layer]
        if key in experts:
            experts[key] = ctx.clock
            experts.move_to_end(key)
            if self._head[layer][0] == key:
                self._refresh_head(layer)

    def on_insert(self, key, ctx):
        layer = key // self.spec.num_experts
        self._by_layer[layer][key] = ctx.clock
        if self._head[layer] is None:
            self._head[layer] = (key, ctx.clock)

    def on_evict(self, key):
        layer = key // self.spec.num_experts
        del self._by_layer[layer][key]
        if self._head[layer][0] == key:
            self._refresh_head(layer)

    def victim(self, ctx):
        L = self.spec.num_layers
        t, b, pinned = ctx.clock, ctx.layer, ctx.pinned
        best_score, best_age, best_key = -1, -1, None
        for layer, head in enumerate(self._head):
            if head is None:
                continue
            key, tau = head
            if key in pinned:  # rare: look past the pinned experts of this layer
                key, tau = next(((k, v) for k, v in self._by_layer[layer].items() if k not in pinned), (None, 0))
                if key is None:
                    continue
            age = t - tau
            score = (age // L) * L + (layer - b) % L  # R, then D, in one number (D < L)
            if score > best_score or (score == best_score and age > best_age):
                best_score, best_age, best_key = score, age, key
        if best_key is None:
            raise NoEvictableExpert
        return best_key
