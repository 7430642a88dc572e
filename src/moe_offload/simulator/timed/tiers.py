"""The experts' way to the GPU in the timed simulator: tiers, links, transfer queues, pinning and holds.

Experts start in the *home* tier: the fastest tier after the GPU that holds all of them (the model is
loaded there; slower tiers are not used). Tiers between the GPU and the home are caches that start empty,
like the GPU. A miss in the GPU is served from the nearest tier that holds the expert, hop by hop (SSD ->
host -> GPU, MoE-Infinity's pipeline: each hop queues on its own link, so hops of different experts
overlap). Each link carries one transfer at a time, ``latency + bytes / bandwidth``, in the order the
link's TransferQueue decides (simulator/transfers.py: demand loads first, prefetches by priority and held
back while a demand load is on its way to the link). Room is made in the destination when a transfer
starts (``ExpertCache.reserve``) and the expert becomes resident when it arrives (``complete``). A middle
tier keeps its copy (it is a cache of the slower tiers) and sees the GPU's misses as its accesses. Counted
as prefetches issued are the prefetch transfers into the GPU; one is used when its expert is requested
while on that wire or resident, before being evicted.

Pinning. The experts the current layer still has to compute are pinned in the GPU: no transfer, prefetch
or demand, may evict them. An expert is unpinned once it has run, so a layer needing more experts than
the cache holds (a long prefill) still makes progress. In a middle tier the experts being read out of it
or waiting to be read are pinned, except that a demand load may evict the copy of a waiting prefetch
(which is then dropped). A prefetch into the GPU is held there until its layer uses it or is routed
without it (simulator/cache.py), whatever the eviction policy's ranking.

Decisions. The evictions that make room for a transfer are its policy's decisions; with ``decisions``
(decisions.py) its bytes start only once they are made.

``build_tiers`` makes a run's tiers: the GPU's (an expert cache, split experts, or every expert resident) and
the caches before the home tier.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies import ModelSpec, policy_factory, policy_info
from moe_offload.policies.base import AccessContext
from moe_offload.simulator.cache import ExpertCache, predicted_no_later_than
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.simulator.split import SplitConfig, SplitExperts
from moe_offload.simulator.timed.decisions import PolicyDecisions
from moe_offload.simulator.transfers import TransferQueue, home_tier


class _Load:
    """One expert's way to the GPU: the tier it is at (``at``, the source of its next hop), whether a demand
    is waiting for it, its prefetch priority, and ``stale`` once its layer was routed while it was on an
    upstream wire (it then stops in the middle tier it reaches); ``known_at``: when it was asked for."""

    __slots__ = ("key", "demand", "priority", "at", "stale", "known_at")

    def __init__(self, key: int, demand: bool, priority: float, at: int, known_at: float):
        self.key, self.demand, self.priority, self.at, self.stale = key, demand, priority, at, False
        self.known_at = known_at


@dataclass
class Tiers:
    """A run's tiers: the GPU's (``fast``; ``split``, the same, where it is split experts), the caches between it
    and the home tier (``middle``), and the home tier's index (0: every expert in the GPU, no link used)."""

    fast: object
    split: SplitExperts | None
    middle: list
    home: int


def build_tiers(trace, hardware: HardwareProfile, policy: str, make, cache_bytes: int, expert_bytes: int,
                ctx: AccessContext, all_resident: bool, split: SplitConfig | None, admission,
                whole_layers) -> Tiers:
    """The tiers of a run of ``policy`` (``make`` builds its instances): the GPU's every expert resident, or split
    experts preloaded, or a cache of ``cache_bytes`` with ``admission`` holding a static placement's experts
    before the first pass; then one cache per tier before the home, the fastest that holds every expert (a
    static placement is the GPU's, so those caches are LRU's)."""
    meta = trace.meta
    L, J = meta.num_layers, meta.num_experts
    spec = ModelSpec(L, J, meta.top_k)
    info = policy_info(policy)

    def cache(capacity, admission=None, middle=False):
        if middle and info.policy.static:
            return ExpertCache(capacity, policy_factory("lru", spec)())
        if info.partitioned:
            return PartitionedCache(capacity, L, make, J, slot_size=expert_bytes, admission=admission,
                                    whole_layers=[] if middle else whole_layers)
        return ExpertCache(capacity, make(), admission)

    total = L * J * expert_bytes
    split_tier = None
    if all_resident:
        fast = ExpertCache(total, make())
        for key in range(L * J):
            fast.reserve(key, ctx, expert_bytes)
            fast.complete(key, ctx)
    elif split is not None:
        fast = split_tier = SplitExperts(split, J, meta.top_k, expert_bytes, make)
        split_tier.preload(ctx)
    else:
        fast = cache(cache_bytes, admission)
        fast.preload(trace, ctx, expert_bytes)
    home = home_tier(hardware, total) or 0
    return Tiers(fast, split_tier, [cache(tier.capacity_bytes, middle=True) for tier in hardware.tiers[1:home]], home)


