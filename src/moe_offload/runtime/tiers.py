"""The runtime's tiers: residency from the simulators' cache, memory from a pool of fixed slots.

A tier is an :class:`~moe_offload.simulator.cache.ExpertCache` (or a PartitionedCache) with a byte budget and
an eviction policy, the very objects the simulators use, plus a :class:`SlotPool`: the tier's memory,
allocated once at start-up as ``slots`` expert-sized slots. A transfer into the tier reserves room in the
cache (evicting the policy's victims), takes a free slot, and writes the expert into it; an eviction gives
the slot back. No expert is ever allocated on its own, so the memory a tier uses is exactly its budget and
a long run never fragments it.

The budget is rounded down to whole slots, so a successful ``reserve`` always finds a free slot (reserved
and resident experts together never exceed the slots).

With CUDA each slot remembers the event after which it may be overwritten (``free_after``): an expert
evicted from GPU memory may still be read by kernels already queued on the compute stream, and the copy of
its successor into the slot waits for them on the GPU, not on the host. An expert copied into the GPU is
usable once its copy's event (``ready``) has completed; the compute stream waits for that event, so the
host never blocks on a copy.
"""

from __future__ import annotations

from moe_offload.runtime.packing import Manifest
from moe_offload.runtime.storage import expert_views


class SlotPool:
    """``slots`` slots of one expert each, in one allocation of ``dtype`` elements on ``device``."""

    def __init__(self, slots: int, elements: int, dtype, device, pin: bool = False):
        import torch

        self.memory = torch.empty((slots, elements), dtype=dtype, device=device, pin_memory=pin)
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.free_after: list = [None] * slots       # CUDA: event after which the slot may be overwritten

    @property
    def slots(self) -> int:
        return self.memory.shape[0]

    def take(self) -> int:
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


class Tier:
    """One tier: ``cache`` decides residency, ``pool`` holds the bytes; ``slot_of`` maps an expert (flat key)
    that is reserved or resident to its slot."""

    def __init__(self, name: str, cache, pool: SlotPool, manifest: Manifest, device, dtype, form=None):
        self.name, self.cache, self.pool, self.manifest = name, cache, pool, manifest
        self.device, self.dtype = device, dtype
        self.form = form  # quantized experts: how the slots hold them (runtime/expert_forms.py)
        self.slot_of: dict[int, int] = {}
        self.ready: dict[int, object] = {}  # CUDA: key -> event of its copy into this tier
        self._views: dict[int, dict] = {}   # slot -> the expert's tensors as views of the slot
        self.slot_bytes = pool.memory.shape[1] * pool.memory.element_size()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def assign(self, key: int) -> int:
        """A slot for ``key``, whose room the cache has just reserved."""
        slot = self.pool.take()
        self.slot_of[key] = slot
        return slot

    def vacate(self, key: int) -> None:
        """``key`` was evicted or its transfer cancelled: its slot is free (on a GPU, once the compute stream
        has passed the kernels queued so far, which may still read it)."""
        slot = self.slot_of.pop(key, None)
        self.ready.pop(key, None)
        if slot is None:
            return
        if self.is_cuda:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.default_stream(self.device))
            self.pool.free_after[slot] = event
        self.pool.give_back(slot)

    def region(self, slot: int):
        """The slot as a flat tensor of the tier's dtype (one expert's elements)."""
        return self.pool.memory[slot]

    def tensors(self, key: int) -> dict:
        """The resident expert ``key``'s tensors (views of its slot, made once per slot; quantized experts as
        their form gives them: runtime/expert_forms.py)."""
        slot = self.slot_of[key]
        if self.form is not None:
            return self.form.tensors(self.pool.memory[slot], slot)
        views = self._views.get(slot)
        if views is None:
            views = self._views[slot] = expert_views(self.manifest, self.pool.memory[slot])
        return views


def slots_for(budget_bytes: int, slot_bytes: int) -> int:
    return budget_bytes // slot_bytes


class SegmentPool:
    """A buffer of ``slots`` whole-expert slots (``elements`` each) in one allocation, handed out in ranges of
    segment size: a slot holds one whole expert, or is carved into ``elements // size`` equal ranges of one
    smaller segment size (a layer's bottoms) while any of them is taken, and is whole again once all are back.

    So the buffer holds as many bottoms as fit its bytes, slot by slot (at most one bottom's worth less per slot
    than the bytes alone would), and carving never fragments it: the current layer's at most K segments sit in
    at most K slots, so once the others' unused ranges are dropped a whole slot is free for any segment of the
    layer (runtime/segment_tier.py relies on it). A range is ``(slot, offset)``; ``take()`` with no size is a
    whole slot."""

    def __init__(self, slots: int, elements: int, dtype, device):
        import torch

        self.memory = torch.empty((slots, elements), dtype=dtype, device=device)
        self.elements = elements
        self.free = list(range(slots - 1, -1, -1))  # whole slots, pop() hands out slot 0 first
        self.free_after: list = [None] * slots       # CUDA: event after which any range of the slot may be overwritten
        self._carved: dict[int, tuple[int, list[int]]] = {}  # slot -> (its segments' size, their free offsets)

    def fits(self, elements: int | None = None) -> bool:
        elements = elements or self.elements
        return bool(self.free) or (self.elements // elements > 1 and any(
            size == elements and offsets for size, offsets in self._carved.values()))

    def take(self, elements: int | None = None) -> tuple[int, int]:
        """A free range of ``elements`` (default a whole slot): a free one of a slot carved to that size first."""
        elements = elements or self.elements
        pieces = self.elements // elements
        if pieces > 1:
            for slot, (size, offsets) in self._carved.items():
                if size == elements and offsets:
                    return slot, offsets.pop()
        slot = self.free.pop()
        if pieces > 1:
            self._carved[slot] = (elements, [n * elements for n in range(pieces - 1, 0, -1)])
        return slot, 0

    def give_back(self, taken: tuple[int, int]) -> None:
        slot, offset = taken
        carved = self._carved.get(slot)
        if carved is not None:
            size, offsets = carved
            offsets.append(offset)
            if len(offsets) < self.elements // size:
                return
            del self._carved[slot]
        self.free.append(slot)

    def region(self, taken: tuple[int, int]):
        """The range's slot from its offset on, as a flat tensor (the segment is its first elements)."""
        slot, offset = taken
        return self.memory[slot][offset:]
