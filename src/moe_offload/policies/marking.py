"""Randomized Marking (Fiat, Karp, Luby, McGeoch, Sleator, Young 1991; paper 001's reference [13]).

A requested expert is marked. On a miss with every resident expert marked, a new phase starts and all
marks are cleared. The victim is chosen uniformly at random among the unmarked experts. H_k-competitive.

The paper leaves the order of the unmarked experts open (any order gives a uniform draw); this one fixes it
so that a seed means one run on every Python and in the compiled replay: unmarked experts are listed in the
order they became unmarked (a removal moves the last one into the gap), and a new phase unmarks the
experts in the order they were marked.
"""

from __future__ import annotations

import random as _random

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_remove, lists_new
from moe_offload.policies._seeded import draw_below, mt_draw_below, rng_state
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class Marking(EvictionPolicy):
    name = "marking"
    seeded = True
    summary = "randomized marking: evict a random unmarked expert, unmark all when every one is marked"
    source = "paper 001 reference [13] (Fiat et al. 1991)"
    replay_cost = 2.3  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._rng = _random.Random(seed)
        self._marked: dict = {}  # marked key -> None, in the order they were marked
        self._unmarked: list = []
        self._index: dict = {}  # unmarked key -> position in _unmarked

    def _unmark_remove(self, key):
        position = self._index.pop(key)
        last = self._unmarked.pop()
        if last != key:
            self._unmarked[position] = last
            self._index[last] = position

    def on_access(self, key, ctx):
        if key in self._index:
            self._unmark_remove(key)
            self._marked[key] = None

    def on_insert(self, key, ctx):
        if ctx.prefetch:  # prefetched but not yet requested: not marked
            self._index[key] = len(self._unmarked)
            self._unmarked.append(key)
        else:
            self._marked[key] = None

    def on_evict(self, key):
        if key in self._index:
            self._unmark_remove(key)
        else:
            self._marked.pop(key, None)

    def victim(self, ctx):
        pinned = ctx.pinned
        candidates = [key for key in self._unmarked if key not in pinned] if pinned else self._unmarked
        if not candidates:  # every evictable expert is marked: a new phase begins
            for key in self._marked:
                self._index[key] = len(self._unmarked)
                self._unmarked.append(key)
            self._marked.clear()
            candidates = [key for key in self._unmarked if key not in pinned] if pinned else self._unmarked
            if not candidates:
                raise NoEvictableExpert
        return candidates[draw_below(self._rng, len(candidates))]

    def kernel_arguments(self):
        return np.zeros(0, np.float64), rng_state(self._rng)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the marked experts in a linked list in marking
        order, the unmarked in the same array as ``_unmarked``, the same draws from the generator whose
        state is ``ints``. A replayed expert is inserted by a miss, hence marked."""
        num_keys = num_layers * num_experts
        marked = lists_new(num_keys, 1)
        is_marked = np.zeros(num_keys, np.bool_)
        unmarked = np.empty(max(capacity, 1), np.int64)
        position = np.full(num_keys, -1, np.int64)  # in unmarked, -1 when not there
        num_unmarked = 0
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if position[key] >= 0:  # a hit on an unmarked expert marks it
                key_hits[key] += 1
                gap = position[key]
                num_unmarked -= 1
                unmarked[gap] = unmarked[num_unmarked]
                position[unmarked[gap]] = gap
                position[key] = -1
                list_append(marked, 0, key)
                is_marked[key] = True
                continue
            if is_marked[key]:
                key_hits[key] += 1
                continue
            if size == capacity:
                if num_unmarked == 0:  # a new phase
                    head = list_head(marked, 0)
                    while head >= 0:
                        list_remove(marked, 0, head)
                        is_marked[head] = False
                        unmarked[num_unmarked] = head
                        position[head] = num_unmarked
                        num_unmarked += 1
                        head = list_head(marked, 0)
                victim = unmarked[mt_draw_below(ints, num_unmarked)]
                gap = position[victim]
                num_unmarked -= 1
                unmarked[gap] = unmarked[num_unmarked]
                position[unmarked[gap]] = gap
                position[victim] = -1
                size -= 1
            list_append(marked, 0, key)
            is_marked[key] = True
            size += 1
