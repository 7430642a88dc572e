"""The data path: how an expert gets from the packed files, through an optional host tier, into the fast tier.

::

    layer files --readers--> [ host tier slot ] --copy--> fast tier slot
                  (chunks in parallel,  pinned with CUDA      GPU memory, or RAM in the compute dtype
                   checked, converted)

One :class:`LinkWorker` thread per link serves that link's
:class:`~moe_offload.simulator.transfers.TransferQueue`, the timed simulator's queue logic: demand loads jump
the queue and hold prefetches back, a transfer is never duplicated, prefetches go by priority. For each
transfer the worker reserves room in the destination tier (``ExpertCache.reserve``, evicting the policy's
victims; a prefetch into the fast tier is held there until its layer uses it or withdraws it), takes a
slot, and moves the bytes outside the lock, by the routes of runtime/mover.py (``ExpertMover``): files -> host
tier, files -> fast tier (converted on a CPU, through a pinned ring into a GPU), host tier -> fast tier.

A miss the fast tier does not admit (a placing policy's bypass) goes no further than the host tier, which
keeps it while the layer computes it there (``compute_on_host``, models/host_experts.py).

A split run (MoEpic, runtime/split.py) runs on the same path and the same workers: its fast tier is a
:class:`~moe_offload.runtime.segment_tier.SegmentTier`, whose segments (whole experts, bottoms) the link worker
into it moves from the files or the host tier, while the link workers before it fill the host tier as for any
run (the two hops overlap). A worker asks its destination tier for a slot (``take``), the bytes (``write``,
outside the lock), and tells it the arrival (``land``) or the failure (``drop``): runtime/tiers.py ``Tier`` for
whole experts, SegmentTier for segments.

All cache, queue and policy state is guarded by one condition variable (``DataPath.cond``); bytes move
outside it.
"""

from __future__ import annotations

import math
import threading
import time

from moe_offload.hardware.profile import Link
from moe_offload.policies import AccessContext
from moe_offload.runtime.counters import Counters
from moe_offload.runtime.mover import ExpertMover
from moe_offload.runtime.segment_tier import SegmentTier
from moe_offload.runtime.storage import ExpertStore
from moe_offload.runtime.tiers import Tier
from moe_offload.simulator.cache import predicted_no_later_than
from moe_offload.simulator.transfers import TransferQueue


