"""The running requests' keys and values: one tensor per layer, a slot per request.

Continuous batching (runtime/batching.py) keeps every running request's attention keys and values here
rather than in a transformers ``DynamicCache`` per request. Per layer one keys tensor and one values tensor
``[rows, kv_heads, capacity, head_dim]``; a request holds one slot (a row) from the iteration it joins the
batch to the one it leaves, and ``lengths[slot]`` says how many of its positions hold committed tokens.

Why: a ``DynamicCache`` grows by ``torch.cat``, which copies a request's whole cache at every token, and
each request's cache is a tensor of its own, so a pass attends request by request. In the pool a decoding
pass writes every request's new key and value with one indexed store per layer and, with fast batch math,
attends for all decoding requests with one masked ``scaled_dot_product_attention`` over their slots
(runtime/packed.py). Exact batch math still attends segment by segment over an unpadded view of the slot,
the operands a request's own pass gives the kernel.

A pass writes positions ``lengths[slot]`` onward and commits them (:meth:`commit`) only when it succeeded:
a pass that failed inside the engine leaves the lengths as they were, and its writes are overwritten by the
next pass, so a request rolls back without a copy.

**Memory.** Slots are handed out lowest first, so the slots in use stay at the start of the pool. Before
each pass :meth:`reserve` grows both dimensions to fit it, by doubling (one copy of what is held then):
``rows`` to the highest slot in use, ``capacity`` to the longest request's positions. The pool therefore
holds about (requests running at once) x (the longest request's tokens) x (a token's keys and values over
all layers), where per-request caches hold the sum of the requests' tokens; it keeps that size until the
engine closes. Like transformers' caches, it is not part of the fast tier's expert budget.

Positions no pass wrote hold zeros, never uninitialised memory: the fast path's masked lanes multiply them
by a weight of zero, and a NaN there would survive that. A layer's tensors are made on its first write, with
that layer's key shape, dtype and device.
"""

from __future__ import annotations

import heapq


class KVPool:
    """Keys and values of up to ``slots`` requests (see the module docstring)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.free = list(range(slots))  # a heap: the lowest free slot first
        self.lengths = [0] * slots
        self.rows = 0       # slots the tensors hold now
        self.capacity = 0   # positions per slot the tensors hold now
        self.keys: dict[int, object] = {}    # layer -> [rows, kv_heads, capacity, head_dim]
        self.values: dict[int, object] = {}

    @property
    def available(self) -> int:
        """Free slots: a request joins the batch only when there is one (it waits otherwise)."""
        return len(self.free)

    def acquire(self) -> int:
        """A free slot for a request joining the batch, empty (the caller checked :attr:`available`)."""
        if not self.free:
            raise RuntimeError("every slot of the KV pool is taken: more running requests than max_batch")
        slot = heapq.heappop(self.free)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self.free, slot)

    def reserve(self, slots: int, positions: int) -> None:
        """Room for slots ``0..slots-1`` with ``positions`` positions each (before a pass: one past its highest
        slot, and its longest request's new length)."""
        rows, capacity = _grown(self.rows, slots, 4, self.slots), _grown(self.capacity, positions, 64)
        if (rows, capacity) == (self.rows, self.capacity):
            return

        def grown(old):
            new = old.new_zeros(rows, old.shape[1], capacity, old.shape[3])
            new[:self.rows, :, :self.capacity] = old
            return new

        # every tensor made before any is replaced: out of memory midway leaves the pool as it was
        keys = {layer: grown(t) for layer, t in self.keys.items()}
        values = {layer: grown(t) for layer, t in self.values.items()}
        self.keys, self.values, self.rows, self.capacity = keys, values, rows, capacity

    def layer(self, layer: int, like):
        """The (keys, values) tensors of ``layer``, made on first use with the shape of ``like`` [1, kv_heads,
        tokens, head_dim] (a layer's new keys)."""
        if layer not in self.keys:
            shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def commit(self, slot: int, tokens: int) -> None:
        """A successful pass added ``tokens`` positions to ``slot``."""
        self.lengths[slot] += tokens


def _grown(size: int, needed: int, smallest: int, largest: int | None = None) -> int:
    """``size`` doubled (from ``smallest``) until it holds ``needed``, at most ``largest``."""
    if needed <= size:
        return size
    size = max(size, smallest)
    while size < needed:
        size *= 2
    return size if largest is None else min(size, largest)
