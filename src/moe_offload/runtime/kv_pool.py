"""The running requests' keys and values: one preallocated tensor per layer, a slot per request.

Continuous batching (runtime/batching.py) keeps every running request's attention keys and values here
rather than in a transformers ``DynamicCache`` per request. Per layer one keys tensor and one values tensor
``[slots, kv_heads, capacity, head_dim]``; a request holds one slot (row) from the iteration it joins the
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

Positions no pass wrote hold zeros, never uninitialised memory: the fast path's masked lanes multiply them
by a weight of zero, and a NaN there would survive that. Tensors are made on a layer's first write, with that layer's key shape, dtype and device; the capacity
(positions per slot) grows by doubling to fit the longest request (a copy of what is held then), up to the
largest length asked for.
"""

from __future__ import annotations

import heapq


class KVPool:
    """Keys and values of up to ``slots`` requests (see the module docstring)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.free = list(range(slots))  # a heap: the lowest free slot first, so the running requests' slots
        # stay packed at the start of the pool (fast batch math attends over the first slots as they lie)
        self.lengths = [0] * slots
        self.capacity = 0
        self.keys: dict[int, object] = {}    # layer -> [slots, kv_heads, capacity, head_dim]
        self.values: dict[int, object] = {}

    def acquire(self) -> int:
        """A free slot for a request joining the batch, empty."""
        if not self.free:
            raise RuntimeError("every slot of the KV pool is taken: more running requests than max_batch")
        slot = heapq.heappop(self.free)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self.free, slot)

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` positions per slot (before a pass: its longest request's new length)."""
        if positions <= self.capacity:
            return
        capacity = max(64, self.capacity)
        while capacity < positions:
            capacity *= 2
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                grown[:, :, :self.capacity] = old
                store[layer] = grown
        self.capacity = capacity

    def layer(self, layer: int, like):
        """The (keys, values) tensors of ``layer``, made on first use with the shape of ``like`` [1, kv_heads,
        tokens, head_dim] (a layer's new keys)."""
        if layer not in self.keys:
            shape = (self.slots, like.shape[1], self.capacity, like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def commit(self, slot: int, tokens: int) -> None:
        """A successful pass added ``tokens`` positions to ``slot``."""
        self.lengths[slot] += tokens
