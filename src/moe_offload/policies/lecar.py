"""LeCaR: learning cache replacement by regret minimization over two experts, LRU and LFU (Vietri et al.,
HotStorage 2018), a baseline of paper 003 (FlashMoE, section 4.3).

The pseudo-code followed (the LeCaR paper's Algorithm 1; C the cache of N experts, H_LRU and H_LFU the FIFO
histories of the keys each expert evicted, with their eviction time; weights w_LRU = w_LFU = 0.5 at first,
learning rate lambda = 0.45, discount rate d = 0.005^(1/N), time t counted in requests):

    on a request of q:
      if q in C: update C's LRU order and LFU count of q                       (hit)
      else:                                                                     (miss)
        if q in H_LRU or H_LFU: UPDATEWEIGHT(q); delete q from its history
        if C is full:
          action = LRU with probability w_LRU, else LFU
          if action is LRU: if H_LRU is full, delete its oldest key; add C's LRU expert to H_LRU
          else:             if H_LFU is full, delete its oldest key; add C's LFU expert to H_LFU
          evict that expert from C
        add q to C

    UPDATEWEIGHT(q):
      r = d^(t - t_evicted(q))              (a regret that fades with the time q spent in the history)
      if q in H_LRU: w_LFU = w_LFU * e^(lambda * r)     (LRU was wrong to evict q: trust LFU more)
      else:          w_LRU = w_LRU * e^(lambda * r)
      w_LRU = w_LRU / (w_LRU + w_LFU);  w_LFU = 1 - w_LRU

Choices where the paper leaves room, each from the authors' own implementation (sylab/cacheus,
``algs/lecar.py``): each history holds N // 2 keys, so that both together hold as many keys as the cache
(option ``history_size``; libCacheSim shares one history of N keys among the two); an expert's LFU count is
the number of its requests while cached, and one that comes back from a history resumes its count there
plus one. LFU ties go to the least recently requested expert (the project's LFU). Not taken from that
implementation: its clamp of the weights to [0.01, 0.99] and its rule that an expert both LRU and LFU
would evict enters no history; the paper has neither. The random choice comes from ``random.Random(seed)``,
drawn at every eviction, so runs repeat. N is ``cache_slots``, which the cache sets before its first
eviction.

Beyond the paper, for the timed simulator and the runtime: a prefetched expert enters at the MRU end with a
count of 0 (a prefetch is not a request; the project's LFU does the same) and leaves a history without a
weight update, for no request found it there; a victim is never a pinned expert (LRU's and LFU's choices
are made among the others).

The compiled replay (``replay_kernel``) keeps the residents and the two histories as three linked lists over
the flat expert ids (policies/_linked.py), the LFU order in the keyed heap of policies/_ranked.py, and draws
from the same Mersenne Twister (policies/_seeded.py), so that a seed evicts the same experts in both.
"""

from __future__ import annotations

import math
import random as _random
from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_move_to_tail, list_remove, lists_new
from moe_offload.policies._ranked import RankedKeys, heap_new, heap_pop, heap_push, heap_remove, heap_settle
from moe_offload.policies._seeded import mt_random, rng_state
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import integer, number

LEARNING_RATE = 0.45
FINAL_DISCOUNT = 0.005  # d^N: the regret of a key that spent N requests in a history


