"""The fast tier of a split run: what it holds are segments (runtime/split.py says what a split run is).

Per layer a cache of C_i expert tops (an ExpertCache of C_i entries with the run's eviction policy, over a pool
of top-sized slots), and one buffer of K whole experts' bytes (the paper's U_b, K = top-k) handed out in
segment-sized ranges (tiers.SegmentPool): a range holds one expert's bottom, or its whole copy when its top is
not cached. The buffer counts bytes as the simulator's does, slot by slot: a whole-expert slot holds
floor(E / b) bottoms of b bytes, so with Y_i > K as many prefetched bottoms land ahead of a layer as fit.

The link worker into it (runtime/datapath.py) asks it for a buffer range (``take``), the segment's bytes
(``write``) and hands it the arrival (``land``), as it does a whole-expert tier (runtime/tiers.py); with a host
tier the two hops overlap, and a bottom is gathered from the host copy's byte ranges.

Prefetching follows the timed simulator's split run (simulator/split.py, simulator/timed/tiers.py):

- a proposal for a layer ahead (after the last layer's router every layer is ahead: layer 0 of the next
  pass) queues what the expert lacks: its bottom when its top is cached, else the whole expert; an expert
  already complete (its bottom or whole copy buffered, or its top cached at ratio 1) is noted as predicted
  instead, and a prefetched top does not evict it;
- a prefetch starts only into a free buffer range: it never drops anything. A demand load that finds no free
  range drops landed segments that the current layer does not compute with, the most recent first (the
  speculation for the layers ahead), and waits while there are none;
- the top of a whole expert is copied into its layer's cache when the policy makes room, never evicting a
  top that the current layer computes with or whose bottom is buffered; a prefetched top is *held* until its
  layer uses it or is routed without it (simulator/cache.py);
- when a layer is routed its waiting prefetches that it does not need are withdrawn (those it needs become
  demand loads), its landed segments that it does not need leave the buffer, its held tops that it does not
  need are released; a prefetch landing after its layer was routed without it leaves the buffer at once.

Counters (the data path's): a prefetch is *issued* when it goes on the wire into the fast tier, *used* when its
layer is routed to it (landed or still on the wire: no demand load then), *wasted* when its segment leaves the
buffer unused. Everything here is guarded by the data path's ``cond``.
"""

from __future__ import annotations

import time

from moe_offload.errors import ConfigError
from moe_offload.runtime.cpu_threads import copy_serially
from moe_offload.runtime.split import bottom_ranges, split_memory, split_rows
from moe_offload.runtime.storage import ExpertReadError, expert_views
from moe_offload.runtime.tiers import SegmentPool, SlotPool, Tier
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.split import SplitConfig
from moe_offload.values import format_bytes


