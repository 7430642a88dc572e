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

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class LFRU(EvictionPolicy):
    name = "lfru"
    summary = "frequency-weighted LRU: evict the expert of least uses / (clock - last use + 1)"
    source = "vLLM PR #37190 (--moe-expert-cache-size), LFRUPolicy of e1n00r/tinyserve tinyserve/cache_policy.py"
    replay_cost = 3.7  # LRU replays a kernel run costs (base.py)

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
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them, without scoring every resident at each eviction.

        The residents are kept in groups of equal uses f, the groups in a list by increasing f, each group's
        experts in order of last use (a hit moves its expert to the tail of group f + 1, made next to group f
        if there is none: the O(1) LFU structure), and all residents in one more list by last use. Within a
        group the least score is its head's, the oldest last use (clocks stay far below 2**52, where distinct
        denominators give distinct quotients), so the victim is among the heads. With A the age of the
        oldest resident (T - t + 1 at its last use t), every expert of group f scores at least f / A, and those
        of the later groups more: the scan of the heads stops at the first group whose f / A exceeds the
        best score found (a rounded quotient never decreases with its numerator nor increases with its
        denominator, so the bound holds in floats). Equal scores go to the earliest insertion, as the Python
        scan of the dict in insertion order gives them."""
        num_keys = num_layers * num_experts
        groups = max(capacity, 1) + 1  # one per distinct count among the residents, and one made before one is freed
        members = lists_new(num_keys, groups)  # each group's experts by last use
        recency = lists_new(num_keys, 1)       # every resident by last use: its head is the oldest
        group_uses = np.zeros(groups, np.int64)
        group_next = np.full(groups, -1, np.int64)  # the group of the next larger count, -1 after the largest
        group_previous = np.full(groups, -1, np.int64)
        free = np.arange(groups, dtype=np.int64)  # free group slots: free[:free_count]
        free_count = groups
        lowest = -1  # the group of the fewest uses, -1 while the cache is empty
        uses = np.zeros(num_keys, np.int64)  # 0: not resident
        last = np.zeros(num_keys, np.int64)
        entered = np.zeros(num_keys, np.int64)
        group_of = np.zeros(num_keys, np.int64)
        size = 0
        clock = 0
        insertions = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            if uses[key] > 0:
                key_hits[key] += 1
                clock += 1
                group = group_of[key]
                following = group_next[group]
                if following < 0 or group_uses[following] != uses[key] + 1:
                    free_count -= 1
                    following = free[free_count]
                    group_uses[following] = uses[key] + 1
                    lowest = _link_group(group_next, group_previous, following, group, lowest)
                list_remove(members, group, key)
                list_append(members, following, key)
                group_of[key] = following
                if list_head(members, group) < 0:
                    lowest = _unlink_group(group_next, group_previous, group, lowest)
                    free[free_count] = group
                    free_count += 1
                list_move_to_tail(recency, 0, key)
                uses[key] += 1
                last[key] = clock
                continue
            if size == capacity:
                age = clock - last[list_head(recency, 0)] + 1
                chosen = -1
                best = np.inf
                group = lowest
                while group >= 0 and not group_uses[group] / age > best:
                    head = list_head(members, group)
                    score = group_uses[group] / (clock - last[head] + 1)
                    if score < best or (score == best and entered[head] < entered[chosen]):
                        best = score
                        chosen = head
                    group = group_next[group]
                group = group_of[chosen]
                list_remove(members, group, chosen)
                if list_head(members, group) < 0:
                    lowest = _unlink_group(group_next, group_previous, group, lowest)
                    free[free_count] = group
                    free_count += 1
                list_remove(recency, 0, chosen)
                uses[chosen] = 0
                size -= 1
            clock += 1
            insertions += 1
            if lowest < 0 or group_uses[lowest] != 1:
                free_count -= 1
                group = free[free_count]
                group_uses[group] = 1
                lowest = _link_group(group_next, group_previous, group, -1, lowest)
            list_append(members, lowest, key)
            group_of[key] = lowest
            list_append(recency, 0, key)
            uses[key] = 1
            last[key] = clock
            entered[key] = insertions
            size += 1


def _link_group(group_next, group_previous, group, after, lowest):
    """Put ``group`` in the list of groups right after ``after`` (-1: first); returns the first group."""
    following = lowest if after < 0 else group_next[after]
    group_previous[group] = after
    group_next[group] = following
    if following >= 0:
        group_previous[following] = group
    if after >= 0:
        group_next[after] = group
        return lowest
    return group


def _unlink_group(group_next, group_previous, group, lowest):
    """Take the emptied ``group`` out of the list of groups; returns the first group."""
    before, following = group_previous[group], group_next[group]
    if following >= 0:
        group_previous[following] = before
    if before >= 0:
        group_next[before] = following
        return lowest
    return following
