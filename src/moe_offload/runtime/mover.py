"""How one expert's bytes move into a slot of a tier (:class:`ExpertMover`, one per link worker of
runtime/datapath.py; ``hardware measure`` times the same object). The routes:

- **files -> host memory** (a host tier, or a CPU fast tier that computes in the stored dtype): the reader
  pool (runtime/storage.py) reads every chunk of the expert straight into the slot;
- **files -> CPU fast tier in another dtype** (float16 files, float32 compute): each reader reads its chunk
  into its own small scratch buffer, verifies it and converts it into the slot while it is in the cache;
- **files -> CPU fast tier holding int8/int4 experts in another form** (dequantized, or tiled for the int4
  kernel: runtime/expert_forms.py): the readers read the stored expert into the mover's buffer, then the
  form converts it into the slot (the host tier's copy likewise);
- **files -> GPU**: the readers fill one buffer of a ring of pinned buffers, then the worker queues one
  copy into the GPU slot on the link's own CUDA stream and moves on to the next transfer, reading it into
  the next ring buffer while the copy runs. A ring buffer is reused once its copy's event has completed;
  the compute stream waits for the copy's event before it uses the expert (events order copy and compute;
  the host never waits for a copy);
- **host tier -> fast tier**: one copy from the host slot (pinned with CUDA: one DMA on the copy stream)
  or one conversion on a CPU. The host slot stays pinned in the host tier while it is read.

Copies on the CPU stay on the thread that makes them (runtime/cpu_threads.py says why).
"""

from __future__ import annotations

import threading

from moe_offload.runtime.cpu_threads import copy_serially
from moe_offload.runtime.storage import ExpertStore
from moe_offload.runtime.tiers import Tier

RING_BUFFERS = 3  # pinned buffers per GPU link: one being read, one being copied, one spare


class ExpertMover:
    """Moves one expert into a slot of a tier, by the routes of the module docstring (one per link worker;
    ``hardware measure`` times the same object). A split run's fast tier moves its segments with the same ring
    (``staging``) and copy stream (``copy``)."""

    def __init__(self, store: ExpertStore, num_experts: int):
        self.store, self.num_experts = store, num_experts
        self._local = threading.local()  # each reader's scratch buffer (files -> CPU in another dtype)
        self._ring: list | None = None   # CUDA: pinned buffers and the events of their last copies
        self._ring_index = -1
        self._stream = None              # CUDA: this link's copy stream
        self._stored = None              # quantized experts converted on arrival: their stored bytes
        self.ring_allocations = 0

    # ------------------------------------------------------------------------------------------- bytes
    def move(self, key: int, source: Tier | None, source_slot: int | None, tier: Tier, slot: int):
        """Write expert ``key`` into ``slot`` of ``tier``; returns the CUDA event of its copy, or None when the
        bytes are in place on return."""
        import torch

        layer, expert = divmod(key, self.num_experts)
        destination = tier.region(slot)
        if tier.is_cuda:
            if source is None:
                staged = self.staging(pinned=True)
                array = staged.numpy()
                self.store.read(layer, expert, lambda a, b: memoryview(array[a:b]))
                # quantized experts' slots hold bytes (uint8), the others elements of the stored dtype
                origin = staged if destination.dtype == torch.uint8 else \
                    staged.view(getattr(torch, self.store.manifest.dtype))
            else:
                origin = source.region(source_slot)
            # after the kernels that read the slot's previous expert
            event = self.copy(destination, origin, tier.pool.free_after[slot])
            if source is not None:
                source.pool.free_after[source_slot] = event  # the host slot is read until then
            return event
        converts = tier.form is not None and tier.form.converts  # quantized experts in another form
        if source is not None:
            if converts:
                tier.form.convert(source.region(source_slot), destination)
            else:
                copy_serially(destination, source.region(source_slot))
            return None
        wait = tier.pool.free_after[slot]
        if wait is not None:  # a pinned host slot that a GPU copy may still read
            wait.synchronize()
        if converts:
            stored = self._stored_scratch()
            array = stored.numpy()
            self.store.read(layer, expert, lambda a, b: memoryview(array[a:b]))
            tier.form.convert(stored, destination)
        elif destination.dtype in (torch.uint8, getattr(torch, self.store.manifest.dtype)):
            array = destination.view(torch.uint8).numpy()
            self.store.read(layer, expert, lambda a, b: memoryview(array[a:b]))
        else:
            self._read_converting(layer, expert, destination)
        return None

    def _stored_scratch(self):
        """This mover's buffer of one expert's stored bytes (quantized experts converted whole on arrival)."""
        import torch

        if self._stored is None:
            self._stored = torch.empty(self.store.manifest.expert_bytes, dtype=torch.uint8)
        return self._stored

    def _read_converting(self, layer: int, expert: int, destination) -> None:
        """Each reader reads its chunk into its own scratch buffer and converts it into the slot."""
        import torch

        store = self.store
        stored = getattr(torch, store.manifest.dtype)
        itemsize = stored.itemsize
        local = self._local

        def into(start: int, end: int) -> memoryview:
            scratch = getattr(local, "scratch", None)
            if scratch is None:
                scratch = local.scratch = torch.empty(store.manifest.chunk_bytes, dtype=torch.uint8)
                local.array = scratch.numpy()
            return memoryview(local.array[:end - start])

        def convert(start: int, end: int, _view) -> None:
            chunk = local.scratch[:end - start].view(stored)
            copy_serially(destination[start // itemsize:end // itemsize], chunk)

        store.read(layer, expert, into, convert)

    def copy(self, destination, source, *after):
        """``destination.copy_(source)``. Into a GPU: on this link's stream once the events ``after`` (None: none)
        have completed, returning the copy's event, after which the ring buffer last handed out may be reused
        (copies on one stream complete in order); else on this thread, returning None."""
        if not destination.is_cuda:
            copy_serially(destination, source)  # on this thread alone (runtime/cpu_threads.py)
            return None
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=destination.device)
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            for wait in after:
                if wait is not None:
                    self._stream.wait_event(wait)
            destination.copy_(source, non_blocking=True)
            event.record(self._stream)
        if self._ring is not None:
            self._ring[self._ring_index][1] = event
        return event

    def staging(self, pinned: bool):
        """The next buffer of the ring (``pinned`` for copies into a GPU), once the copy that last read it has
        completed."""
        import torch

        if self._ring is None:
            size = self.store.manifest.expert_bytes
            self._ring = [[torch.empty(size, dtype=torch.uint8, pin_memory=pinned), None] for _ in range(RING_BUFFERS)]
            self.ring_allocations += RING_BUFFERS
        self._ring_index = (self._ring_index + 1) % len(self._ring)
        buffer, last_copy = self._ring[self._ring_index]
        if last_copy is not None:
            last_copy.synchronize()
        return buffer
