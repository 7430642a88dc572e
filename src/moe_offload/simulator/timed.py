"""The timed simulator: what latency a user sees for a trace, a hardware profile, a policy and a prefetcher.

Model (discrete events over virtual time, no threads)
-----------------------------------------------------
One compute stream (the GPU) runs the iterations one after another. An iteration runs layers 0..L-1;
each layer runs its attention, then its router, whose output makes the layer's *needed* experts known:
the union of the experts its tokens selected, each with the number of tokens routed to it (a prefill
iteration routes all prompt tokens at once, a decode iteration one token per request, a batch several
requests). Then each needed expert runs, as soon as it is resident in the fast tier (tier 0, the GPU),
for ``compute.expert_seconds(tokens routed to it)``; experts already resident run first, the others as
they arrive, and while no needed expert is resident the stream stalls (``per_layer_stall_seconds``).
After the last layer the LM head runs and the iteration's tokens are done. Costs come from the
hardware profile (moe_offload.hardware).

The prefetcher is called as prefetch/base.py says: ``on_iteration_start`` before layer 0,
``on_layer_routed`` right after each router, ``on_iteration_end`` after the LM head. Its proposals go to
the transfer queues (simulator/transfers.py), which order them; proposals for layers already routed in
this iteration are ignored, and when a layer is routed its waiting prefetches are dropped (the needed
ones become demand loads). A prefetcher that searches a history (``search_latency``) is charged: on the
compute stream when the search is on the inference path (MoE-Infinity), otherwise on its own matcher
timeline, its proposals reaching the queues only when the search is done (fMoE's asynchronous matcher).

Tiers and transfers. Experts start in the *home* tier: the fastest tier after the GPU that holds all of
them (the model is loaded there; slower tiers are not used). Tiers between the GPU and the home are
caches that start empty, like the GPU. A miss in the GPU is served from the nearest tier that holds the
expert, hop by hop (SSD -> host -> GPU, MoE-Infinity's pipeline: each hop queues on its own link, so
hops of different experts overlap). Each link carries one transfer at a time, ``latency + bytes /
bandwidth``, in the order the link's TransferQueue decides (simulator/transfers.py: demand loads first,
prefetches by priority and held back while a demand load is on its way to the link). Room is made in
the destination when a transfer starts (``ExpertCache.reserve``) and the expert becomes resident when it
arrives (``complete``). A middle tier keeps its copy (it is a cache of the slower tiers) and sees the
GPU's misses as its accesses. Counted as prefetches issued are the prefetch transfers into the GPU; one
is used when its expert is requested while on that wire or resident, before being evicted.

Pinning. The experts the current layer still has to compute are pinned in the GPU: no transfer, prefetch
or demand, may evict them. An expert is unpinned once it has run, so a layer needing more experts than
the cache holds (a long prefill) still makes progress. In a middle tier the experts being read out of it
or waiting to be read are pinned, except that a demand load may evict the copy of a waiting prefetch
(which is then dropped).

How AccessContext maps onto the timed model (the replay fills the same fields, see policies/base.py):

    clock       the position of the access in the *timed access order*: iteration by iteration, layer by
                layer, the layer's needed experts in order of first appearance over the iteration's tokens
                (row order, then router rank). Between accesses (a transfer starting or landing later)
                it stays at the latest access.
    layer       the layer being computed.
    token, iteration
                the number of the simulated iteration (0, 1, ...): a time step is one forward pass,
                because all tokens of a batch or prefill are routed together. With one token per
                iteration, starting at iteration 0, this is the trace row, as in the replay.
    request     the request of the iteration's first token.
    probs       the mean router distribution of the iteration's tokens, [L, J], when the trace has probs.
    predicted   ``prefetcher.predicted_map()`` after its latest hook call (None without a prefetcher).
    next_use    offline policies: the clock of the key's next access in the timed access order. Refused
                when serving arrivals (poisson, times), where that order depends on the timing itself.
    pinned      as above.   prefetch   True while a prefetched expert lands.

With one token per iteration, top-1 routing, no prefetcher and zero compute, the timed access order is
the replay's (trace/flatten.py: token, rank, layer) and every policy makes exactly the replay's misses
(tests/test_timed.py checks it). With top-k > 1 the orders differ by design: the replay serves paper
001's rounds (rank-major), the timed simulator the physical order (layer-major).

Split experts (``split``, MoEpic, paper 004). The GPU is then not one cache of whole experts but, per layer,
a cache of top segments and a buffer for the missing segments (simulator/split.py): a transfer into the
GPU carries what the expert lacks there (its bottom segment when its top is cached, else all of it),
resident means complete, and an expert computes the top segment's share of its time as soon as its top is
in VRAM, the rest once it is complete. Everything else (queues, pinning, prefetchers, counters) is the
same run; a hit is an expert complete when its layer is routed.

Requests and latency. With ``Arrivals("trace")`` the trace's iterations run as recorded, each request
arriving when its first iteration starts; with ``Arrivals("poisson", rate)`` (a seeded Poisson process) or
``Arrivals("times", times=...)`` (replayed timestamps) requests are served FIFO with continuous batching
(``max_batch``). A request's first token
is done at the end of its first iteration: TTFT = that time - arrival; TPOT = (last token - first token)
/ (tokens - 1).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.hardware.profile import HardwareProfile, format_bytes
from moe_offload.policies import AccessContext, ModelSpec, policy_info
from moe_offload.prefetch import (Prefetcher, RoutingView, check_trace_columns, make_prefetcher, prefetcher_info,
                                  search_latency)
from moe_offload.reporting.results import RunResult
from moe_offload.simulator.cache import ExpertCache, PartitionedCache
from moe_offload.simulator.replay import check_cache_size
from moe_offload.simulator.split import SplitConfig, SplitExperts
from moe_offload.simulator.transfers import TransferQueue
from moe_offload.trace.flatten import NEVER, next_use_times
from moe_offload.trace.format import PREFILL, Trace

ALL_RESIDENT = "all-resident"
ORACLE = "oracle"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Arrivals:
    """How requests reach the server.

    ``trace``: the trace's iterations as recorded (batches as recorded), each request arriving when its
    first iteration starts. ``poisson``: ``rate`` requests per second, exponential gaps from ``seed``.
    ``times``: the i-th request of the trace (in order of first appearance) arrives at ``times[i]`` seconds
    (replayed timestamps). With ``poisson`` and ``times`` requests wait in FIFO order and are served with
    continuous batching of at most ``max_batch``."""

    kind: str = "trace"
    rate: float | None = None
    times: tuple[float, ...] = ()
    max_batch: int = 8
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("trace", "poisson", "times"):
            raise ConfigError(f"arrivals {self.kind!r}: choose trace, poisson:RATE or times:T0,T1,...")
        if self.kind == "poisson" and not (self.rate is not None and self.rate > 0 and math.isfinite(self.rate)):
            raise ConfigError(f"poisson arrivals need a positive rate (requests per second), not {self.rate!r}")
        if self.kind == "times" and (not self.times or any(t < 0 or not math.isfinite(t) for t in self.times)
                                     or any(b < a for a, b in zip(self.times, self.times[1:]))):
            raise ConfigError(f"arrival times must be finite, at least 0 and in order, not {list(self.times)}")
        if self.max_batch < 1:
            raise ConfigError(f"the batch size must be at least 1, not {self.max_batch}")

    @classmethod
    def parse(cls, text: str, max_batch: int = 8, seed: int = 0) -> "Arrivals":
        """``trace``, ``poisson:RATE`` or ``times:T0,T1,...``."""
        kind, _, value = text.partition(":")
        try:
            if kind == "poisson":
                return cls("poisson", rate=float(value), max_batch=max_batch, seed=seed)
            if kind == "times":
                return cls("times", times=tuple(float(t) for t in value.split(",")), max_batch=max_batch)
        except ValueError:
            raise ConfigError(f"arrivals {text!r}: write poisson:RATE (requests per second) or times:T0,T1,... "
                              "(seconds)") from None
        if value:
            raise ConfigError(f"arrivals {text!r}: choose trace, poisson:RATE or times:T0,T1,...")
        return cls(kind, max_batch=max_batch, seed=seed)

    def arrival_times(self, requests: int) -> list[float]:
        """When each of ``requests`` requests arrives (``poisson`` and ``times``)."""
        if self.kind == "poisson":
            return np.cumsum(np.random.default_rng(self.seed).exponential(1.0 / self.rate, requests)).tolist()
        if len(self.times) < requests:
            raise ConfigError(f"{len(self.times)} arrival times for a trace of {requests} requests")
        return list(self.times[:requests])

    def describe(self) -> str:
        if self.kind == "trace":
            return "the trace's iterations as recorded"
        how = (f"Poisson arrivals, {self.rate:g} requests/s (seed {self.seed})" if self.kind == "poisson"
               else "replayed arrival times")
        return f"{how}, batches of up to {self.max_batch}"


def request_steps(trace: Trace) -> tuple[list[int], list[list[np.ndarray]]]:
    """Request ids in order of first appearance, and for each its steps: its rows grouped by iteration
    (the first step is the prefill when the request has one)."""
    order = np.argsort(trace.request, kind="stable")
    ids_sorted = trace.request[order]
    cuts = np.flatnonzero(np.diff(ids_sorted)) + 1
    groups = np.split(order, cuts)
    groups.sort(key=lambda rows: int(rows[0]))
    ids, steps = [], []
    for rows in groups:
        ids.append(int(trace.request[rows[0]]))
        steps.append(np.split(rows, np.flatnonzero(np.diff(trace.iteration[rows])) + 1))
    return ids, steps


def trace_iterations(trace: Trace) -> list[np.ndarray]:
    """The rows of each of the trace's iterations, in order."""
    return np.split(np.arange(trace.num_tokens), np.flatnonzero(np.diff(trace.iteration)) + 1)


