"""OPT's stack distances from the past alone: Bilardi, Ekanadham and Pattnaik's critical stack algorithm.

OPT (Belady's MIN) is a stack algorithm (stack_distances.py): the histogram of its stack distances gives its
hits at every cache size. Mattson's way to find a distance orders the stack by next use, so it needs the
future, and a request moves every entry whose next use is later than all those above it. Bilardi, Ekanadham
and Pattnaik ("Optimal on-line computation of stack distances for MIN and OPT", ACM Computing Frontiers 2017)
showed that the OPT distance of a request is fixed by the requests before it, and gave its rule in terms of
the LRU stack and one *critical marker* per distance. This module runs that rule; the proof that it gives OPT's
distances is theirs, and the tests check the result against the Belady replay at every size and against
libCacheSim's Belady.

**The rule.** L is the LRU stack of the experts seen so far (the last requested on top, at depth 0), D of them.
Each distance c = 1 .. D-1 has a marker M_c, a count of entries from the top of L (1 .. D). For each depth i,

    beta_i = #{c : M_c <= i} - i,

the markers within the top i entries less those entries; beta_i >= 0 at every depth, and beta_0 = 0. A request
of expert x at LRU depth Delta:

* Delta = 0 (x is on top): distance 0, and nothing changes;
* x never requested: a first request, a miss at every size; x goes on top, every marker counts one entry more
  (M_c + 1), and the new distance D gets M_D = 1;
* otherwise x's OPT distance is the first c whose marker lies below z (M_c > z), where z is the deepest depth
  above x (z < Delta) with beta_z = 0. Then x goes on top, the markers within its old depth count one entry
  more (M_c + 1 where M_c <= Delta), and the distance found gets M_c = 1.

**Clocks instead of depths.** Every request but one of the expert on top takes the next slot of a clock, and an
expert sits at its last request's slot. A marker is a slot too, and its count is the experts at or after that
slot. When x moves from its slot to the new one, every marker counts it afterwards; before, only those at or
before its old slot did, so the others (M_c <= Delta) count one more, as the rule says. So no marker moves but
the one set to the new slot (M = 1: x alone is at or after it). In slots, beta of the expert at slot s is the
markers after s less the experts after s: a running sum from the newest slot down, +1 a marker and -1 an
expert, read just before each expert. z is the oldest expert after x's slot where that sum is 0, and the
distance is the first c whose marker is at or before z's slot (so that it counts z: M_c > z).

**Cost.** The slots sit in a 4-ary tree whose nodes hold the sum of their slots (+1 a marker, -1 an expert) and
the lowest running sum just after an expert within them (beta - 1 there), newest slot first. z is found from
the root (the oldest expert after x's slot whose running sum after it is -1, the lowest it can be) and the
distance by a 4-ary tree of the markers' slots by distance, the lowest per node, each in O(log D); a request
changes three slots (x's old, its marker's old, the new) and one marker. So a request costs O(log D), where
Mattson's update moves R entries (about 25 per request on a 48 x 128 top-8 trace), each found in O(log D);
and the future is not read, so a sequence can be passed in pieces (``OptStack.add``) in memory that does not
grow with it. The slots (at least 2 per expert, a power of 4) are renumbered in order when they run out, a
marker between two experts' slots taking the newer expert's (its count is the same): at most once every D
requests, O(D) each time.
"""

from __future__ import annotations

import numpy as np

BITS = 2  # 4-ary trees: of 2, 4 and 8 children the fastest on a 48 x 128 top-8 trace (4.1 against 3.8, 3.9 M/s)
FANOUT = 1 << BITS
SLOTS_PER_EXPERT = 2
NONE = 1 << 30  # no expert in a node (its lowest running sum), no marker (a distance's slot)


def _pull(tree, offsets, level, index):
    """Node ``index`` of ``level`` from its children: its sum, and its lowest running sum after an expert,
    newest slot first; whether it changed."""
    first = offsets[level - 1] + (index << BITS)
    total = 0
    lowest = NONE
    for child in range(first + FANOUT - 1, first - 1, -1):  # newest slots first
        candidate = total + tree[2 * child + 1]
        if candidate < lowest:
            lowest = candidate
        total += tree[2 * child]
    node = offsets[level] + index
    if tree[2 * node] == total and tree[2 * node + 1] == lowest:
        return False
    tree[2 * node] = total
    tree[2 * node + 1] = lowest
    return True


