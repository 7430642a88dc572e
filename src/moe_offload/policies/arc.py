"""ARC, the Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), a baseline of paper 003 (FlashMoE,
section 4.3: "compared with learning-based cache replacement policies such as ARC and LeCaR").

The pseudo-code followed (the ARC paper's Figure 4). The cache holds c experts; T1 (seen once recently) and
T2 (seen at least twice) hold the resident ones, the ghost lists B1 and B2 the keys recently evicted from
T1 and T2 (keys only: they take no room in the cache). Each list is in LRU order. p, the target size of T1,
starts at 0. For a request of x:

    I    x in T1 or T2 (a hit): move x to the MRU end of T2.
    II   x in B1: p = min(p + d1, c), d1 = 1 if |B1| >= |B2| else |B2| / |B1|;
         REPLACE(x, p); move x from B1 to the MRU end of T2 and load it.
    III  x in B2: p = max(p - d2, 0), d2 = 1 if |B2| >= |B1| else |B1| / |B2|;
         REPLACE(x, p); move x from B2 to the MRU end of T2 and load it.
    IV   x in no list:
         A. |T1| + |B1| = c: if |T1| < c, delete the LRU key of B1 and REPLACE(x, p);
                             otherwise delete the LRU expert of T1 (evicted, and not remembered in B1).
         B. |T1| + |B1| < c and |T1| + |T2| + |B1| + |B2| >= c:
                             if the total is 2c, delete the LRU key of B2; REPLACE(x, p).
         Load x at the MRU end of T1.
    REPLACE(x, p): if |T1| >= 1 and (|T1| > p or (x in B2 and |T1| = p)):
                       evict the LRU expert of T1 and put its key at the MRU end of B1;
                   else evict the LRU expert of T2 and put its key at the MRU end of B2.

So |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c: the ghost lists stay bounded by the cache size.

On this project's hooks. The cache asks for a victim exactly when it is full, which in ARC is when cases II,
III and IV (from the moment the cache first filled) call REPLACE, so ``victim`` is REPLACE. ``on_access``
does case I, the adaptation of p in cases II and III (x leaves its ghost list, bound for T2), and
remembers whether x came from B2 (REPLACE's tie rule). ``on_evict`` puts the victim's key in B1 or B2 and
``on_insert`` loads x into T2 or T1, then deletes the LRU key of B1 while |T1| + |B1| > c and that of B2
while the total exceeds 2c. These deletions are exactly case IV's, done after REPLACE instead of before:
REPLACE adds at the MRU ends, so the LRU key deleted is the same one (IV.A with |T1| < c, IV.B); and in
IV.A with |T1| = c, T2 is empty, REPLACE moves T1's LRU expert into B1 and the bound deletes it again,
which is case IV.A's eviction without a ghost. c is ``cache_slots``, which the cache sets before its
first eviction. The tests check the evictions and p on hand-built sequences, and that the miss counts
equal libCacheSim's ARC on real traces.

Beyond the paper, for the timed simulator and the runtime: a prefetched expert enters T1 without being
counted as a request (its first demand request keeps it in T1; the second moves it to T2) and leaves a
ghost list without adapting p, for no request found it there; REPLACE skips pinned experts and falls back
to the other list when the one it chose has none to give; when loads overlap, "x in B2" is taken from
the most recent demand miss (a victim is not told which load it makes room for).

The compiled replay (``replay_kernel``) keeps the four lists as four linked lists over the flat expert ids
(policies/_linked.py; a key is in at most one), with their lengths beside, and p as a float updated by the
same operations.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_offload.policies._linked import list_append, list_head, list_remove, lists_new
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert


class ARC(EvictionPolicy):
    name = "arc"
    summary = "adaptive replacement cache: LRU lists of experts seen once / twice, ghost lists adapt their split"
    source = "Megiddo & Modha, FAST 2003; a baseline of paper 003 (FlashMoE)"
    replay_cost = 1.7  # LRU replays a kernel run costs (base.py)

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self.t1: OrderedDict = OrderedDict()  # resident, seen once recently; LRU first
        self.t2: OrderedDict = OrderedDict()  # resident, seen at least twice
        self.b1: OrderedDict = OrderedDict()  # ghosts evicted from T1 (keys only)
        self.b2: OrderedDict = OrderedDict()  # ghosts evicted from T2
        self.p = 0.0
        self._to_t2: set = set()         # requested, found in a ghost list, not yet loaded: they enter T2
        self._from_b2 = False            # the latest demand miss was found in B2 (REPLACE's tie rule)
        self._unrequested: set = set()   # prefetched into T1 and not requested since

    @staticmethod
    def _delta(numerator: int, denominator: int) -> float:
        """d1 = |B2| / |B1| (numerator B2), d2 = |B1| / |B2|, at least 1 (real: p need not be whole)."""
        return numerator / denominator if numerator > denominator else 1.0

    def on_access(self, key, ctx):
        if key in self.t1:
            if key in self._unrequested:  # a prefetch's first request: now seen once
                self._unrequested.discard(key)
                self.t1.move_to_end(key)
            else:
                del self.t1[key]
                self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            # a ghost exists, so the cache has been full and cache_slots is set
            self.p = min(self.p + self._delta(len(self.b2), len(self.b1)), float(self.cache_slots))
            del self.b1[key]
            self._to_t2.add(key)
            self._from_b2 = False
        elif key in self.b2:
            self.p = max(self.p - self._delta(len(self.b1), len(self.b2)), 0.0)
            del self.b2[key]
            self._to_t2.add(key)
            self._from_b2 = True
        else:
            self._from_b2 = False

    def on_insert(self, key, ctx):
        if key in self._to_t2:
            self._to_t2.discard(key)
            self.t2[key] = None
        else:
            if ctx.prefetch:  # not a request: no adaptation, no use counted
                self.b1.pop(key, None)
                self.b2.pop(key, None)
                self._unrequested.add(key)
            self.t1[key] = None
        c = self.cache_slots
        if c is None:
            return  # never full yet: no ghosts
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def on_evict(self, key):
        if key in self.t1:
            del self.t1[key]
            self._unrequested.discard(key)
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, ctx):
        if self.cache_slots is None:  # driven without a cache: it is full now
            self.cache_slots = len(self.t1) + len(self.t2)
        t1_size = len(self.t1)
        from_b2 = self._from_b2 and not ctx.prefetch
        first, second = ((self.t1, self.t2) if t1_size >= 1 and (t1_size > self.p or (from_b2 and t1_size == self.p))
                         else (self.t2, self.t1))
        pinned = ctx.pinned
        for candidates in (first, second):
            for key in candidates:
                if key not in pinned:
                    return key
        raise NoEvictableExpert

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them: T1, T2, B1 and B2 are the linked lists 0 to 3,
        ``where`` says which list holds a key (-1: none), and c is ``capacity`` (the cache sets cache_slots to
        it at its first eviction; before that there is no ghost, so the bounds delete nothing)."""
        T1, T2, B1, B2 = 0, 1, 2, 3
        c = capacity
        lists = lists_new(num_layers * num_experts, 4)
        where = np.full(num_layers * num_experts, -1, np.int64)
        sizes = np.zeros(4, np.int64)
        p = 0.0
        for t in range(keys.shape[0]):
            key = keys[t]
            found = where[key]
            if found == T1 or found == T2:  # I: to the MRU end of T2
                key_hits[key] += 1
                list_remove(lists, found, key)
                list_append(lists, T2, key)
                sizes[found] -= 1
                sizes[T2] += 1
                where[key] = T2
                continue
            from_b2 = found == B2
            if found == B1:  # II
                delta = sizes[B2] / sizes[B1] if sizes[B2] > sizes[B1] else 1.0
                p = min(p + delta, float(c))
            elif found == B2:  # III
                delta = sizes[B1] / sizes[B2] if sizes[B1] > sizes[B2] else 1.0
                p = max(p - delta, 0.0)
            if found >= 0:
                list_remove(lists, found, key)
                sizes[found] -= 1
            if sizes[T1] + sizes[T2] == c:  # REPLACE
                t1_size = sizes[T1]
                source = T1 if t1_size >= 1 and (t1_size > p or (from_b2 and t1_size == p)) else T2
                if sizes[source] == 0:
                    source = T1 + T2 - source
                ghost = B1 if source == T1 else B2
                victim = list_head(lists, source)
                list_remove(lists, source, victim)
                list_append(lists, ghost, victim)
                sizes[source] -= 1
                sizes[ghost] += 1
                where[victim] = ghost
            target = T2 if found >= 0 else T1
            list_append(lists, target, key)
            sizes[target] += 1
            where[key] = target
            while sizes[T1] + sizes[B1] > c and sizes[B1] > 0:
                oldest = list_head(lists, B1)
                list_remove(lists, B1, oldest)
                sizes[B1] -= 1
                where[oldest] = -1
            while sizes[T1] + sizes[T2] + sizes[B1] + sizes[B2] > 2 * c and sizes[B2] > 0:
                oldest = list_head(lists, B2)
                list_remove(lists, B2, oldest)
                sizes[B2] -= 1
                where[oldest] = -1
