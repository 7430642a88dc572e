"""LLRU, the layered LRU of paper 001 (Definition 2).

For a resident expert p last requested at clock tau, at the current clock t serving layer b:
    R(p, t) = floor((t - tau) / L)          the last-round index: full rounds since p's last request
    D(p, t) = (layer(p) - b) mod L          the relative layer distance: requests until p's layer comes
On a miss, evict the largest R; among those the largest D; any remaining tie goes to the older request.

The clock is the replay's request number, round * L + layer. A timed or runtime access serves a whole pass,
so its count of accesses is not that clock (a layer requests K experts per token, several tokens' experts at
once in a batch); such a driver sets ``ctx.round`` (policies/base.py) and the clock is computed from it, so R
counts rounds as the replay does.

Why a miss looks at L experts, not the whole cache: D is the same for every expert of a layer and R only
grows with age, so within a layer the least recently requested expert ranks first. Each layer keeps its
experts in LRU order, and the victim is the best of the L layer heads.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LLRU(EvictionPolicy):
    name = "llru"
    summary = "layered LRU: evict the largest last-round index R, ties by largest layer distance D"
    source = "paper 001, Definition 2"
    replay_cost = 2.5  # LRU replays a kernel run costs (base.py)
    needs_rounds = True

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        # per layer: key -> clock of its last request (tau), least recent first
        self._by_layer = [OrderedDict() for _ in range(spec.num_layers)]
        self._head = [None] * spec.num_layers  # (key, tau) of each layer's least recent expert

    def _refresh_head(self, layer):
        experts = self._by_layer[layer]
        self._head[layer] = next(iter(experts.items())) if experts else None

    def _clock(self, ctx):
        """The replay's clock of the current request (module doc)."""
        return ctx.clock if ctx.round is None else ctx.round * self.spec.num_layers + ctx.layer

    def on_access(self, key, ctx):
        layer = key // self.spec.num_experts
        experts = self._by_layer[layer]
        if key in experts:
            experts[key] = self._clock(ctx)
            experts.move_to_end(key)
            if self._head[layer][0] == key:
                self._refresh_head(layer)

    def on_insert(self, key, ctx):
        layer = key // self.spec.num_experts
        now = self._clock(ctx)
        self._by_layer[layer][key] = now
        if self._head[layer] is None:
            self._head[layer] = (key, now)

    def on_evict(self, key):
        layer = key // self.spec.num_experts
        del self._by_layer[layer][key]
        if self._head[layer][0] == key:
            self._refresh_head(layer)

    def victim(self, ctx):
        L = self.spec.num_layers
        t, b, pinned = self._clock(ctx), ctx.layer, ctx.pinned
        # -inf: in a timed pass an expert can carry a later replay clock than now (a higher rank of an earlier
        # layer of the same pass), so its age and score are negative
        best_score, best_age, best_key = -math.inf, -math.inf, None
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
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them, without looking at every layer head on a miss.

        D < L, so the victim is the layer head with the largest R, and among those the largest D. The residents
        are kept in one list by last request (LRU's), so the oldest expert of all is a layer head with the
        largest R, and every head with that R was requested within L clocks after it. The victim is found by
        walking the list from the oldest while R stays the largest (at most L experts, usually a few): the
        first expert met of each layer is that layer's head. Two heads never tie: D differs between layers."""
        L = num_layers
        order = lists_new(L * num_experts, 1)  # residents, least recent first
        following = order[1]
        tau = np.zeros(L * num_experts, np.int64)
        resident = np.zeros(L * num_experts, np.bool_)
        seen = np.full(L, -1, np.int64)  # the miss at which a layer's head was last met in a walk
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            b = key // num_experts
            tau[key] = t
            if resident[key]:
                key_hits[key] += 1
                list_move_to_tail(order, 0, key)
                continue
            if size == capacity:
                oldest = list_head(order, 0)
                latest = t - (t - tau[oldest]) // L * L  # the last clock whose R is the largest
                best_distance, victim = -1, -1
                candidate = oldest
                while candidate >= 0 and tau[candidate] <= latest:
                    layer = candidate // num_experts
                    if seen[layer] != t:  # the first of its layer in the walk: the layer's head
                        seen[layer] = t
                        distance = layer - b  # D
                        if distance < 0:
                            distance += L
                        if distance > best_distance:
                            best_distance, victim = distance, candidate
                    candidate = following[candidate]
                list_remove(order, 0, victim)
                resident[victim] = False
                size -= 1
            list_append(order, 0, key)
            resident[key] = True
            size += 1