def _refresh(tree, offsets, height, one, other):
    """The ancestors of slots ``one`` and ``other`` (which may be the same), from their leaves up, each once,
    until none changes: the paths meet below the root, and above that their changes often cancel (a request
    moves an expert and a marker, -1 and +1 to the sums). One call of ``_pull`` in the loop: Numba inlines
    each call, and every copy lengthens the first compile."""
    active_one = True
    active_other = one != other
    for level in range(1, height + 1):
        one >>= BITS
        other >>= BITS
        if one == other:
            active_one = active_one or active_other
            active_other = False
        if not (active_one or active_other):
            return
        for side in range(2):
            if active_one if side == 0 else active_other:
                changed = _pull(tree, offsets, level, one if side == 0 else other)
                if side == 0:
                    active_one = changed
                else:
                    active_other = changed


def _set_leaf(tree, slot, markers, holder):
    """Leaf ``slot`` from its markers and expert (-1, and a running sum of -1 after it, where it holds one)."""
    if holder[slot] >= 0:
        tree[2 * slot] = markers[slot] - 1
        tree[2 * slot + 1] = -1
    else:
        tree[2 * slot] = markers[slot]
        tree[2 * slot + 1] = NONE


def _oldest_settled(tree, offsets, height, start):
    """The slot of the oldest expert at or after ``start`` before which the running sum from the newest slot is
    0 (just after it, -1: the lowest a running sum after an expert can be). Down from the root to ``start``'s
    leaf, every child after the path's is wholly in the range: the last (oldest) of them that reaches -1 is
    remembered, and entered if ``start``'s own leaf does not."""
    entering = 0
    best = -1
    best_entering = 0
    best_level = 0
    for level in range(height, 0, -1):
        first = offsets[level - 1] + ((start >> (BITS * level)) << BITS)
        inner = (start >> (BITS * (level - 1))) & (FANOUT - 1)
        for child in range(first + FANOUT - 1, first + inner, -1):
            if entering + tree[2 * child + 1] == -1:
                best = child
                best_entering = entering
                best_level = level - 1
            entering += tree[2 * child]
    if entering + tree[2 * start + 1] == -1:
        return start
    node = best
    entering = best_entering
    level = best_level
    while level > 0:  # into the oldest child that reaches -1
        first = offsets[level - 1] + ((node - offsets[level]) << BITS)
        total = entering
        for child in range(first + FANOUT - 1, first - 1, -1):
            if total + tree[2 * child + 1] == -1:
                node = child
                entering = total
            total += tree[2 * child]
        level -= 1
    return node


def _pull_lowest(lowest, offsets, level, index):
    """Node ``index`` of ``level`` of the markers' tree, the lowest slot of its children; whether it changed."""
    first = offsets[level - 1] + (index << BITS)
    least = lowest[first]
    for child in range(first + 1, first + FANOUT):
        if lowest[child] < least:
            least = lowest[child]
    node = offsets[level] + index
    if lowest[node] == least:
        return False
    lowest[node] = least
    return True


def _set_marker(lowest, offsets, height, distance, slot):
    lowest[distance] = slot
    for level in range(1, height + 1):
        distance >>= BITS
        if not _pull_lowest(lowest, offsets, level, distance):
            return


def _first_marker_at_or_before(lowest, offsets, height, slot):
    """The first distance whose marker's slot is at or before ``slot`` (the rule guarantees one)."""
    index = 0
    for level in range(height, 0, -1):
        child = offsets[level - 1] + (index << BITS)
        while lowest[child] > slot:
            child += 1
        index = child - offsets[level - 1]
    return index


def _rebuild(tree, lowest, offsets, marker_offsets):
    """Every inner node of both trees from their leaves."""
    for level in range(1, offsets.shape[0] - 1):
        for index in range(offsets[level + 1] - offsets[level]):
            _pull(tree, offsets, level, index)
    for level in range(1, marker_offsets.shape[0] - 1):
        for index in range(marker_offsets[level + 1] - marker_offsets[level]):
            _pull_lowest(lowest, marker_offsets, level, index)


def _renumber(num_keys, tree, offsets, markers, holder, last, marked, lowest, marker_offsets, renumbered):
    """The experts' slots renumbered 0, 1, ... in order, each marker taking the slot of the oldest expert at or
    after it (the same count); returns the next free slot."""
    slots = holder.shape[0]
    live = 0
    for slot in range(slots):
        if holder[slot] >= 0:
            live += 1
    index = live
    for slot in range(slots - 1, -1, -1):
        if holder[slot] >= 0:
            index -= 1
        renumbered[slot] = index
    markers[:] = 0
    for distance in range(num_keys):
        if marked[distance] != NONE:
            marked[distance] = renumbered[marked[distance]]
            markers[marked[distance]] += 1
    for slot in range(slots):  # each expert to a slot at or before its own, so none is overwritten
        key = holder[slot]
        if key >= 0:
            holder[slot] = -1
            holder[renumbered[slot]] = key
            last[key] = renumbered[slot]
    for slot in range(slots):
        _set_leaf(tree, slot, markers, holder)
    lowest[:num_keys] = marked
    _rebuild(tree, lowest, offsets, marker_offsets)
    return live