class TierNetwork:
    """The tiers (``caches[0]`` is the GPU, ``fast``), the link into each (``queues[i]`` carries tier i to
    tier i - 1) and every expert on its way. The run moves ``now`` and ``layer_now`` and calls ``demand``,
    ``propose``, ``drop_prefetches_of`` and, at each event, ``arrive`` and ``kick``; transfer events go to
    ``events`` as (lane, kind, start, end, layer, key)."""

    def __init__(self, hardware: HardwareProfile, caches: list, home: int, expert_bytes: int, num_layers: int,
                 num_experts: int, ctx: AccessContext, pinned: set, events: list, split=None, next_use_after=None,
                 decisions: PolicyDecisions | None = None):
        self.caches, self.fast, self.home = caches, caches[0], home
        self.queues = {i: TransferQueue(hardware.link_from(i), caches[i - 1]) for i in range(1, home + 1)}
        self.E, self.J = expert_bytes, num_experts
        self.ctx, self.pinned, self.events = ctx, pinned, events
        self.split = split                    # the GPU tier of a split run (simulator/split.py), else None
        self.next_use_after = next_use_after  # offline policies: key -> clock of its next access
        self.decisions = decisions            # the policies' time per decision (decisions.py), or None
        self.loads: dict[int, _Load] = {}
        self.prefetch_loads_of_layer = [set() for _ in range(num_layers)]
        self.pending_use: set = set()  # prefetched into the GPU, not requested since
        self.predicted: set = set()    # resident in the GPU and proposed since their layer was last routed
        self.L = num_layers
        # whether compute slows any link (``computing``); with none (the presets) compute changes nothing here
        self.slowed_by_compute = any(queue.link.slowdown_while_computing != 1.0 for queue in self.queues.values())
        self.issued = 0
        self.now = 0.0
        self.layer_now = -1

    def next_arrival(self) -> tuple[float, int | None]:
        """(time, link) of the earliest transfer to arrive (links in tier order on ties), or (inf, None)."""
        best, link = math.inf, None
        for i, queue in self.queues.items():
            if queue.on_wire is not None and queue.on_wire.end_s < best:
                best, link = queue.on_wire.end_s, i
        return best, link

    def moving(self) -> bool:
        """Whether a transfer is on any link's wire now."""
        return any(queue.busy for queue in self.queues.values())

    def computing(self, busy: bool) -> None:
        """Compute starts (``busy``) or stops: each link runs at its ``slowdown_while_computing`` meanwhile, and
        a transfer on its wire is re-timed (its timeline entry too)."""
        if not self.slowed_by_compute:
            return
        for queue in self.queues.values():
            if queue.slow_down(queue.link.slowdown_while_computing if busy else 1.0, self.now):
                transfer = queue.on_wire
                lane, kind, start, _, layer, key = self.events[transfer.event]
                self.events[transfer.event] = (lane, kind, start, transfer.end_s, layer, key)

    def on_last_wire(self, key: int) -> bool:
        """Whether ``key`` is on the wire into the GPU now."""
        wire = self.queues.get(1)
        return wire is not None and wire.on_wire is not None and wire.on_wire.key == key

    def _nearest_holder(self, key: int) -> int:
        for tier in range(1, self.home):
            if key in self.caches[tier]:
                return tier
        return self.home

    def _middle_pins(self, tier: int, for_demand: bool) -> set:
        """Experts a middle tier must keep while room is made in it: the one being read out of it and the
        loads waiting to be read; a demand load may evict the copy of a waiting prefetch (which is then
        dropped), a prefetch may not, or prefetches would evict each other's copies in turn."""
        queue = self.queues[tier]
        pins = set(queue.waiting_demands()) if for_demand else queue.waiting()
        if queue.on_wire is not None:
            pins.add(queue.on_wire.key)
        return pins

    def keep_in_host(self, key: int) -> None:
        """The host read ``key`` from a slower home to compute it there (a bypassed miss, run.py): the host
        tier, a cache of the slower tiers, keeps the copy as it keeps any expert read through it (the page
        cache of llama.cpp's memory-mapped weights does the same), when it can make room without evicting what
        its link to the GPU is reading or about to read. The read itself is the host's time, not the link's."""
        if self.home < 2 or key in self.caches[1] or key in self.caches[1].reserved:
            return
        ctx = self.ctx
        ctx.pinned = self._middle_pins(1, for_demand=False)
        try:
            if self.caches[1].reserve(key, ctx, self.E):
                self.caches[1].complete(key, ctx)
        finally:
            ctx.pinned = self.pinned

    def kick(self) -> None:
        """Start whatever can start on every idle link; repeat while something started or moved."""
        moved = True
        while moved:
            moved = False
            for i, queue in self.queues.items():
                while not queue.busy:
                    transfer = queue.next_transfer(self.now)
                    if transfer is None:
                        break
                    key = transfer.key
                    load = self.loads[key]
                    if i < self.home and key not in self.caches[i]:
                        # its copy in this middle tier is gone: another demand load evicted it while it was a
                        # waiting prefetch. A prefetch is dropped; a demand load (upgraded since) comes from
                        # further away.
                        queue.withdraw(key)
                        if load.demand:
                            self._route_from_nearest(load)
                        else:
                            self._forget(load)
                        moved = True
                        continue
                    if i == 1 and self.split is not None:  # its top may have been cached or evicted since queued
                        transfer.nbytes = self.split.transfer_bytes(key)
                    ctx = self.ctx
                    ctx.pinned = self.pinned if i == 1 else self._middle_pins(i - 1, transfer.demand)
                    ctx.prefetch = i == 1 and not transfer.demand  # held in the GPU until used (cache.py)
                    protect = predicted_no_later_than(self.predicted, key, self.layer_now, self.J, self.L) \
                        if ctx.prefetch and self.predicted else ()
                    evictions = self.caches[i - 1].evictions
                    room = self.caches[i - 1].reserve(key, ctx, transfer.nbytes, protect)
                    ctx.pinned, ctx.prefetch = self.pinned, False
                    if not room:  # the destination is full of pinned or incoming experts: wait for an event
                        break
                    queue.start(self.now)
                    if self.decisions is not None:
                        self._wait_for_decisions(transfer, i - 1, self.caches[i - 1].evictions - evictions, load)
                    moved = True
                    if load.demand and i > 1:  # its arrival downstream is now known exactly
                        self._announce(load)
                    if i == 1 and not transfer.demand:
                        self.issued += 1
                        self.pending_use.add(key)
                    transfer.event = len(self.events)
                    self.events.append((queue.link.name, "demand" if transfer.demand else "prefetch",
                                        transfer.start_s, transfer.end_s, key // self.J, key))

    def _wait_for_decisions(self, transfer, tier: int, decisions: int, load: _Load) -> None:
        """The transfer just started into ``tier`` made ``decisions`` evictions: its bytes start when they are
        made (decisions.py); its link waits for them."""
        start = self.decisions.decide(tier, decisions, load.known_at, self.now, load.key // self.J, load.key)
        if start > transfer.start_s:
            transfer.end_s += start - transfer.start_s
            transfer.start_s = start

    def arrive(self, link: int) -> None:
        """The transfer on ``link`` has arrived in tier ``link - 1``."""
        transfer = self.queues[link].finish()
        key = transfer.key
        load = self.loads[key]
        ctx = self.ctx
        ctx.prefetch = not load.demand
        if self.next_use_after is not None:
            ctx.next_use = self.next_use_after(key)
        if link == 1 and self.split is not None:  # a whole copy's top is offered to the cache as it lands
            self.split.complete(key, ctx, self.layer_now, self.predicted)
        else:
            self.caches[link - 1].complete(key, ctx)
        ctx.prefetch = False
        if link == 1 and self.split is not None and key // self.J <= self.layer_now and key not in self.pinned:
            self.split.consume(key)  # its layer was routed without it: the buffer serves the layer ahead
        if link == 1 or load.stale:
            self._forget(load)
            return
        load.at = link - 1
        if load.demand:
            self.queues[load.at].demand(key, self._wire_bytes(load.at, key))
        else:
            self.queues[load.at].propose(key, load.priority, self._wire_bytes(load.at, key))

    def _wire_bytes(self, link: int, key: int) -> int:
        """Bytes a transfer of ``key`` carries on ``link``: into a split GPU, what it lacks of the expert."""
        return self.split.transfer_bytes(key) if link == 1 and self.split is not None else self.E

    def _forget(self, load: _Load) -> None:
        del self.loads[load.key]
        self.prefetch_loads_of_layer[load.key // self.J].discard(load.key)

    def _route_from_nearest(self, load: _Load) -> None:
        """Queue ``load`` on the link out of the nearest tier holding its expert."""
        load.at = self._nearest_holder(load.key)
        nbytes = self._wire_bytes(load.at, load.key)
        if load.demand:
            self.queues[load.at].demand(load.key, nbytes)
            self._announce(load)
        else:
            self.queues[load.at].propose(load.key, load.priority, nbytes)

    def _announce(self, load: _Load) -> None:
        """Tell the links further on a demand load's route when it can arrive there at the earliest: on the
        wire, when that transfer ends; waiting, after a whole transfer from now."""
        queue = self.queues[load.at]
        if queue.on_wire is not None and queue.on_wire.key == load.key:
            arrival = queue.on_wire.end_s
        else:
            arrival = self.now + queue.link.transfer_seconds(self.E)
        for link in range(load.at - 1, 0, -1):
            self.queues[link].announce_demand(load.key, arrival)
            arrival += self.queues[link].link.transfer_seconds(self.E)

    def demand(self, key: int, load: _Load | None) -> None:
        if load is None:
            self._route_from_nearest(self.loads.setdefault(key, _Load(key, True, math.inf, 0, self.now)))
            return
        self.prefetch_loads_of_layer[key // self.J].discard(key)
        load.demand, load.stale = True, False
        queue = self.queues[load.at]
        if queue.on_wire is None or queue.on_wire.key != key:
            queue.demand(key, self._wire_bytes(load.at, key))
        self._announce(load)

    def propose(self, proposals) -> None:
        layer_now, J, fast, loads = self.layer_now, self.J, self.fast, self.loads
        for key, priority in proposals:
            if key // J <= layer_now:
                continue
            if key in fast:  # predicted and resident: no prefetch for a later layer may evict it (cache.py)
                self.predicted.add(key)
                continue
            load = loads.get(key)
            if load is None:
                self.prefetch_loads_of_layer[key // J].add(key)
                self._route_from_nearest(loads.setdefault(key, _Load(key, False, priority, 0, self.now)))
            elif not load.demand:
                load.priority, load.stale = priority, False
                self.queues[load.at].propose(key, priority, self._wire_bytes(load.at, key))
        self.kick()

    def drop_prefetches_of(self, layer: int) -> None:
        """Layer ``layer`` is routed: its waiting prefetches can no longer help this iteration, and the
        prefetched experts it did not need are no longer held (those it needs were used by ``touch``)."""
        for key in list(self.prefetch_loads_of_layer[layer]):
            load = self.loads[key]
            if self.queues[load.at].withdraw(key):
                self._forget(load)
            else:
                load.stale = True
        fast, J = self.fast, self.J
        for key in [key for key in fast.held if key // J == layer]:
            fast.release(key)
        self.predicted = {key for key in self.predicted if key // J != layer}

    def withdraw_prefetches(self) -> None:
        """Drop every waiting prefetch (one on a wire completes and stops where it lands)."""
        for load in [load for load in self.loads.values() if not load.demand]:
            if self.queues[load.at].withdraw(load.key):
                self._forget(load)
            else:
                load.stale = True

    def direct_load_seconds(self, transfers: int, nbytes: int) -> float:
        """Time to bring ``transfers`` pieces of ``nbytes`` bytes in all from the home tier to the GPU over every
        link of the way, one link after the other, while nothing else moves (MoEpic's reconfiguration); the
        bytes count on each link."""
        seconds = 0.0
        for queue in self.queues.values():
            link = queue.link
            seconds += transfers * link.latency_s + nbytes / link.bandwidth_bytes_per_s
            queue.bytes_moved += nbytes
        return seconds