class _TraceOrder:
    """The trace's own iterations, one after another."""

    def __init__(self, trace: Trace):
        self._iterations = deque(trace_iterations(trace))

    def next_batch(self, now: float):
        """(start time, rows) of the next iteration, or None when the trace is done."""
        return (now, self._iterations.popleft()) if self._iterations else None

    def arrival(self, request: int, start: float) -> float:
        return start

    def batch_done(self) -> None:
        """Nothing to update: the next iteration is the trace's next."""


class _Serving:
    """Requests arriving at given times, a FIFO queue and continuous batching: each iteration runs the next
    step of every admitted request (a new one's first step is its prefill); a request leaves after its last
    step and the next waiting one is admitted."""

    def __init__(self, trace: Trace, arrivals: Arrivals):
        ids, self._steps = request_steps(trace)
        self._arrival = dict(zip(ids, arrivals.arrival_times(len(ids))))
        self._ids = ids
        self._waiting = deque(range(len(ids)))
        self._active: list[list[int]] = []  # [request index, next step]
        self._max_batch = arrivals.max_batch

    def next_batch(self, now: float):
        if not self._active and not self._waiting:
            return None
        start = now if self._active else max(now, self._arrival[self._ids[self._waiting[0]]])
        while self._waiting and len(self._active) < self._max_batch \
                and self._arrival[self._ids[self._waiting[0]]] <= start:
            self._active.append([self._waiting.popleft(), 0])
        return start, np.concatenate([self._steps[index][step] for index, step in self._active])

    def arrival(self, request: int, start: float) -> float:
        return self._arrival[request]

    def batch_done(self) -> None:
        for entry in self._active:
            entry[1] += 1
        self._active = [entry for entry in self._active if entry[1] < len(self._steps[entry[0]])]