class LeCaR(EvictionPolicy):
    name = "lecar"
    seeded = True
    summary = "evict LRU's or LFU's choice at random, weighted by regret when an evicted expert comes back"
    source = "Vietri et al., HotStorage 2018; a baseline of paper 003 (FlashMoE)"
    replay_cost = 4.5  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0, learning_rate: float = LEARNING_RATE, history_size: int | None = None):
        super().__init__(spec, seed)
        self.learning_rate = number(learning_rate, "lecar.learning_rate", low=0)
        self._history_size = None if history_size is None else integer(history_size, "lecar.history_size", low=1)
        self._rng = _random.Random(seed)
        self.w_lru = self.w_lfu = 0.5
        self._order: OrderedDict = OrderedDict()  # resident keys, least recently requested first
        self._freq: dict = {}
        self._ranked = RankedKeys()               # resident keys by count, ties to the least recent
        self.h_lru: OrderedDict = OrderedDict()   # key -> (eviction clock, count), oldest first
        self.h_lfu: OrderedDict = OrderedDict()
        self._returning: dict = {}                # requested, found in a history, not yet loaded: its count
        self._pending_action = None               # the expert (LRU or LFU) whose victim is being evicted
        self._clock = 0

    @property
    def history_size(self) -> int:
        if self._history_size is not None:
            return self._history_size
        return max(1, (self.cache_slots or 2) // 2)

    @property
    def discount_rate(self) -> float:
        return FINAL_DISCOUNT ** (1.0 / max(1, self.cache_slots or 1))

    def _regret(self, evicted_at: int) -> float:
        return self.discount_rate ** (self._clock - evicted_at)

    def on_access(self, key, ctx):
        self._clock = ctx.clock
        freq = self._freq.get(key)
        if freq is not None:  # a hit
            self._order.move_to_end(key)
            self._freq[key] = freq + 1
            self._ranked.set(key, freq + 1)
            return
        entry = self.h_lru.pop(key, None)
        if entry is not None:
            self.w_lfu *= math.exp(self.learning_rate * self._regret(entry[0]))
        else:
            entry = self.h_lfu.pop(key, None)
            if entry is None:
                return
            self.w_lru *= math.exp(self.learning_rate * self._regret(entry[0]))
        total = self.w_lru + self.w_lfu
        self.w_lru = self.w_lru / total
        self.w_lfu = 1.0 - self.w_lru
        self._returning[key] = entry[1]

    def on_insert(self, key, ctx):
        if ctx.prefetch and key not in self._returning:  # not a request: no weight update, no use counted
            self.h_lru.pop(key, None)
            self.h_lfu.pop(key, None)
            freq = 0
        else:
            freq = self._returning.pop(key, 0) + 1
        self._order[key] = None
        self._freq[key] = freq
        self._ranked.set(key, freq)

    def victim(self, ctx):
        if self.cache_slots is None:  # driven without a cache: it is full now
            self.cache_slots = len(self._order)
        use_lru = self._rng.random() < self.w_lru
        pinned = ctx.pinned
        if use_lru:
            key = next((k for k in self._order if k not in pinned), None)
        else:
            lowest = self._ranked.lowest(pinned)
            key = None if lowest is None else lowest[1]
        if key is None:
            raise NoEvictableExpert
        self._pending_action = (key, self.h_lru if use_lru else self.h_lfu)
        return key

    def on_evict(self, key):
        freq = self._freq.pop(key)
        del self._order[key]
        self._ranked.discard(key)
        pending, self._pending_action = self._pending_action, None
        if pending is None or pending[0] != key:
            return  # dropped by the cache, not chosen by either expert: no regret to learn from
        history = pending[1]
        if len(history) >= self.history_size:
            history.popitem(last=False)
        history[key] = (self._clock, freq)

    def kernel_arguments(self):
        history = 0 if self._history_size is None else self._history_size  # 0: N // 2
        return (np.array([self.learning_rate], np.float64),
                np.concatenate([rng_state(self._rng), np.array([history], np.int64)]))

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: the residents (list 0, least recent first),
        H_LRU and H_LFU (lists 1 and 2, oldest first) of the linked lists, ``where`` saying which holds a key;
        the residents' LFU order in a heap by (count, last set), settled when LFU chooses
        (_ranked.heap_settle); a key's count kept through its stay in a history. ``ints`` is the generator's
        state, then the history size (0: N // 2); N is ``capacity``, the cache_slots the cache sets. The
        regret's power has a float exponent, as in Python (an integer one would be computed by repeated
        products, not by pow)."""
        learning_rate = floats[0]
        history_size = ints[ints.shape[0] - 1]
        if history_size == 0:
            history_size = max(1, capacity // 2)
        discount = FINAL_DISCOUNT ** (1.0 / max(1, capacity))
        num_keys = num_layers * num_experts
        lists = lists_new(num_keys, 3)
        where = np.full(num_keys, -1, np.int64)  # 0 resident, 1 in H_LRU, 2 in H_LFU
        history_sizes = np.zeros(3, np.int64)
        order, scores, stamps, position = heap_new(capacity, num_keys)
        freq = np.zeros(num_keys, np.int64)
        last_set = np.zeros(num_keys, np.int64)  # a hit leaves the heap's entry behind (_ranked.heap_settle)
        evicted_at = np.zeros(num_keys, np.int64)
        w_lru = w_lfu = 0.5
        size = 0
        for t in range(keys.shape[0]):
            key = keys[t]
            found = where[key]
            if found == 0:
                key_hits[key] += 1
                list_move_to_tail(lists, 0, key)
                freq[key] += 1
                last_set[key] = t
                continue
            returning = 0
            if found > 0:
                regret = discount ** float(t - evicted_at[key])
                if found == 1:
                    w_lfu *= math.exp(learning_rate * regret)
                else:
                    w_lru *= math.exp(learning_rate * regret)
                w_lru = w_lru / (w_lru + w_lfu)
                w_lfu = 1.0 - w_lru
                list_remove(lists, found, key)
                history_sizes[found] -= 1
                returning = freq[key]
            if size == capacity:
                if mt_random(ints) < w_lru:
                    history = 1
                    victim = list_head(lists, 0)
                    heap_remove(order, scores, stamps, position, size, victim)
                else:
                    history = 2
                    heap_settle(order, scores, stamps, position, size, freq, last_set)
                    victim = heap_pop(order, scores, stamps, position, size)
                list_remove(lists, 0, victim)
                size -= 1
                if history_sizes[history] >= history_size:
                    oldest = list_head(lists, history)
                    list_remove(lists, history, oldest)
                    where[oldest] = -1
                    history_sizes[history] -= 1
                list_append(lists, history, victim)
                where[victim] = history
                history_sizes[history] += 1
                evicted_at[victim] = t
            freq[key] = returning + 1
            last_set[key] = t
            list_append(lists, 0, key)
            where[key] = 0
            heap_push(order, scores, stamps, position, size, key, freq[key], t)
            size += 1
