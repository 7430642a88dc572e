"""MoEpic's split experts in the runtime (paper 004, sections 3.1-3.2): what `generate --split-config` runs.

The configuration is the one `moe-offload configure` writes and the timed simulator runs
(simulator/split.py: per layer i, C_i cached tops and the split ratio theta_i). In the runtime an expert is
split along its intermediate dimension: its *top* is intermediate rows [0, r_i) (gate rows, up rows and
down columns [0, r_i)), r_i = round(theta_i I) of the I rows (at least one), its *bottom* the rest. The
fast memory holds

- per layer, a cache of C_i tops (an ExpertCache of C_i entries with the run's eviction policy, over a
  pool of C_i top-sized slots), and
- one prefetch buffer of K whole experts (the paper's U_b, K = top-k): a slot holds an expert's bottom, or
  its whole copy when its top is not cached.

A layer's expert whose top is cached loads only its bottom; otherwise the whole expert is loaded into the
buffer and its top is copied into the layer's cache if the policy makes room (never evicting a top the
layer computes with). The expert computes its top part as soon as it has its top, and its bottom part
when the bottom lands (models/experts.py adds them in a fixed order): the top's compute overlaps the
bottom's transfer. A buffer slot is freed once its expert has computed. The memory of a split run is the
tops and the buffer, which is what a split run and an unsplit one are compared at.

A slot holds a part in the *segment layout*: gate rows, up rows (together ``gate_up_proj`` [2r, H]), then
the down columns as a row-major [H, r] block (``down_proj``); a buffer slot is [top | bottom] in that
layout. A whole expert is read with the checked chunk reads of the pack (runtime/storage.py) and rearranged;
a bottom alone is read as the manifest's byte ranges (gate rows, up rows, one run per down row: ``H + 2``
ranges, fewer when they touch), straight into the segment layout. The pack's chunk checksums cover whole
chunks, so a bottom read alone is checked against an xxHash3 of the same bytes taken when the whole expert
was read and verified: a top is cached only from a whole read, so every bottom-only read has one before it.

Lossless: the parts are the same contiguous tensors as the all-resident reference's
(models/experts.py ``split_parts``) and are added in the same order, so a split run gives the tokens and
logits of the all-resident model computing with the same split, whatever the budget. What is not done here:
prefetching (MoEpic's Y_i), a host tier, preloading and online reconfiguration; the engine refuses them with
a split configuration.

Counters: an access is a *hit* when the expert's top is cached (its bottom is always loaded, unless theta is
1), a miss loads the whole expert; both count as demand loads when bytes move.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from moe_offload.errors import ConfigError
from moe_offload.policies import AccessContext
from moe_offload.runtime.runner import ModelRunner, _wait
from moe_offload.runtime.tiers import SlotPool
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.split import SplitConfig, read_split_config


def split_rows(config: SplitConfig, intermediate: int, source: str) -> list[int]:
    """r_i = round(theta_i I) intermediate rows of each layer's top; a top of no row is refused."""
    rows = []
    for layer, plan in enumerate(config.layers):
        r = min(intermediate, round(plan.split_ratio * intermediate))
        if r < 1:
            raise ConfigError(f"{source}: layer {layer}: a top of {plan.split_ratio:g} x {intermediate} intermediate "
                              "rows holds no row")
        rows.append(r)
    return rows


def load_split_config(split) -> tuple[SplitConfig, str]:
    """(configuration, its name for messages) from a SplitConfig or the path of `configure --json`'s file."""
    if isinstance(split, SplitConfig):
        return split, "the split configuration"
    return read_split_config(split), str(split)


def bottom_ranges(manifest, rows: int) -> tuple[list[tuple[int, int]], int]:
    """The byte ranges, in an expert's region, of its bottom below intermediate row ``rows`` (gate rows, up rows,
    each down row's columns; ranges that touch are merged), in the segment layout's order, and its size."""
    tensors = {t.name: t for t in manifest.tensors}
    gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
    H, I = down.shape
    item = gate_up.nbytes // (2 * I * H)
    b = I - rows
    runs = [(gate_up.offset + rows * H * item, b * H * item), (gate_up.offset + (I + rows) * H * item, b * H * item)]
    runs += [(down.offset + (h * I + rows) * item, b * item) for h in range(H)]
    merged = [runs[0]]
    for offset, nbytes in runs[1:]:
        last_offset, last_bytes = merged[-1]
        if last_offset + last_bytes == offset:
            merged[-1] = (last_offset, last_bytes + nbytes)
        else:
            merged.append((offset, nbytes))
    return merged, 3 * b * H * item