def _schedule(trace: Trace, arrivals: Arrivals):
    return _TraceOrder(trace) if arrivals.kind == "trace" else _Serving(trace, arrivals)


def layer_needs(experts: np.ndarray, rows: np.ndarray, layer: int, num_experts: int) -> tuple[list[int], list[int]]:
    """The keys layer ``layer`` needs for ``rows`` in access order (first appearance over the rows' [tokens,
    K] selections, row-major) and the number of tokens routed to each."""
    selected = experts[rows, layer]
    if selected.shape[0] == 1:
        ids = selected[0].astype(np.int64)
        return (ids + layer * num_experts).tolist(), [1] * ids.size
    flat = selected.reshape(-1).astype(np.int64)
    unique, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(first)
    return (unique[order] + layer * num_experts).tolist(), counts[order].tolist()


def routed_by_request(experts: np.ndarray, requests: np.ndarray, rows: np.ndarray, layer: int,
                      num_experts: int) -> dict[int, dict[int, int]]:
    """For each key layer ``layer`` needs for ``rows``: the tokens routed to it, by request
    (``AccessContext.routed``)."""
    selected = experts[rows, layer].astype(np.int64)
    if selected.shape[0] == 1:
        request = int(requests[rows[0]])
        return {int(e) + layer * num_experts: {request: 1} for e in selected[0]}
    keys = selected.reshape(-1) + layer * num_experts
    owners = np.repeat(requests[rows].astype(np.int64), selected.shape[1])
    pairs, counts = np.unique(np.stack([keys, owners]), axis=1, return_counts=True)
    routed: dict[int, dict[int, int]] = {}
    for key, request, count in zip(pairs[0].tolist(), pairs[1].tolist(), counts.tolist()):
        routed.setdefault(key, {})[request] = count
    return routed


def latency_summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}


class _Load:
    """One expert's way to the GPU: the tier it is at (``at``, the source of its next hop), whether a demand
    is waiting for it, its prefetch priority, and ``stale`` once its layer was routed while it was on an
    upstream wire (it then stops in the middle tier it reaches)."""

    __slots__ = ("key", "demand", "priority", "at", "stale")

    def __init__(self, key: int, demand: bool, priority: float, at: int):
        self.key, self.demand, self.priority, self.at, self.stale = key, demand, priority, at, False


