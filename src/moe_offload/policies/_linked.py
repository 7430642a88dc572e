"""Doubly linked lists over flat expert ids, for the compiled replay kernels (simulator/kernels.py).

The kernels' twin of the OrderedDicts that LRU, FIFO, LLRU and Marking keep: in the subset of Python that
Numba compiles, a key's neighbours live in two arrays indexed by the key, so appending, moving and removing
are O(1) without objects. ``lists_new(num_keys, num_lists)`` returns (previous, next, ends), where ``ends[i]``
holds list i's (head, tail) and -1 means none; a key is in at most one list at a time.
"""

from __future__ import annotations

import numpy as np


def lists_new(num_keys, num_lists):
    return (np.full(num_keys, -1, np.int64), np.full(num_keys, -1, np.int64),
            np.full((num_lists, 2), -1, np.int64))


def list_head(lists, which):
    return lists[2][which, 0]


def list_append(lists, which, key):
    """Put ``key`` (in no list) at the tail of list ``which``."""
    previous, following, ends = lists
    tail = ends[which, 1]
    previous[key] = tail
    following[key] = -1
    if tail >= 0:
        following[tail] = key
    else:
        ends[which, 0] = key
    ends[which, 1] = key


def list_remove(lists, which, key):
    """Take ``key`` out of list ``which``."""
    previous, following, ends = lists
    before, after = previous[key], following[key]
    if before >= 0:
        following[before] = after
    else:
        ends[which, 0] = after
    if after >= 0:
        previous[after] = before
    else:
        ends[which, 1] = before


def list_move_to_tail(lists, which, key):
    """Move ``key`` (in list ``which``) to its tail: a request made it the most recent."""
    if lists[2][which, 1] != key:
        list_remove(lists, which, key)
        list_append(lists, which, key)