def opt_stack_kernel(keys, num_keys, histogram, tree, offsets, markers, holder, last, marked, lowest,
                     marker_offsets, renumbered, state):
    """Add each request of ``keys`` (flat expert ids in [0, num_keys)) to ``histogram[distance]``, its OPT stack
    distance, or to ``histogram[num_keys]`` for a first request (module docstring). The other arguments are
    ``OptStack``'s state, carried from one call to the next: the slots' tree (``offsets``: where each level
    starts, leaves first), each slot's markers and expert (-1: none), each expert's slot (``last``, -1: not
    seen), each distance's marker slot (``marked``) and their tree, scratch for renumbering, and ``state`` ([0]:
    the next free slot, [1]: the experts seen)."""
    slots = holder.shape[0]
    height = offsets.shape[0] - 2
    marker_height = marker_offsets.shape[0] - 2
    following = state[0]
    distinct = state[1]
    for position in range(keys.shape[0]):
        key = keys[position]
        previous = last[key]
        if previous >= 0:
            if previous == following - 1:  # on top
                histogram[0] += 1
                continue
            settled = _oldest_settled(tree, offsets, height, previous + 1)
            distance = _first_marker_at_or_before(lowest, marker_offsets, marker_height, settled)
            histogram[distance] += 1
            holder[previous] = -1
            marker = marked[distance]
            markers[marker] -= 1
            marked[distance] = NONE
            _set_leaf(tree, previous, markers, holder)
            _set_leaf(tree, marker, markers, holder)
            _refresh(tree, offsets, height, previous, marker)
        else:
            histogram[num_keys] += 1
            distance = distinct  # the new distance's marker (none for the first expert: no distance 0 marker)
            distinct += 1
        if following == slots:
            following = _renumber(num_keys, tree, offsets, markers, holder, last, marked, lowest, marker_offsets,
                                  renumbered)
        last[key] = following
        holder[following] = key
        if distance > 0:
            marked[distance] = following
            markers[following] += 1
            _set_marker(lowest, marker_offsets, marker_height, distance, following)
        _set_leaf(tree, following, markers, holder)
        _refresh(tree, offsets, height, following, following)
        following += 1
    state[0] = following
    state[1] = distinct


KERNEL_SIGNATURE = ("void(int32[::1], int64, int64[::1], int32[::1], int64[::1], int32[::1], int32[::1], int32[::1], "
                    "int32[::1], int32[::1], int64[::1], int32[::1], int64[::1])")


def _levels(leaves: int) -> np.ndarray:
    """Where each level of a 4-ary tree over at least ``leaves`` leaves starts (leaves first), and its end."""
    height = 1
    while FANOUT ** height < leaves:
        height += 1
    sizes = [FANOUT ** (height - level) for level in range(height + 1)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


class OptStack:
    """OPT's stack distances of a sequence passed in pieces (``add``), in memory that does not grow with it;
    ``kernel`` is ``opt_stack_kernel``, compiled or not (stack_distances.py chooses)."""

    def __init__(self, num_keys: int, kernel=opt_stack_kernel):
        self.num_keys = num_keys
        self.histogram = np.zeros(num_keys + 1, np.int64)
        offsets = _levels(max(2, SLOTS_PER_EXPERT * num_keys))
        slots = int(offsets[1])
        tree = np.zeros(2 * int(offsets[-1]), np.int32)
        tree[1::2] = NONE
        marker_offsets = _levels(max(1, num_keys))
        self._state = (tree, offsets, np.zeros(slots, np.int32), np.full(slots, -1, np.int32),
                       np.full(num_keys, -1, np.int32), np.full(num_keys, NONE, np.int32),
                       np.full(int(marker_offsets[-1]), NONE, np.int32), marker_offsets, np.zeros(slots, np.int32),
                       np.zeros(2, np.int64))
        self._kernel = kernel

    def add(self, keys: np.ndarray) -> None:
        """The next requests of the sequence (flat expert ids below ``num_keys``)."""
        self._kernel(np.ascontiguousarray(keys, np.int32), self.num_keys, self.histogram, *self._state)
