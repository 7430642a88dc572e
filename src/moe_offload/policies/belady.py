"""Belady's OPT: evict the expert whose next request is furthest in the future (offline, optimal).

The compiled replay ranks the residents by their next requests without a heap. Every resident's next request is
a position of the sequence still to come, and no two residents share one (a position requests one expert), so
the residents are a set of future positions: the victim is the largest, and the resident requested now is the
one at the current position, the smallest. A set of positions below n kept as bits, with a word of 64 bits
over each 64 words below it (``position_levels``), adds and removes a position by setting and clearing its bit
(and its word's bit above, when the word fills or empties) and finds the largest in one step per level, each a
count of leading zeros: log_64(n) steps, 5 at 20M requests, in place of a heap's sift of log_2(C) steps for C
residents on every request. The residents never requested again have no position; they go first, as they
do in the objects' order, and which of them goes makes no difference, none being requested again: a stack.
The next requests come a chunk at a time (trace/flatten.py ``fill_next_uses``), so no column of them is made.
"""

from __future__ import annotations

import numpy as np

from moe_offload.compiled import highest_bit
from moe_offload.policies._ranked import RankedKeys
from moe_offload.policies.base import EvictionPolicy
from moe_offload.trace.flatten import NEVER, fill_next_uses, next_use_chunk, next_use_marks


class Belady(EvictionPolicy):
    name = "belady"
    summary = "Belady's OPT: evict the expert requested again furthest in the future (offline bound)"
    source = "Belady 1966; the OPT of paper 001, the target of paper 003's learned policy"
    replay_cost = 2.5  # LRU replays a kernel run costs (base.py)
    offline = True

    def __init__(self, spec, seed=0):
        super().__init__(spec, seed)
        self._ranked = RankedKeys()  # score = -next_use, so the furthest comes first

    def on_access(self, key, ctx):
        if key in self._ranked:
            self._ranked.set(key, -ctx.next_use)

    def on_insert(self, key, ctx):
        self._ranked.set(key, -ctx.next_use)

    def on_evict(self, key):
        self._ranked.discard(key)

    def victim(self, ctx):
        return self._ranked.victim(ctx.pinned)

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """The hooks above as the compiled replay runs them, the residents ranked by their next requests in a
        set of positions (module doc): the same order."""
        num_keys = num_layers * num_experts
        n = keys.shape[0]
        chunk = next_use_chunk(n)
        marks = next_use_marks(keys, num_keys, chunk)
        ahead = np.empty(min(chunk, n), np.int32)
        seen = np.empty(num_keys, np.int32)
        levels = position_levels(n)
        bits = np.zeros(levels[-1], np.uint64)
        resident = np.zeros(num_keys, np.bool_)
        done = np.empty(num_keys, np.int64)  # the residents never requested again (module doc)
        done_count = 0
        size = 0
        for first in range(0, n, chunk):
            stop = min(n, first + chunk)
            fill_next_uses(keys, marks, first // chunk, first, stop, seen, ahead)
            for t in range(first, stop):
                key = keys[t]
                if resident[key]:
                    key_hits[key] += 1
                    position_remove(bits, levels, t)  # its next request was this one
                else:
                    if size == capacity:
                        if done_count:
                            done_count -= 1
                            victim = done[done_count]
                        else:
                            latest = position_largest(bits, levels)
                            position_remove(bits, levels, latest)
                            victim = keys[latest]
                        resident[victim] = False
                    else:
                        size += 1
                    resident[key] = True
                following = ahead[t - first]
                if following == NEVER:
                    done[done_count] = key
                    done_count += 1
                else:
                    position_add(bits, levels, following)


def position_levels(n):
    """Where each level of a set of positions below ``n`` starts (module doc) in its array of words: level 0 a bit
    per position, each level above a bit per word of the one below (set where that word is not empty), up to
    one word; the last entry is the number of words (``np.zeros(levels[-1], np.uint64)`` is the empty set)."""
    words = max(1, (n + 63) >> 6)
    count = 1
    above = words
    while above > 1:
        above = (above + 63) >> 6
        count += 1
    levels = np.empty(count + 1, np.int64)
    levels[0] = 0
    above = words
    for level in range(count):
        levels[level + 1] = levels[level] + above
        above = (above + 63) >> 6
    return levels


def position_add(bits, levels, position):
    """Add ``position``: its bit and, up the levels, its words' bits, up to a word that held a bit already (the
    bits above it are set)."""
    for level in range(levels.shape[0] - 1):
        index = levels[level] + (position >> 6)
        word = bits[index]
        bits[index] = word | (np.uint64(1) << np.uint64(position & 63))
        if word:
            break
        position >>= 6


def position_remove(bits, levels, position):
    """Remove ``position``, which is in the set: its bit, and its word's bit above while a word empties."""
    for level in range(levels.shape[0] - 1):
        index = levels[level] + (position >> 6)
        word = bits[index] & ~(np.uint64(1) << np.uint64(position & 63))
        bits[index] = word
        if word:
            break
        position >>= 6


def position_largest(bits, levels):
    """The largest position of a set that is not empty: down from the top word, the highest bit of each."""
    position = 0
    for level in range(levels.shape[0] - 2, -1, -1):
        position = (position << 6) + highest_bit(bits[levels[level] + position])
    return position