class SplitFastTier:
    """The fast memory of a split run (module doc) and its one link worker (files -> fast), demand loads only.

    Guarded by ``cond`` (the runner's lock, as DataPath's): ``pinned`` holds the experts the current layer
    computes with (their tops are never evicted, their buffer slots never reused); ``queue`` the experts
    whose bytes the layer waits for."""

    def __init__(self, config: SplitConfig, source: str, manifest, store, counters, spec, make_policy, device,
                 compute_dtype, budget_bytes: int):
        import torch

        self.manifest, self.store, self.counters, self.spec = manifest, store, counters, spec
        self.device = device
        self.hidden, self.intermediate = next(t for t in manifest.tensors if t.name == "down_proj").shape
        self.stored = getattr(torch, manifest.dtype)
        self.rows = split_rows(config, self.intermediate, source)
        element_bytes = compute_dtype.itemsize
        self.memory_bytes = (sum(plan.cached_experts * 3 * r * self.hidden for plan, r in zip(config.layers, self.rows))
                             + spec.top_k * 3 * self.intermediate * self.hidden) * element_bytes
        if self.memory_bytes > budget_bytes:
            from moe_offload.hardware.profile import format_bytes

            raise ConfigError(f"{source}: the cached tops and the buffer of {spec.top_k} experts need "
                              f"{format_bytes(self.memory_bytes)}, more than the fast budget of "
                              f"{format_bytes(budget_bytes)}")
        self.cached_experts = [plan.cached_experts for plan in config.layers]
        self.tops = [ExpertCache(plan.cached_experts, make_policy()) for plan in config.layers]
        self.top_pools = [SlotPool(plan.cached_experts, 3 * r * self.hidden, compute_dtype, device)
                          for plan, r in zip(config.layers, self.rows)]
        for top in self.tops:
            top.on_evict = self._vacate_top
        self.top_slot: dict[int, int] = {}
        self.buffer = SlotPool(spec.top_k, 3 * self.intermediate * self.hidden, compute_dtype, device)
        self.buffer_slot: dict[int, int] = {}
        self.landed: dict[int, bool] = {}    # key -> whether its buffered copy is the whole expert
        self.ready: dict[int, object] = {}   # CUDA: key -> event of its copy into the buffer
        self.top_ready: dict[int, object] = {}
        self.bottom_digest: dict[int, str] = {}  # key -> xxHash3 of its bottom's stored bytes (verified read)
        self.cond = threading.Condition()
        self.ctx = AccessContext()
        self.pinned: set[int] = set()
        self.ctx.pinned = self.pinned
        self.queue: deque[int] = deque()
        self.on_wire: int | None = None
        self.failure: BaseException | None = None
        self.failed_key: int | None = None
        self.stopping = False
        self._stream = None  # CUDA: the copy stream
        self._staging = None
        self._worker = threading.Thread(target=self._run, name="moe-offload ssd->fast (split)", daemon=True)
        self._worker.start()

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

    def demand(self, key: int) -> None:
        if key not in self.queue and key not in self.landed and self.on_wire != key:
            self.queue.append(key)

    def part_tensors(self, key: int, part: int) -> tuple[dict, object]:
        """The part's tensors (views of its slot, the segment layout) and the CUDA event to wait for."""
        layer = key // self.spec.num_experts
        r = self.rows[layer]
        if part == 0 and key in self.tops[layer]:
            region, event = self.top_pools[layer].memory[self.top_slot[key]], self.top_ready.get(key)
            first = 0
        else:
            region, event = self.buffer.memory[self.buffer_slot[key]], self.ready.get(key)
            first = 0 if part == 0 else 3 * r * self.hidden
        rows = r if part == 0 else self.intermediate - r
        H = self.hidden
        part_region = region[first:first + 3 * rows * H]
        return {"gate_up_proj": part_region[:2 * rows * H].view(2 * rows, H),
                "down_proj": part_region[2 * rows * H:].view(H, rows), "part": part,
                "parts": self.parts(key)}, event

    def consume(self, key: int) -> None:
        """``key`` has computed (or its layer gave up on it): its buffer slot is free. A key still on the wire
        keeps its slot: the worker frees it when it lands unpinned."""
        if key == self.on_wire:
            return
        slot = self.buffer_slot.pop(key, None)
        self.landed.pop(key, None)
        self.ready.pop(key, None)
        if slot is not None:
            self._free_after_compute(self.buffer, slot)
            self.buffer.give_back(slot)
        self.cond.notify_all()

    def _vacate_top(self, key: int) -> None:
        pool = self.top_pools[key // self.spec.num_experts]
        slot = self.top_slot.pop(key)
        self.top_ready.pop(key, None)
        self._free_after_compute(pool, slot)
        pool.give_back(slot)

    def _free_after_compute(self, pool: SlotPool, slot: int) -> None:
        if self.device.type == "cuda":  # kernels queued so far may still read the slot
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.default_stream(self.device))
            pool.free_after[slot] = event

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def clear_failure(self) -> None:
        self.failure = self.failed_key = None

    def end_request(self, request) -> None:
        for top in self.tops:
            top.end_request(request)

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._worker.join(timeout=5)
        self.store.close()

    # ------------------------------------------------------------------------------------------ the worker
    def _run(self) -> None:
        cond = self.cond
        with cond:
            while not self.stopping:
                if not self.queue or not self.buffer.free:
                    cond.wait()
                    continue
                key = self.queue.popleft()
                layer = key // self.spec.num_experts
                whole = key not in self.tops[layer]
                slot = self.buffer.take()
                self.buffer_slot[key], self.on_wire = slot, key
                cond.release()
                started, error, event = time.perf_counter(), None, None
                try:
                    event, nbytes = self._load(key, slot, whole)
                except BaseException as exc:  # reported to the compute thread, which raises it
                    error = exc
                finally:
                    cond.acquire()
                self.on_wire = None
                if error is not None:
                    self.buffer_slot.pop(key)
                    self.buffer.give_back(slot)
                    if key in self.pinned and self.failure is None:
                        self.failure, self.failed_key = error, key
                    cond.notify_all()
                    continue
                self.counters.moved("ssd->fast", nbytes, time.perf_counter() - started)
                if key not in self.pinned:  # its layer gave up on it (a failure elsewhere)
                    self.buffer_slot.pop(key)
                    self.buffer.give_back(slot)
                    continue
                self.landed[key] = whole
                if event is not None:
                    self.ready[key] = event
                cond.notify_all()
                if whole and self.tops[layer].reserve(key, self.ctx, 1):  # never evicts a pinned top
                    self.top_slot[key] = top_slot = self.top_pools[layer].take()
                    cond.release()
                    try:
                        top_event = self._copy_top(layer, slot, top_slot, event)
                    finally:
                        cond.acquire()
                    if top_event is not None:
                        self.top_ready[key] = top_event
                    self.tops[layer].complete(key, self.ctx)
                    cond.notify_all()

    def _load(self, key: int, slot: int, whole: bool):
        """Write ``key``'s whole expert ([top | bottom]) or its bottom into buffer slot ``slot``; returns (the CUDA
        event of the copy or None, bytes read)."""
        import torch
        import xxhash

        from moe_offload.runtime.storage import ExpertReadError, expert_views

        layer, expert = divmod(key, self.spec.num_experts)
        r, I, H = self.rows[layer], self.intermediate, self.hidden
        staging = self._staging_buffer()
        array = staging.numpy()
        if whole:
            self.store.read(layer, expert, lambda a, b: memoryview(array[a:b]))
            views = expert_views(self.manifest, staging)
            gate_up, down = views["gate_up_proj"], views["down_proj"]
            compact = torch.cat([gate_up[:r].reshape(-1), gate_up[I:I + r].reshape(-1),
                                 down[:, :r].reshape(-1), gate_up[r:I].reshape(-1),
                                 gate_up[I + r:].reshape(-1), down[:, r:].reshape(-1)])
            if r < I:
                bottom = compact[3 * r * H:].view(torch.uint8).numpy()
                self.bottom_digest[key] = xxhash.xxh3_64_hexdigest(bottom)
            nbytes = self.manifest.expert_bytes
            first = 0
        else:
            runs, nbytes = bottom_ranges(self.manifest, r)
            self.store.read_runs(layer, expert, runs, memoryview(array[:nbytes]))
            if self.store.verify and xxhash.xxh3_64_hexdigest(array[:nbytes]) != self.bottom_digest[key]:
                path = self.manifest.layer_path(layer)
                raise ExpertReadError(f"expert {expert} of layer {layer}: {path}: its bottom segment does not match "
                                      "the bytes read and verified before (the file is corrupt or was replaced)")
            compact = staging[:nbytes].view(self.stored)
            first = 3 * r * H
        destination = self.buffer.memory[slot][first:first + compact.numel()]
        return self._copy(destination, compact, self.buffer.free_after[slot]), nbytes

    def _copy_top(self, layer: int, slot: int, top_slot: int, landed_event):
        """The top of the whole expert in buffer slot ``slot`` into ``top_slot`` of the layer's cache."""
        pool = self.top_pools[layer]
        source = self.buffer.memory[slot][:pool.memory.shape[1]]
        return self._copy(pool.memory[top_slot], source, pool.free_after[top_slot], landed_event)

    def _copy(self, destination, source, free_after, after=None):
        """``destination.copy_(source)``; on CUDA on the copy stream once the slot's readers are done (and
        ``after``), returning the copy's event (the staging buffer is reused only after it)."""
        if self.device.type != "cuda":
            destination.copy_(source)
            return None
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            for wait in (free_after, after):
                if wait is not None:
                    self._stream.wait_event(wait)
            destination.copy_(source, non_blocking=True)
            event.record(self._stream)
        self._staging_event = event
        return event

    def _staging_buffer(self):
        """The worker's staging buffer (pinned with CUDA), once the copy that last read it has completed."""
        import torch

        if self._staging is None:
            self._staging = torch.empty(self.manifest.expert_bytes, dtype=torch.uint8,
                                        pin_memory=self.device.type == "cuda")
            self._staging_event = None
        if self._staging_event is not None:
            self._staging_event.synchronize()
            self._staging_event = None
        return self._staging