class SegmentTier:
    """The tops and the buffer (module doc); ``path`` is the data path it is the fast tier of (set by DataPath)."""

    name = "fast"

    def __init__(self, config: SplitConfig, source: str, manifest, store, counters, spec, make_policy, device,
                 compute_dtype, budget_bytes: int):
        import torch

        self.manifest, self.store, self.counters, self.spec = manifest, store, counters, spec
        self.device = device
        self.hidden, self.intermediate = next(t for t in manifest.tensors if t.name == "down_proj").shape
        self.stored = getattr(torch, manifest.dtype)
        self.rows = split_rows(config, self.intermediate, source)
        self.prefetches = config.prefetches  # Y_i of the configuration, or None
        self.compute_dtype, self.budget_bytes = compute_dtype, budget_bytes
        self.memory_bytes = self._memory(config, self.rows)
        if self.memory_bytes > budget_bytes:
            raise ConfigError(f"{source}: the cached tops and the buffer of {spec.top_k} experts need "
                              f"{format_bytes(self.memory_bytes)}, more than the fast budget of "
                              f"{format_bytes(budget_bytes)}")
        self.cached_experts = [plan.cached_experts for plan in config.layers]
        self.tops = [ExpertCache(plan.cached_experts, make_policy()) for plan in config.layers]
        self.top_tiers = [self._top_tier(top, plan.cached_experts, r)
                          for top, plan, r in zip(self.tops, config.layers, self.rows)]
        self.buffer = SegmentPool(spec.top_k, 3 * self.intermediate * self.hidden, compute_dtype, device)
        self.landed: dict[int, bool] = {}    # key -> whether its buffered copy is the whole expert; landing order
        # its slot bookkeeping: key -> its range of the buffer, CUDA: key -> event of its copy into the buffer
        self.buffered = Tier("buffer", None, self.buffer, manifest, device, compute_dtype)
        self.bottom_digest: dict[int, str] = {}  # key -> xxHash3 of its bottom's stored bytes (verified read)
        self.reconfigurations: list[dict] = []  # online reconfiguration (runtime/split_online.py)
        self.path = None

    def _top_tier(self, cache: ExpertCache, cached: int, rows: int) -> Tier:
        """A layer's tops: its cache over ``cached`` slots of ``rows`` rows, with a tier's slot bookkeeping."""
        pool = SlotPool(cached, 3 * rows * self.hidden, self.compute_dtype, self.device)
        tier = Tier("tops", cache, pool, self.manifest, self.device, self.compute_dtype)
        cache.on_evict = tier.vacate
        return tier

    def _memory(self, config: SplitConfig, rows: list[int]) -> int:
        expert_bytes = 3 * self.intermediate * self.hidden * self.compute_dtype.itemsize  # in the fast tier
        return split_memory(config, rows, self.intermediate, expert_bytes, self.spec.top_k)

    # ------------------------------------------------------------------------- the data path, seen from here
    @property
    def cond(self):
        return self.path.cond

    @property
    def queue(self):
        """The queue of the link into this tier."""
        return self.path.workers[0].queue

    @property
    def buffer_slot(self) -> dict:
        """Key -> its range of the buffer."""
        return self.buffered.slot_of

    @property
    def mover(self):
        """The link's mover (its staging ring and copy stream), which moves every byte into this tier."""
        return self.path.workers[0].mover

    @property
    def host(self):
        """The host tier's cache, or None without one."""
        return self.path.tiers[1].cache if len(self.path.tiers) > 1 else None

    @property
    def prefetched_unused(self) -> set:
        return self.path.prefetched_unused

    def propose(self, proposals, routed_layer: int) -> None:
        self.path.propose(proposals, routed_layer)

    # ------------------------------------------------------------------- the link into the tier (locked)
    prefetches_wait_for_room = True  # a prefetch starts only into a free range: it waits for one
    room_wait_s = None               # until the buffer changes

    @property
    def holding(self):
        return self.landed

    def take(self, worker, transfer):
        """(a buffer range of the segment's size, whether it is the whole expert) when one is free (``room``),
        else None."""
        key = transfer.key
        elements = self.segment_elements(key)
        if not self.room(transfer.demand, elements, self.path.pinned):
            return None
        return self.buffered.assign(key, elements), key not in self.tops[key // self.spec.num_experts]

    def write(self, worker, key: int, slot, source, source_slot):
        """Unlocked: the segment's bytes (``_load``); the CUDA event of the copy, or None."""
        return self._load(key, slot[0], slot[1], source)[0]

    def land(self, worker, key: int, slot, ready, demand: bool) -> None:
        """The segment is in the buffer: computed with by its layer, kept for a layer ahead, or dropped when its
        layer was routed without it (or gave up on it); a whole expert's top is offered to its layer's cache."""
        path, (taken, whole) = self.path, slot
        self.landed[key] = whole
        if ready is not None:
            self.buffered.ready[key] = ready
        if key not in path.pinned and not (not demand and key // self.spec.num_experts > path.layer_now):
            self.consume(key)
            return
        if whole:
            path.cond.notify_all()
            worker.moving = True  # a reconfiguration waits for the top's copy too
            try:
                self.cache_top(key, taken, ready, held=key not in path.pinned)
            finally:
                worker.moving = False

    def drop(self, key: int, slot) -> None:
        self.buffered.vacate(key)

    # --------------------------------------------------------------------------------------- state (locked)
    def parts(self, key: int) -> int:
        return 1 if self.rows[key // self.spec.num_experts] == self.intermediate else 2

    def has_part(self, key: int, part: int) -> bool:
        if part == 0 and key in self.tops[key // self.spec.num_experts]:
            return True
        return key in self.landed and (part == 1 or self.landed[key])

    def needs_bytes(self, key: int) -> bool:
        """Whether ``key`` must load something: its bottom, or the whole expert when its top is not cached."""
        return self.parts(key) == 2 or key not in self.tops[key // self.spec.num_experts]

    def complete(self, key: int) -> bool:
        return key in self.landed or not self.needs_bytes(key)

    def transfer_bytes(self, key: int) -> int:
        """Bytes a load of ``key`` reads now (``segment_elements``' share of the stored expert)."""
        return self.manifest.expert_bytes * self.segment_elements(key) // self.buffer.elements

    def segment_elements(self, key: int) -> int:
        """Elements a load of ``key`` takes in the buffer now: its bottom when its top is cached, else the whole."""
        layer = key // self.spec.num_experts
        if key in self.tops[layer]:
            return 3 * (self.intermediate - self.rows[layer]) * self.hidden
        return self.buffer.elements

    def layer_routed(self, layer: int, pinned) -> None:
        """Layer ``layer`` is routed to ``pinned``: what was fetched or held for it in vain goes."""
        J = self.spec.num_experts
        for key in [key for key in self.landed if key // J == layer and key not in pinned]:
            self.consume(key)
        top = self.tops[layer]
        for key in [key for key in top.held if key not in pinned]:
            top.release(key)

    def part_tensors(self, key: int, part: int) -> tuple[dict, object]:
        """The part's tensors (views of its slot, the segment layout) and the CUDA event to wait for."""
        layer = key // self.spec.num_experts
        r = self.rows[layer]
        if part == 0 and key in self.tops[layer]:
            tops = self.top_tiers[layer]
            region, event = tops.region(tops.slot_of[key]), tops.ready.get(key)
            first = 0
        else:
            region, event = self.buffer.region(self.buffered.slot_of[key]), self.buffered.ready.get(key)
            first = 3 * r * self.hidden if part == 1 and self.landed[key] else 0  # a bottom alone starts its range
        rows = r if part == 0 else self.intermediate - r
        H = self.hidden
        part_region = region[first:first + 3 * rows * H]
        return {"gate_up_proj": part_region[:2 * rows * H].view(2 * rows, H),
                "down_proj": part_region[2 * rows * H:].view(H, rows), "part": part,
                "parts": self.parts(key)}, event

    def consume(self, key: int) -> None:
        """``key`` has computed (or its layer gave up on it, or was routed without it): its buffer range is free.
        A key still on the wire keeps its range: the worker frees it when it lands unpinned."""
        if self.path.on_wire_to_fast(key):
            return
        self.landed.pop(key, None)
        self.buffered.vacate(key)
        self.path.gone_unused(key)
        self.cond.notify_all()

    def room(self, demand: bool, elements: int, pinned) -> bool:
        """Whether a buffer range of ``elements`` is free for a load; a demand load drops the landed segments that
        the current layer (``pinned``) does not compute with, the most recent first, until one is
        (tiers.SegmentPool says why one then is)."""
        if not demand:
            return self.buffer.fits(elements)
        while not self.buffer.fits(elements):
            droppable = [key for key in self.landed if key not in pinned]
            if not droppable:
                return False
            self.consume(droppable[-1])
        return True

    def end_request(self, request) -> None:
        for top in self.tops:
            top.end_request(request)

    # ---------------------------------------------------------------------------------------- reconfiguration
    def reconfigure(self, config: SplitConfig, iteration: int, tokens: int, cached=None) -> bool:
        """Apply ``config`` between two passes (runtime/split_online.py): nothing moves into this tier, nothing is
        buffered or held, each layer's tops are those of the experts ``cached[i]`` (its top-C_i by priority,
        simulator/timed/reconfigure.py ``ranked_tops``; without it, the C_i the policy keeps) in a pool of the
        new size: copied from the old pool, read whole where the top is new or the ratio changed. False, with
        nothing changed, when it would not fit in the fast budget. Locked; the caller's pass is over (nothing
        pinned)."""
        source = f"the online configuration after {tokens} tokens"
        rows = split_rows(config, self.intermediate, source)
        memory = self._memory(config, rows)
        record = {"iteration": iteration, "tokens": tokens, "applied": memory <= self.budget_bytes,
                  "memory_bytes": memory, "bytes_loaded": 0,
                  "layers": [{"cache_size": p.cached_experts, "split_ratio": p.split_ratio, "rows": r,
                              "prefetches": p.prefetches} for p, r in zip(config.layers, rows)]}
        self.reconfigurations.append(record)
        if not record["applied"]:
            return False
        path = self.path
        path.withdraw_prefetches()
        path.cond.wait_for(lambda: not path.workers[0].moving)
        path.raise_failure()
        for key in list(self.landed):
            self.consume(key)
        for top in self.tops:
            for key in list(top.held):
                top.release(key)
        path.predicted.clear()
        for layer, (plan, r) in enumerate(zip(config.layers, rows)):
            record["bytes_loaded"] += self._resize_layer(layer, plan.cached_experts, r,
                                                         None if cached is None else cached[layer])
        self.cached_experts = [plan.cached_experts for plan in config.layers]
        self.memory_bytes, self.prefetches = memory, config.prefetches
        return True

    def _resize_layer(self, layer: int, cached: int, rows: int, keys=None) -> int:
        """Layer ``layer`` caches ``cached`` tops of ``rows`` rows from now on, those of ``keys`` when given;
        returns the bytes read."""
        top, old, old_rows = self.tops[layer], self.top_tiers[layer], self.rows[layer]
        if cached == old.pool.slots and rows == old_rows and (keys is None or set(keys) == top.resident.keys()):
            return 0
        import torch

        ctx = self.path.ctx
        if keys is None:
            top.resize(cached, ctx)  # nothing is pinned or held: exactly C_i stay
        missing = [] if keys is None else top.keep_exactly(keys, cached, ctx)
        with torch.inference_mode(False):  # called under generate's inference mode; the worker writes the pool too
            tier = self.top_tiers[layer] = self._top_tier(top, cached, rows)
        kept = list(top.resident)
        self.rows[layer] = rows
        host = self.path.tiers[1] if len(self.path.tiers) > 1 else None
        moved = 0
        for key in kept + missing:
            slot = tier.assign(key)
            if key in kept and rows == old_rows:  # the same top: copied from the old pool
                event = self.mover.copy(tier.region(slot), old.region(old.slot_of[key]), old.ready.get(key))
            else:  # new, or cut at another row: read the whole expert (its bottom's checksum changes too)
                started = time.perf_counter()
                source = host if host is not None and key in host.cache else None
                buffered = self.buffer.take()
                try:
                    landed, nbytes = self._load(key, buffered, True, source)
                    event = self._copy_top(layer, buffered, slot, landed)
                finally:
                    self.buffer.give_back(buffered)
                self.counters.moved("ssd->fast" if source is None else "host->fast", nbytes,
                                    time.perf_counter() - started)
                moved += nbytes
            if event is not None:
                event.synchronize()  # CUDA: the old pool is freed on return
            if key not in kept:
                top.complete(key, ctx)
        return moved

    # ------------------------------------------------------------------------------------------ the bytes
    def cache_top(self, key: int, slot: tuple[int, int], landed_event, held: bool) -> None:
        """Copy the top of the whole expert in buffer range ``slot`` into its layer's cache if the policy makes
        room, never evicting a top the current layer computes with or whose bottom is buffered; a prefetch's
        top is held (module doc). Locked; the copy runs outside the lock."""
        path = self.path
        layer = key // self.spec.num_experts
        ctx, top = path.ctx, self.tops[layer]
        ctx.pinned, ctx.prefetch = path.pinned | self.buffer_slot.keys(), held
        protect = path.protected(key) if held else ()
        try:
            admitted = top.reserve(key, ctx, 1, protect)
        finally:
            ctx.pinned, ctx.prefetch = path.pinned, False
        if not admitted:
            return
        tops = self.top_tiers[layer]
        top_slot = tops.assign(key)
        path.cond.release()
        try:
            top_event = self._copy_top(layer, slot, top_slot, landed_event)
        finally:
            path.cond.acquire()
        if top_event is not None:
            tops.ready[key] = top_event
        ctx.prefetch = held
        try:
            top.complete(key, ctx)
        finally:
            ctx.prefetch = False
        path.cond.notify_all()

    def _load(self, key: int, slot: tuple[int, int], whole: bool, host=None):
        """Write ``key``'s whole expert ([top | bottom]) or its bottom into buffer range ``slot``, from the files or
        from its copy in the ``host`` tier (kept there while this reads it); returns (the CUDA event of the copy
        or None, bytes read)."""
        import torch
        import xxhash

        layer, expert = divmod(key, self.spec.num_experts)
        r, I, H = self.rows[layer], self.intermediate, self.hidden
        staging = self.mover.staging(pinned=self.device.type == "cuda")
        array = staging.numpy()
        host_copy = None if host is None else host.region(host.slot_of[key]).view(torch.uint8)
        if whole:
            if host_copy is None:
                self.store.read(layer, expert, lambda a, b: memoryview(array[a:b]))
            views = expert_views(self.manifest, staging if host_copy is None else host_copy)
            gate_up, down = views["gate_up_proj"], views["down_proj"]
            # [top | bottom], each part's tensors flattened row-major, copied on this thread alone (cpu_threads)
            compact, filled = torch.empty(gate_up.numel() + down.numel(), dtype=gate_up.dtype), 0
            for part in (gate_up[:r], gate_up[I:I + r], down[:, :r], gate_up[r:I], gate_up[I + r:], down[:, r:]):
                copy_serially(compact[filled:filled + part.numel()].view(part.shape), part)
                filled += part.numel()
            if r < I:
                bottom = compact[3 * r * H:].view(torch.uint8).numpy()
                self.bottom_digest[key] = xxhash.xxh3_64_hexdigest(bottom)
            nbytes = self.manifest.expert_bytes
        else:
            runs, nbytes = bottom_ranges(self.manifest, r)
            if host_copy is not None:  # the host copy was read and verified whole
                copied, source = 0, host_copy.numpy()
                for offset, length in runs:
                    array[copied:copied + length] = source[offset:offset + length]
                    copied += length
            else:
                self.store.read_runs(layer, expert, runs, memoryview(array[:nbytes]))
            if host_copy is None and self.store.verify \
                    and xxhash.xxh3_64_hexdigest(array[:nbytes]) != self.bottom_digest[key]:
                path = self.manifest.layer_path(layer)
                raise ExpertReadError(f"expert {expert} of layer {layer}: {path}: its bottom segment does not match "
                                      "the bytes read and verified before (the file is corrupt or was replaced)")
            compact = staging[:nbytes].view(self.stored)
        destination = self.buffer.region(slot)[:compact.numel()]
        return self.mover.copy(destination, compact, self.buffer.free_after[slot[0]]), nbytes

    def _copy_top(self, layer: int, slot: tuple[int, int], top_slot: int, landed_event):
        """The top of the whole expert in buffer range ``slot`` into ``top_slot`` of the layer's cache."""
        pool = self.top_tiers[layer].pool
        source = self.buffer.region(slot)[:pool.elements]
        return self.mover.copy(pool.memory[top_slot], source, pool.free_after[top_slot], landed_event)