class DataPath:
    """The tiers (``tiers[0]`` is the fast tier), their link workers and every expert on its way."""

    def __init__(self, tiers: list[Tier], store: ExpertStore, counters: Counters, spec):
        self.tiers, self.store, self.counters, self.spec = tiers, store, counters, spec
        self.cond = threading.Condition()
        self.ctx = AccessContext()
        self.pinned: set[int] = set()     # the fast tier's: experts the current layer computes with
        self.ctx.pinned = self.pinned
        self.stopping = False
        self.failure: BaseException | None = None
        self.failed_key: int | None = None  # the expert whose transfer failed
        self.forward: dict[int, tuple[bool, float]] = {}  # key -> (demand, priority) of its next hop
        self.prefetched_unused: set[int] = set()
        self.predicted: set[int] = set()  # resident in the fast tier, proposed since their layer was routed
        self.layer_now = -1                # the last routed layer of the running forward pass
        self.reading_from: list[set] = [set() for _ in tiers]  # keys being copied out of each tier now
        self.on_host: set[int] = set()  # bypassed experts the layer computes from the host tier's copy

        self.split = tiers[0] if isinstance(tiers[0], SegmentTier) else None  # a split run's fast tier
        if self.split is not None:
            self.split.path = self
        else:
            tiers[0].cache.on_evict = self._on_fast_evict
        for tier in tiers[1:]:
            tier.cache.on_evict = tier.vacate
        names = [tier.name for tier in tiers] + ["ssd"]
        links = [Link(names[i + 1], names[i], math.inf, 0.0) for i in range(len(tiers))]
        self.workers = [LinkWorker(self, i + 1 if i + 1 < len(tiers) else None, i, link)
                        for i, link in enumerate(links)]
        for worker in self.workers:
            worker.start()

    # ------------------------------------------------------------------------------------ locked helpers
    def route(self, key: int, demand: bool, priority: float) -> bool:
        """Queue ``key`` towards the fast tier from the nearest tier that holds it; True if queued."""
        for index in range(1, len(self.tiers)):
            if key in self.tiers[index].cache:
                worker = self.workers[index - 1]
                break
        else:
            worker = self.workers[-1]
            if len(self.tiers) > 1:  # to the host first; the last hop follows when it lands
                previous = self.forward.get(key)
                if demand or previous is None or not previous[0]:
                    self.forward[key] = (demand, priority)
        return worker.queue_transfer(key, demand, priority)

    def compute_on_host(self, key: int) -> None:
        """The fast tier did not admit the missed ``key``: the layer computes it from the host tier's copy, read
        from the files into the host tier first when it is not there (and no further). The copy stays in the
        host tier until :meth:`computed_on_host`."""
        self.on_host.add(key)
        if key not in self.tiers[-1].cache:
            self.route(key, demand=True, priority=math.inf)
            self.cond.notify_all()

    def computed_on_host(self, key: int) -> None:
        self.on_host.discard(key)

    def next_hop(self, key: int, landed_in: int, demand: bool) -> None:
        if landed_in == 0:
            return
        if key in self.on_host:  # a bypassed expert, computed where it landed
            self.forward.pop(key, None)
            return
        demand_next, priority = self.forward.pop(key, (demand, 0.0))
        if not self.tiers[0].complete(key):
            self.workers[landed_in - 1].queue_transfer(key, demand_next, priority)

    def on_wire_to_fast(self, key: int) -> bool:
        wire = self.workers[0].queue.on_wire
        return wire is not None and wire.key == key

    def propose(self, proposals, routed_layer: int) -> None:
        """A prefetcher's (key, priority) proposals after layer ``routed_layer`` was routed."""
        if not proposals:
            return
        J = self.spec.num_experts
        if self.split is None:  # a split run's moves on at routing alone (SegmentTier.land drops what lands behind)
            self.layer_now = routed_layer
        # once the last layer is routed every layer is ahead: proposals are for the next pass (prefetch/base.py),
        # MoEpic's layer 0 of the next token among them, as the timed simulator takes them
        passed = -1 if routed_layer == self.spec.num_layers - 1 else routed_layer
        routed = False
        for key, priority in proposals:
            key = int(key)
            if key // J <= passed or self.on_wire_to_fast(key):
                continue
            if self.tiers[0].complete(key):  # predicted, resident: no later prefetch may evict it (cache.py)
                self.predicted.add(key)
                continue
            self.route(key, demand=False, priority=float(priority))
            routed = True
        if routed:
            self.cond.notify_all()

    def layer_routed(self, layer: int, keys) -> None:
        """Layer ``layer`` is routed to ``keys``: its waiting prefetches are too late, and the experts that
        were prefetched for it and not chosen are no longer held (cache.py)."""
        J = self.spec.num_experts
        self.withdraw_prefetches(layer, keys)
        # after the last layer every layer is ahead (-1: the same place modulo L for predicted_no_later_than)
        self.layer_now = -1 if layer == self.spec.num_layers - 1 else layer
        self.tiers[0].layer_routed(layer, keys)
        if self.predicted:
            self.predicted = {key for key in self.predicted if key // J != layer}

    def withdraw_prefetches(self, layer: int | None = None, keys=()) -> None:
        """The waiting prefetches on every link: all of them (a split run's reconfiguration), or those of
        ``layer`` not in ``keys`` (locked)."""
        J = self.spec.num_experts
        for worker in self.workers:
            for key in worker.queue.waiting_prefetches():
                if layer is None or (key // J == layer and key not in keys):
                    worker.queue.withdraw(key)
                    self.forward.pop(key, None)

    def protected(self, key: int):
        """What a prefetch of ``key`` into the fast tier must not evict: the predicted residents whose layers
        come no later than its own (simulator/cache.py)."""
        if not self.predicted:
            return ()
        return predicted_no_later_than(self.predicted, key, self.layer_now, self.spec.num_experts,
                                       self.spec.num_layers)

    def use(self, key: int) -> bool:
        """``key`` is accessed: True when a prefetch of it is used now (counted)."""
        if key in self.prefetched_unused:
            self.prefetched_unused.discard(key)
            self.counters.prefetches_used += 1
            return True
        return False

    def gone_unused(self, key: int) -> None:
        """``key`` left the fast tier: a prefetch of it that was never used is wasted (counted)."""
        if key in self.prefetched_unused:
            self.prefetched_unused.discard(key)
            self.counters.prefetches_wasted += 1

    def end_request(self, request: int) -> None:
        for tier in self.tiers:
            tier.end_request(request)

    def room_freed(self) -> None:
        """Experts were unpinned or released (locked): wake the link workers only if a demand load waits for
        room. Waking them at every layer of a decode whose experts are all resident costs the compute thread
        a context switch and the lock per layer, for nothing."""
        if any(worker.queue.has_waiting_demands for worker in self.workers):
            self.cond.notify_all()

    def busy(self) -> bool:
        return any(w.queue.waiting() or w.queue.busy for w in self.workers)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def clear_failure(self) -> None:
        """The failure was reported to the requests it concerns: the path serves the others (locked)."""
        self.failure = self.failed_key = None

    def _on_fast_evict(self, key: int) -> None:
        self.tiers[0].vacate(key)
        self.gone_unused(key)

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for worker in self.workers:
            worker.join(timeout=5)
        self.store.close()


class LinkWorker(threading.Thread):
    """Serves one link's TransferQueue: picks the next transfer, takes a slot of the destination tier for it,
    moves the bytes outside the lock, and hands them to the tier (module doc)."""

    def __init__(self, path: DataPath, source: int | None, destination: int, link: Link):
        super().__init__(name=f"moe-offload {link.name}", daemon=True)
        self.path, self.source, self.destination, self.link = path, source, destination, link
        self.queue = TransferQueue(link, path.tiers[destination].holding)
        self.mover = ExpertMover(path.store, path.spec.num_experts)
        self.moving = False  # between taking a transfer and being done with it (a reconfiguration waits)

    def queue_transfer(self, key: int, demand: bool, priority: float) -> bool:
        """Queue ``key`` on this link, as a demand load or a prefetch of ``priority``, with the bytes its
        destination lacks of it (locked); True if queued."""
        nbytes = self.path.tiers[self.destination].transfer_bytes(key)
        return self.queue.demand(key, nbytes) if demand else self.queue.propose(key, priority, nbytes)

    def run(self) -> None:
        path, queue = self.path, self.queue
        tier = path.tiers[self.destination]
        source_tier = path.tiers[self.source] if self.source is not None else None
        cond = path.cond
        with cond:
            while not path.stopping:
                transfer = queue.next_transfer(time.perf_counter())
                if transfer is None:
                    cond.wait()
                    continue
                key = transfer.key
                if source_tier is not None and key not in source_tier.cache:
                    queue.withdraw(key)  # its host copy was evicted while it waited: from the files again
                    if transfer.demand:
                        path.route(key, True, math.inf)
                    cond.notify_all()
                    continue
                slot = tier.take(self, transfer)
                if slot is None:  # the rest of the tier is pinned, held or on its way in
                    if transfer.demand or tier.prefetches_wait_for_room:
                        cond.wait(tier.room_wait_s)
                    else:
                        queue.withdraw(key)
                        path.forward.pop(key, None)
                    continue
                nbytes = tier.transfer_bytes(key)
                queue.start(time.perf_counter())
                self.moving = True
                if self.destination == 0 and not transfer.demand:
                    path.counters.prefetches_issued += 1
                    path.prefetched_unused.add(key)
                source_slot = None
                if source_tier is not None:
                    source_slot = source_tier.slot_of[key]
                    path.reading_from[self.source].add(key)
                cond.release()
                error = None
                started = time.perf_counter()
                try:
                    ready = tier.write(self, key, slot, source_tier, source_slot)
                except BaseException as exc:  # reported to the compute thread, which raises it
                    error = exc
                finally:
                    cond.acquire()
                seconds = time.perf_counter() - started
                queue.finish()
                self.moving = False
                if source_tier is not None:
                    path.reading_from[self.source].discard(key)
                path.counters.moved(self.link.name, nbytes, seconds)  # as stored
                if error is not None:
                    tier.drop(key, slot)
                    path.prefetched_unused.discard(key)
                    path.forward.pop(key, None)
                    # A prefetch nobody waits for fails quietly: a later demand load meets the error itself.
                    if (transfer.demand or key in path.pinned) and path.failure is None:
                        path.failure, path.failed_key = error, key
                    cond.notify_all()
                    continue
                tier.land(self, key, slot, ready, transfer.demand)
                path.next_hop(key, self.destination, transfer.demand)
                cond.notify_all()
