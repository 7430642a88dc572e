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

A tier answers the link worker that fills it (runtime/datapath.py ``LinkWorker``) through ``take``, ``write``,
``land`` and ``drop``: a slot for a transfer, its bytes, its arrival, its failure. A split run's fast tier
(runtime/segment_tier.py) answers the same calls with segments: a whole expert is one segment. The model runner
(runtime/runner.py) sees a fast tier of whole experts through :class:`WholeExperts`.
"""

from __future__ import annotations

from moe_offload.runtime.packing import Manifest
from moe_offload.runtime.storage import expert_views


class SlotPool:
    """``slots`` slots of one expert each, in one allocation of ``dtype`` elements on ``device``."""

    def __init__(self, slots: int, elements: int, dtype, device, pin: bool = False):
        import torch

        self.memory = torch.empty((slots, elements), dtype=dtype, device=device, pin_memory=pin)
        self.elements = elements
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.free_after: list = [None] * slots       # CUDA: event after which the slot may be overwritten

    @property
    def slots(self) -> int:
        return self.memory.shape[0]

    def take(self) -> int:
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def free_after_compute(self, slot: int) -> None:
        """On a GPU the slot may be overwritten once the compute stream has passed the kernels queued so far,
        which may still read it."""
        if self.memory.is_cuda:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.default_stream(self.memory.device))
            self.free_after[slot] = event


class Tier:
    """One tier: ``cache`` decides residency, ``pool`` holds the bytes; ``slot_of`` maps an expert (flat key)
    that is reserved or resident to its slot. A split run's buffer (runtime/segment_tier.py) is such a slot
    bookkeeping over a SegmentPool, with no cache: the split tier decides what it holds."""

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

    def assign(self, key: int, *size) -> int:
        """A slot for ``key``, whose room the cache has just reserved (of ``size`` elements: a SegmentPool's)."""
        slot = self.pool.take(*size)
        self.slot_of[key] = slot
        return slot

    def vacate(self, key: int) -> None:
        """``key`` was evicted or its transfer cancelled: its slot is free (on a GPU, once the compute stream
        has passed the kernels queued so far, which may still read it)."""
        slot = self.slot_of.pop(key, None)
        self.ready.pop(key, None)
        if slot is None:
            return
        self.pool.free_after_compute(slot)
        self.pool.give_back(slot)

    # ------------------------------------------------------------------------- the link into the tier (locked)
    prefetches_wait_for_room = False  # a prefetch the cache finds no room for is dropped
    room_wait_s = 0.05                # a demand load that finds none waits this long before it asks again

    @property
    def holding(self):
        """What the link into the tier never brings again (its TransferQueue's destination)."""
        return self.cache

    def complete(self, key: int) -> bool:
        return key in self.cache

    def transfer_bytes(self, key: int) -> int:
        return self.manifest.expert_bytes

    def layer_routed(self, layer: int, keys) -> None:
        """Its layer is routed: what was prefetched for it is no longer held (simulator/cache.py)."""
        held = self.cache.held
        if held:
            J = self.manifest.num_experts
            for key in [key for key in held if key // J == layer]:
                self.cache.release(key)

    def end_request(self, request: int) -> None:
        self.cache.end_request(request)

    def take(self, worker, transfer):
        """A slot for ``transfer`` once the cache has made room for it, else None. The host tier keeps what is
        being read out of it or waits to be; a prefetch into the fast tier is held until used and spares the
        predicted experts it must not evict (simulator/cache.py)."""
        path, ctx, key = worker.path, worker.path.ctx, transfer.key
        if worker.destination > 0:
            upstream = path.workers[worker.destination - 1].queue
            ctx.pinned = path.reading_from[worker.destination] | path.on_host | (
                set(upstream.waiting_demands()) if transfer.demand else upstream.waiting())
        ctx.prefetch = worker.destination == 0 and not transfer.demand
        try:
            admitted = self.cache.reserve(key, ctx, self.slot_bytes, path.protected(key) if ctx.prefetch else ())
        finally:
            ctx.prefetch, ctx.pinned = False, path.pinned
        return self.assign(key) if admitted else None

    def write(self, worker, key: int, slot: int, source, source_slot) -> object:
        """Unlocked: the expert's bytes into ``slot``; the CUDA event of the copy, or None."""
        return worker.mover.move(key, source, source_slot, self, slot)

    def land(self, worker, key: int, slot: int, ready, demand: bool) -> None:
        if ready is not None:
            self.ready[key] = ready
        ctx = worker.path.ctx
        ctx.prefetch = not demand
        try:
            self.cache.complete(key, ctx)
        finally:
            ctx.prefetch = False

    def drop(self, key: int, slot: int) -> None:
        """The transfer into ``slot`` failed."""
        self.cache.cancel(key)
        self.vacate(key)

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


class SegmentPool(SlotPool):
    """A buffer of ``slots`` whole-expert slots (``elements`` each) in one allocation, handed out in ranges of
    segment size: a slot holds one whole expert, or is carved into ``elements // size`` equal ranges of one
    smaller segment size (a layer's bottoms) while any of them is taken, and is whole again once all are back.

    So the buffer holds as many bottoms as fit its bytes, slot by slot (at most one bottom's worth less per slot
    than the bytes alone would), and carving never fragments it: the current layer's at most K segments sit in
    at most K slots, so once the others' unused ranges are dropped a whole slot is free for any segment of the
    layer (runtime/segment_tier.py relies on it). A range is ``(slot, offset)``; ``take()`` with no size is a
    whole slot."""

    def __init__(self, slots: int, elements: int, dtype, device):
        super().__init__(slots, elements, dtype, device)
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

    def free_after_compute(self, taken: tuple[int, int]) -> None:
        super().free_after_compute(taken[0])  # the event guards the whole slot

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


class WholeExperts:
    """The fast tier of whole experts (a :class:`Tier`), as the runner's expert source (runtime/runner.py) sees
    it: an expert is one part, a hit when resident; a miss the policy does not admit is computed on the host. A
    split run's fast tier is runtime/split.py's ``SplitExperts``."""

    def __init__(self, path):
        """``path``: the runtime/datapath.py DataPath whose fast tier (``tiers[0]``) this is."""
        self.path, self.tier, self.cache = path, path.tiers[0], path.tiers[0].cache

    def access(self, key: int, ctx) -> tuple[bool, bool]:
        """(hit, whether it must still move in)."""
        hit = self.cache.touch(key, ctx)
        return hit, not hit

    def admits(self, key: int, ctx) -> bool:
        return self.cache.admits(key, ctx)

    def parts(self, key: int) -> int:
        return 1

    def has_part(self, key: int, part: int) -> bool:
        return key in self.cache

    def part_tensors(self, key: int, part: int):
        return self.tier.tensors(key), self.tier.ready.get(key)

    def computed(self, key: int) -> None:
        self.path.pinned.discard(key)

    def release(self, keys) -> None:
        self.path.pinned.difference_update(keys)