class _TimedRun:
    def __init__(self, trace: Trace, hardware: HardwareProfile, policy: str, cache_bytes: int, expert_bytes: int,
                 prefetcher: Prefetcher | None, arrivals: Arrivals, seed: int, policy_options: dict | None,
                 all_resident: bool, split: SplitConfig | None = None):
        meta = trace.meta
        self.trace, self.hardware, self.arrivals = trace, hardware, arrivals
        self.spec = spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
        self.L, self.J, self.E = spec.num_layers, spec.num_experts, expert_bytes
        self.prefetcher = prefetcher
        self.compute = hardware.compute
        info = policy_info(policy)
        self.offline = info.offline and not all_resident
        make = lambda: info.policy(spec, seed=seed, **(policy_options or {}))  # noqa: E731

        def cache(capacity):
            if info.partitioned:
                return PartitionedCache(capacity, self.L, make, self.J, slot_size=expert_bytes)
            return ExpertCache(capacity, make())

        total = self.L * self.J * expert_bytes
        self.ctx = ctx = AccessContext()
        self.pinned: set = set()
        ctx.pinned = self.pinned
        self.split: SplitExperts | None = None  # the GPU tier of a split run
        if all_resident:
            self.fast = ExpertCache(total, make())
            for key in range(self.L * self.J):
                self.fast.reserve(key, ctx, expert_bytes)
                self.fast.complete(key, ctx)
        elif split is not None:
            self.fast = self.split = SplitExperts(split, self.J, spec.top_k, expert_bytes, make)
        else:
            self.fast = cache(cache_bytes)
        # The home tier holds every expert from the start; the tiers between it and the GPU are caches.
        # every expert in the GPU (all-resident, no home found): no other tier and no link is used
        self.home = home_tier(hardware, total) or 0
        self.caches: list = [self.fast] + [cache(tier.capacity_bytes) for tier in hardware.tiers[1:self.home]]
        self.queues = {i: TransferQueue(hardware.link_from(i), self.caches[i - 1]) for i in range(1, self.home + 1)}
        self.loads: dict[int, _Load] = {}
        self.prefetch_loads_of_layer = [set() for _ in range(self.L)]
        self.pending_use: set = set()  # prefetched into the GPU, not requested since
        self.deliveries: list = []     # (time, order, iteration, proposals) of the asynchronous matcher
        self.delivery_order = itertools.count()
        self.matcher_free = 0.0
        self.events: list = []         # (lane, kind, start, end, layer, key)
        self.now = 0.0
        self.clock = -1
        self.iteration = 0
        self.layer_now = -1
        # counters
        self.accesses = self.hits = self.on_demand = self.issued = self.used = 0
        self.per_layer_accesses = [0] * self.L
        self.per_layer_hits = [0] * self.L
        self.per_layer_stall = [0.0] * self.L
        self.search_seconds = 0.0
        self.schedule = _schedule(trace, arrivals)
        if self.offline:
            self._plan_next_uses()

    # ------------------------------------------------------------------------------------------ the future

    def _plan_next_uses(self) -> None:
        """The timed access order of the whole run (fixed with the trace's order) and each key's positions."""
        keys = []
        for rows in trace_iterations(self.trace):
            for layer in range(self.L):
                keys += layer_needs(self.trace.experts, rows, layer, self.J)[0]
        keys = np.asarray(keys, dtype=np.int64)
        self.next_use_at = next_use_times(keys).tolist()
        order = np.argsort(keys, kind="stable")
        cuts = np.flatnonzero(np.diff(keys[order])) + 1
        self.positions = {int(keys[group[0]]): group.tolist() for group in np.split(order, cuts)}

    def _next_use_after(self, key: int) -> int:
        positions = self.positions.get(key, ())
        i = bisect.bisect_right(positions, self.clock)
        return positions[i] if i < len(positions) else NEVER

    # ------------------------------------------------------------------------------------------ events

    def _next_event_time(self) -> float:
        best = math.inf
        for queue in self.queues.values():
            if queue.on_wire is not None and queue.on_wire.end_s < best:
                best = queue.on_wire.end_s
        if self.deliveries and self.deliveries[0][0] < best:
            best = self.deliveries[0][0]
        return best

    def _process_next_event(self) -> None:
        """The earliest transfer arrival (links in tier order on ties) or matcher delivery, then new starts."""
        best, link = math.inf, None
        for i, queue in self.queues.items():
            if queue.on_wire is not None and queue.on_wire.end_s < best:
                best, link = queue.on_wire.end_s, i
        if link is not None and not (self.deliveries and self.deliveries[0][0] < best):
            self.now = best
            self._arrive(link)
        else:
            self.now, _, iteration, proposals = heapq.heappop(self.deliveries)
            if iteration == self.iteration:  # a search for an iteration already over has nothing to offer
                self._propose(proposals)
        self._kick()

    def _advance_to(self, t: float) -> None:
        while self._next_event_time() <= t:
            self._process_next_event()
        self.now = t

    def _compute(self, seconds: float, kind: str, layer: int, key: int = -1) -> None:
        start = self.now
        self._advance_to(start + seconds)
        self.events.append(("compute", kind, start, self.now, layer, key))

    # ------------------------------------------------------------------------------------------ transfers

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

    def _kick(self) -> None:
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
                    room = self.caches[i - 1].reserve(key, ctx, transfer.nbytes)
                    ctx.pinned, ctx.prefetch = self.pinned, False
                    if not room:  # the destination is full of pinned or incoming experts: wait for an event
                        break
                    queue.start(self.now)
                    moved = True
                    if load.demand and i > 1:  # its arrival downstream is now known exactly
                        self._announce(load)
                    if i == 1 and not transfer.demand:
                        self.issued += 1
                        self.pending_use.add(key)
                    self.events.append((queue.link.name, "demand" if transfer.demand else "prefetch",
                                        transfer.start_s, transfer.end_s, key // self.J, key))

    def _arrive(self, link: int) -> None:
        """The transfer on ``link`` has arrived in tier ``link - 1``."""
        transfer = self.queues[link].finish()
        key = transfer.key
        load = self.loads[key]
        ctx = self.ctx
        ctx.prefetch = not load.demand
        if self.offline:
            ctx.next_use = self._next_use_after(key)
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

    def _demand(self, key: int, load: _Load | None) -> None:
        if load is None:
            self._route_from_nearest(self.loads.setdefault(key, _Load(key, True, math.inf, 0)))
            return
        self.prefetch_loads_of_layer[key // self.J].discard(key)
        load.demand, load.stale = True, False
        queue = self.queues[load.at]
        if queue.on_wire is None or queue.on_wire.key != key:
            queue.demand(key, self._wire_bytes(load.at, key))
        self._announce(load)

    def _propose(self, proposals) -> None:
        layer_now, J, fast, loads = self.layer_now, self.J, self.fast, self.loads
        for key, priority in proposals:
            if key // J <= layer_now or key in fast:
                continue
            load = loads.get(key)
            if load is None:
                self.prefetch_loads_of_layer[key // J].add(key)
                self._route_from_nearest(loads.setdefault(key, _Load(key, False, priority, 0)))
            elif not load.demand:
                load.priority, load.stale = priority, False
                self.queues[load.at].propose(key, priority, self._wire_bytes(load.at, key))
        self._kick()

    def _drop_prefetches_of(self, layer: int) -> None:
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

    # ------------------------------------------------------------------------------------------ prefetcher

    def _consult(self, hook, view: RoutingView) -> None:
        proposals = hook(view)
        self.ctx.predicted = self.prefetcher.predicted_map()
        seconds, on_inference_path = search_latency(self.prefetcher)
        self.search_seconds += seconds
        if seconds and not on_inference_path:
            done = max(self.now, self.matcher_free) + seconds
            self.events.append(("matcher", "search", max(self.now, self.matcher_free), done, self.layer_now, -1))
            self.matcher_free = done
            heapq.heappush(self.deliveries, (done, next(self.delivery_order), self.iteration, proposals))
            return
        if seconds:
            self._compute(seconds, "search", self.layer_now)
        self._propose(proposals)

    # ------------------------------------------------------------------------------------------ the run

    def _route(self, layer: int, keys: list[int], routed: dict[int, dict[int, int]]) -> None:
        """Layer ``layer``'s router has run: its accesses, in order (each with its tokens by request), and the
        demand loads of its misses."""
        ctx, fast = self.ctx, self.fast
        self.pinned.update(keys)
        if self.split is not None:
            self.split.drop_unneeded(layer, set(keys))
        middle = self.caches[1:]
        wire = self.queues[1] if self.queues else None
        for key in keys:
            self.clock += 1
            ctx.clock = self.clock
            if self.offline:
                ctx.next_use = self.next_use_at[self.clock]
            ctx.routed = routed[key]
            hit = fast.touch(key, ctx)
            prefetched = key in self.pending_use
            if prefetched:
                self.pending_use.discard(key)
            if hit:
                self.hits += 1
                self.per_layer_hits[layer] += 1
                self.used += prefetched
                continue
            for tier in middle:
                tier.touch(key, ctx)
            load = self.loads.get(key)
            if load is not None and not load.demand and wire.on_wire is not None and wire.on_wire.key == key:
                self.used += prefetched  # a late prefetch, already on its last wire
                continue
            self.on_demand += 1
            self._demand(key, load)
        self.accesses += len(keys)
        self.per_layer_accesses[layer] += len(keys)
        self._drop_prefetches_of(layer)
        self._kick()

    def _part_ready(self, key: int, top_done: bool) -> bool:
        """Whether the next part of expert ``key`` can run: all of it once resident; split, its top share
        once it has its top, the rest once it is complete."""
        if self.split is None or top_done or key in self.fast:
            return key in self.fast
        return self.split.has_top(key)

    def _run_experts(self, layer: int, keys: list[int], counts: list[int]) -> None:
        remaining = [[key, tokens, False] for key, tokens in zip(keys, counts)]  # [key, tokens, top share run]
        expert_seconds, E, split = self.compute.expert_seconds, self.E, self.split
        theta = split.ratio[layer] if split is not None else 1.0
        while remaining:
            ready = next((i for i, (key, _, top_done) in enumerate(remaining) if self._part_ready(key, top_done)),
                         None)
            if ready is None:
                start = self.now
                while not any(self._part_ready(key, top_done) for key, _, top_done in remaining):
                    if self._next_event_time() == math.inf:
                        raise RuntimeError(f"no transfer can bring the experts layer {layer} waits for "
                                           f"{[k for k, _, _ in remaining]}")
                    self._process_next_event()
                self.per_layer_stall[layer] += self.now - start
                self.events.append(("stall", "stall", start, self.now, layer, -1))
                continue
            key, tokens, top_done = remaining[ready]
            seconds = expert_seconds(tokens, E)
            if theta < 1 and not top_done:  # the top segment's share; the bottom's may still be on the wire
                self._compute(theta * seconds, "expert", layer, key)
                remaining[ready][2] = True
                continue
            remaining.pop(ready)
            self._compute((1 - theta) * seconds if top_done else seconds, "expert", layer, key)
            self.pinned.discard(key)
            if split is not None:
                split.consume(key)
            self._kick()

    def run(self) -> dict:
        trace, ctx, compute, L, J = self.trace, self.ctx, self.compute, self.L, self.J
        arrival: dict[int, float] = {}
        token_times: dict[int, list[float]] = {}
        spans = []  # (start, end, is_decode) of every iteration
        while True:
            batch = self.schedule.next_batch(self.now)
            if batch is None:
                break
            start, rows = batch
            if start > self.now:
                self._advance_to(start)
            requests = [int(r) for r in dict.fromkeys(trace.request[rows].tolist())]
            for request in requests:
                if request not in arrival:
                    arrival[request] = self.schedule.arrival(request, start)
                    token_times[request] = []
            n = len(rows)
            ctx.iteration = ctx.token = self.iteration
            ctx.request = requests[0]
            if trace.probs is not None:
                ctx.probs = trace.probs[rows].astype(np.float32).mean(axis=0)
            view = RoutingView(trace, self.iteration, rows)
            self.layer_now = -1
            if self.prefetcher is not None:
                self._consult(self.prefetcher.on_iteration_start, view)
            for layer in range(L):
                ctx.layer = layer
                self._compute(compute.attention(n), "attention", layer)
                self._compute(compute.router(n), "router", layer)
                keys, counts = layer_needs(trace.experts, rows, layer, J)
                self.layer_now = view.layer_now = layer
                self._route(layer, keys, routed_by_request(trace.experts, trace.request, rows, layer, J))
                if self.prefetcher is not None:
                    self._consult(self.prefetcher.on_layer_routed, view)
                self._run_experts(layer, keys, counts)
            self._compute(compute.lm_head(n), "lm_head", -1)
            for request in requests:
                token_times[request].append(self.now)
            spans.append((start, self.now, not (trace.phase[rows] == PREFILL).any()))
            if self.prefetcher is not None:
                self.prefetcher.on_iteration_end(view)
                seconds, on_inference_path = search_latency(self.prefetcher)
                self.search_seconds += seconds
                if seconds and on_inference_path:
                    self._compute(seconds, "search", -1)
                elif seconds:
                    self.matcher_free = max(self.now, self.matcher_free) + seconds
            self.schedule.batch_done()
            self.iteration += 1
        return {"arrival": arrival, "token_times": token_times, "spans": spans}

    def timeline(self, spans, iteration: int | None) -> dict:
        """The events of one iteration (default: the decode iteration of median duration), in seconds from
        its start: lanes compute, stall, matcher and one per link."""
        if iteration is None:
            candidates = [i for i, span in enumerate(spans) if span[2]] or list(range(len(spans)))
            durations = [spans[i][1] - spans[i][0] for i in candidates]
            iteration = candidates[int(np.argsort(durations, kind="stable")[len(durations) // 2])]
        if not 0 <= iteration < len(spans):
            raise ConfigError(f"timeline iteration {iteration} does not exist: the run has {len(spans)} "
                              "iterations (0-based)")
        start, end, _ = spans[iteration]
        events = [{"lane": lane, "kind": kind, "start_s": s - start, "end_s": e - start, "layer": layer,
                   "expert": key}
                  for lane, kind, s, e, layer, key in self.events if (e > start and s < end) or s == e == start]
        lanes = ["compute", "stall"] + [q.link.name for q in self.queues.values()]
        if any(event[0] == "matcher" for event in self.events):
            lanes.append("matcher")
        return {"iteration": iteration, "duration_s": end - start, "lanes": lanes, "events": events}


def home_tier(hardware: HardwareProfile, expert_bytes_in_all: int) -> int | None:
    """The index of the fastest tier after the GPU that holds every expert, or None."""
    return next((i for i, tier in enumerate(hardware.tiers) if i > 0 and tier.capacity_bytes >= expert_bytes_in_all),
                None)


def check_timed_run(trace: Trace, hardware: HardwareProfile, policy: str, cache_bytes: int | None,
                    expert_bytes: int, arrivals: Arrivals, split: SplitConfig | None = None,
                    split_source: str = "the split configuration") -> None:
    """Raise ConfigError when this run cannot be made: a cache that holds no expert, exceeds the GPU or
    is below what the policy needs (with ``split``, a split configuration the model or the GPU cannot run,
    named ``split_source`` in the message; ``cache_bytes`` is then unused); experts with no tier to live
    in; a middle tier too small for one expert; an offline policy with serving arrivals."""
    meta = trace.meta
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    total = meta.num_expert_slots * expert_bytes
    gpu = hardware.tiers[0]
    if split is not None:
        split.check(meta.num_layers, meta.num_experts, meta.top_k, expert_bytes, f"{hardware.name}'s {gpu.name}",
                    gpu.capacity_bytes, split_source)
    else:
        if cache_bytes is None or cache_bytes < expert_bytes:
            raise ConfigError(f"a GPU expert cache of {cache_bytes} bytes cannot hold one expert of {expert_bytes}")
        if cache_bytes > gpu.capacity_bytes:
            raise ConfigError(f"a cache of {format_bytes(cache_bytes)} does not fit in the "
                              f"{format_bytes(gpu.capacity_bytes)} of {hardware.name}'s {gpu.name}")
        check_cache_size(policy, min(cache_bytes, total) // expert_bytes, spec)
    home = home_tier(hardware, total)
    if home is None:
        raise ConfigError(f"hardware {hardware.name}: no tier after {gpu.name} holds all {meta.num_expert_slots} "
                          f"experts ({format_bytes(total)}), so they have nowhere to live")
    for tier in hardware.tiers[1:home]:
        if tier.capacity_bytes < expert_bytes:
            raise ConfigError(f"hardware {hardware.name}: tier {tier.name} ({format_bytes(tier.capacity_bytes)}) "
                              f"cannot hold one expert of {format_bytes(expert_bytes)}")
    if policy_info(policy).offline and arrivals.kind != "trace":
        raise ConfigError(f"{policy} is offline: it needs the future access order, which a serving run decides "
                          "while it runs (batches depend on timing); use it with --arrivals trace")


def simulate_timed(trace: Trace, hardware: HardwareProfile, policy: str = "lru", cache_bytes: int | None = None, *,
                   expert_bytes: int | None = None, prefetcher: str | Prefetcher | None = None,
                   prefetcher_options: dict | None = None, history: Trace | None = None,
                   arrivals: Arrivals = Arrivals(), seed: int = 0, policy_options: dict | None = None,
                   timeline_iteration: int | None = None, name: str | None = None,
                   all_resident: bool = False, split: SplitConfig | None = None) -> RunResult:
    """Run ``trace`` on ``hardware`` with ``policy`` on a GPU expert cache of ``cache_bytes`` and an optional
    prefetcher (a registry name, or an instance); ``all_resident`` runs the bound with every expert in the
    GPU from the start (no transfers; ``policy``, ``cache_bytes``, ``prefetcher`` and ``split`` are ignored).
    With ``split`` (MoEpic's split experts, simulator/split.py) the GPU holds per-layer caches of top
    segments and buffers instead of a cache of ``cache_bytes``, which is then ignored."""
    meta = trace.meta
    expert_bytes = expert_bytes or meta.expert_bytes
    if not expert_bytes:
        raise ConfigError(f"{trace.path}: the trace's metadata gives no expert size; give it (--expert-bytes)")
    spec = ModelSpec(meta.num_layers, meta.num_experts, meta.top_k)
    total = meta.num_expert_slots * expert_bytes
    notes = []
    if all_resident:  # the policy never has to choose: any will do
        policy, policy_options, cache_bytes, prefetcher, split = "lru", None, total, None, None
    else:
        check_timed_run(trace, hardware, policy, cache_bytes, expert_bytes, arrivals, split)
        if split is not None:
            cache_bytes = split.cache_bytes(expert_bytes)
            notes.append(f"split experts: layer i caches the top segments (theta_i of an expert) of C_i experts, "
                         f"{format_bytes(cache_bytes)} in all, and buffers up to {meta.top_k} experts' missing "
                         "segments")
        if policy_info(policy).policy.needs_probs and trace.probs is None:
            notes.append(f"{policy}: the trace has no router probabilities, so p comes from the prefetcher's map "
                         "when it has one, else is uniform (fmoe then ranks like LFU)")
    instance = None
    if isinstance(prefetcher, str):
        check_trace_columns(prefetcher_info(prefetcher), trace)
        instance = make_prefetcher(prefetcher, spec, prefetcher_options)
        if history is not None:
            instance.fit(history)
    elif prefetcher is not None:
        check_trace_columns(type(prefetcher), trace)
        instance = prefetcher
    sim = _TimedRun(trace, hardware, policy, cache_bytes, expert_bytes, instance, arrivals, seed, policy_options,
                    all_resident, split)
    if sim.home > 1 and not all_resident:
        notes.append(f"{hardware.name}: the experts live in {hardware.tiers[sim.home].name}; "
                     + ", ".join(f"{t.name} caches {format_bytes(t.capacity_bytes)}"
                                 for t in hardware.tiers[1:sim.home]))
    outcome = sim.run()
    if sim.search_seconds:
        where = "on the inference path" if search_latency(instance)[1] else "on its own matcher timeline"
        notes.append(f"{instance.name}: {sim.search_seconds * 1e3:.1f} ms of history search in all, charged {where}")
    arrival, token_times = outcome["arrival"], outcome["token_times"]
    ttft = [token_times[r][0] - arrival[r] for r in arrival]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    gaps = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    misses = sim.accesses - sim.hits
    return RunResult(
        trace=name or trace.path, policy=ALL_RESIDENT if all_resident else policy,
        cache_size=(sum(plan.cached_experts for plan in split.layers) if split is not None
                    else min(cache_bytes, total) // expert_bytes), accesses=sim.accesses, hits=sim.hits, misses=misses,
        per_layer_accesses=sim.per_layer_accesses, per_layer_hits=sim.per_layer_hits,
        bytes_loaded=sim.queues[1].bytes_moved if sim.queues else 0,
        prefetches_issued=sim.issued if instance is not None else None,
        prefetches_used=sim.used if instance is not None else None,
        prefetches_wasted=sim.issued - sim.used if instance is not None else None,
        stall_seconds=sum(sim.per_layer_stall), ttft_seconds=float(np.mean(ttft)),
        tpot_seconds=float(np.mean(tpot)) if tpot else None,
        prefetcher=instance.name if instance is not None else None, hardware=hardware.name, cache_bytes=cache_bytes,
        on_demand_loads=sim.on_demand, prefetch_search_seconds=sim.search_seconds if instance is not None else None,
        per_layer_stall_seconds=sim.per_layer_stall,
        bytes_per_link={q.link.name: q.bytes_moved for q in sim.queues.values()},
        ttft_percentiles=latency_summary(ttft), tpot_percentiles=latency_summary(tpot),
        request_ttft_seconds=ttft, request_tpot_seconds=tpot, token_latency_seconds=gaps,
        total_seconds=max(t[-1] for t in token_times.values()) - min(arrival.values()),
        timeline=sim.timeline(outcome["spans"], timeline_iteration), notes=notes)


_GRID: tuple | None = None  # (trace, hardware, history) of the worker processes, set once per process


def _init_worker(trace: Trace, hardware: HardwareProfile, history: Trace | None) -> None:
    global _GRID
    _GRID = (trace, hardware, history)


def _run_task(task: dict) -> RunResult:
    trace, hardware, history = _GRID
    return simulate_timed(trace, hardware, history=history, **task)


def timed_grid(trace: Trace, hardware: HardwareProfile, policies: list[str], prefetchers: list[str | None],
               cache_sizes: list[int], *, expert_bytes: int | None = None, arrivals: Arrivals = Arrivals(),
               seed: int = 0, policy_options: dict[str, dict] | None = None,
               prefetcher_options: dict[str, dict] | None = None, history: Trace | None = None,
               timeline_iteration: int | None = None, with_oracle: bool = True, name: str | None = None,
               jobs: int = 1, progress=None, split: SplitConfig | None = None) -> list[RunResult]:
    """Every (policy, prefetcher, cache size in bytes) and the bounds to compare them with: the all-resident
    run (first) and, for every policy and size, the oracle prefetcher (unless asked for anyway). With
    ``split`` every run but the all-resident one runs that split configuration (give one cache size: it is
    unused).

    Runs are independent, so ``jobs`` > 1 spreads them over processes; results do not depend on it.
    ``progress`` is called after each run."""
    shared = dict(expert_bytes=expert_bytes, arrivals=arrivals, seed=seed, timeline_iteration=timeline_iteration,
                  name=name)
    runs = [(policy, prefetcher, size) for size in cache_sizes for policy in policies for prefetcher in prefetchers]
    if with_oracle and ORACLE not in prefetchers:
        runs += [(policy, ORACLE, size) for size in cache_sizes for policy in policies]
    tasks = [dict(all_resident=True, **shared)]
    tasks += [dict(policy=policy, cache_bytes=size, prefetcher=prefetcher, split=split,
                   prefetcher_options=(prefetcher_options or {}).get(prefetcher),
                   policy_options=(policy_options or {}).get(policy), **shared)
              for policy, prefetcher, size in runs]
    if jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker,
                                 initargs=(trace, hardware, history)) as pool:
            results = []
            for result in pool.map(_run_task, tasks):
                results.append(result)
                if progress is not None:
                    progress()
        return results
    _init_worker(trace, hardware, history)
    results = []
    for task in tasks:
        results.append(_run_task(task))
        if progress is not None:
            progress()
    return results