class SplitRunner(ModelRunner):
    """The model runner of a split run: its expert source yields each expert in parts (module doc)."""

    def end_request(self, request: int) -> None:
        with self.path.cond:
            self.path.end_request(request)
        self.request_counters.pop(request, None)

    def layer_experts(self, layer: int, experts: list[int], tokens: list[list[int]]):
        J = self.spec.num_experts
        keys = [layer * J + e for e in experts]
        c, split = self.counters, self.path
        own = [self.request_counters.get(request) for request in self.segment_requests]
        cond = split.cond
        with cond:
            split.raise_failure()
            ctx = split.ctx
            ctx.layer, ctx.iteration, ctx.token = layer, self.iteration, self.iteration
            ctx.request = self.segment_requests[0]
            if self.policy_needs_probs:
                ctx.probs, ctx.predicted = self.probs, None
            split.pinned.clear()
            split.pinned.update(keys)
            for key, counts in zip(keys, tokens):
                ctx.clock += 1
                ctx.routed = {request: n for request, n in zip(self.segment_requests, counts) if n}
                c.accesses += 1
                c.per_layer_accesses[layer] += 1
                hit = split.tops[layer].touch(key, ctx)
                c.hits += hit
                c.per_layer_hits[layer] += hit
                demand = split.needs_bytes(key)
                if demand:
                    c.on_demand_loads += 1
                    split.demand(key)
                for counters, n in zip(own, counts):
                    if counters is not None and n:
                        counters.count_access(layer, hit, demand, False, False)
                for request in ctx.routed:
                    self.keys_of.setdefault(request, set()).add(key)
            ctx.routed = None
            cond.notify_all()
        try:
            remaining = [(key, part) for key in keys for part in range(split.parts(key))]
            while remaining:
                with cond:
                    waited = time.perf_counter()
                    while True:
                        split.raise_failure()
                        ready = next((item for item in remaining if split.has_part(*item)), None)
                        if ready is not None:
                            break
                        cond.wait()
                    stalled = time.perf_counter() - waited
                    c.stall_seconds += stalled
                    c.per_layer_stall_seconds[layer] += stalled
                    for counters in own:
                        if counters is not None:
                            counters.stall_seconds += stalled
                            counters.per_layer_stall_seconds[layer] += stalled
                    tensors, event = split.part_tensors(*ready)
                remaining.remove(ready)
                _wait(event)
                key = ready[0]
                yield key - layer * J, tensors
                if not any(k == key for k, _ in remaining):
                    with cond:  # computed: its buffer slot is free, its top may be evicted
                        split.consume(key)
                        split.pinned.discard(key)
        finally:
            with cond:
                for key in keys:
                    if key in split.queue:
                        split.queue.remove(key)
                    split.consume(key)
                split.pinned.difference_update(keys)
                cond.notify_all()

