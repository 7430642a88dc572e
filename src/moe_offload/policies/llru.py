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

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
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

    @staticmethod
    def replay_kernel(keys, clocks, tokens, next_use, capacity, num_layers, num_experts, floats, ints,
                      layer_hits):
        """The hooks above as the compiled replay runs them, without looking at every layer head on a miss.

        D < L, so the victim is the head with the largest R, and among those the largest D. The oldest expert
        of all is a layer head with the largest R; every head with that R was requested within L clocks of
        it. So the residents are also kept in one list by last request: the victim is found by walking it from
        the oldest while R stays the largest (at most L experts, usually a few), among the layer heads met.
        Two heads never tie: each layer has one head, and D differs between layers."""
        L = num_layers
        num_keys = L * num_experts
        by_layer = lists_new(num_keys, L)  # each layer's residents, least recent first
        by_age = lists_new(num_keys, 1)    # all residents, least recent first
        before_in_layer, after_in_age = by_layer[0], by_age[1]
        tau = np.zeros(num_keys, np.int64)
        resident = np.zeros(num_keys, np.bool_)
        size = 0
        for i in range(keys.size):
            key, t = keys[i], clocks[i]
            b = key // num_experts
            tau[key] = t
            if resident[key]:
                layer_hits[b] += 1
                list_move_to_tail(by_layer, b, key)
                list_move_to_tail(by_age, 0, key)
                continue
            if size == capacity:
                oldest = list_head(by_age, 0)
                oldest_rounds = (t - tau[oldest]) // L  # the largest R
                best_distance, victim = -1, -1
                candidate = oldest
                while candidate >= 0 and t - tau[candidate] >= oldest_rounds * L:  # R is still the largest
                    if before_in_layer[candidate] < 0:  # a layer head
                        distance = (candidate // num_experts - b) % L  # D
                        if distance > best_distance:
                            best_distance, victim = distance, candidate
                    candidate = after_in_age[candidate]
                list_remove(by_layer, victim // num_experts, victim)
                list_remove(by_age, 0, victim)
                resident[victim] = False
                size -= 1
            list_append(by_layer, b, key)
            list_append(by_age, 0, key)
            resident[key] = True
            size += 1
