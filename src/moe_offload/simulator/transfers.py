"""The transfer queue of one link: which expert goes on the wire next.

Prefetchers propose, queues decide. The rules, from papers 000 and 002:

* one transfer on the wire at a time per link (paper 002 section 5.3: one I/O thread per link copies one
  expert at a time, so experts do not compete for bandwidth), and a transfer on the wire always completes;
* on-demand loads go first, in the order they were asked for: a miss "jumps over all prefetching requests
  in the queue" (paper 002, Algorithm 1 step 11);
* no prefetch starts while a demand load waits for the link: paper 000 "pauses all expert prefetching
  tasks and immediately loads missed experts". A demand load still on an upstream link of its route
  (SSD -> host while this link is host -> GPU) is announced with the earliest time it can arrive
  (``announce_demand``); until then only a prefetch that would be off the wire by that time may start, so
  the demand load never finds the link busy with a prefetch started after it was known;
* prefetches go in priority order, highest first, ties in the order of their latest proposal; one entry
  per expert: a new proposal for a queued expert replaces its priority (paper 002: "remove it from the
  queue if it's already present, then re-enqueue it with an updated priority"), and an expert on the wire,
  waiting as a demand load, or already in the destination is never queued again.

The queue is pure logic over virtual time: ``next_transfer(now)`` says what may start at ``now``,
``start(now)`` stamps it with its start and end from the link's latency and bandwidth, and nothing
happens until the driver calls ``finish()``. The timed
simulator drives it with simulated time; a runtime can drive the same queue from its copy thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from moe_offload.hardware.profile import HardwareProfile, Link


def home_tier(hardware: HardwareProfile, expert_bytes_in_all: int) -> int | None:
    """The index of the fastest tier after the GPU that holds every expert, or None: where every expert's route
    to the GPU starts (the timed simulator's tiers and the runtime's fetch-or-compute rule read it here)."""
    return next((i for i, tier in enumerate(hardware.tiers) if i > 0 and tier.capacity_bytes >= expert_bytes_in_all),
                None)


@dataclass
class Transfer:
    key: int
    nbytes: int
    demand: bool
    priority: float            # math.inf for a demand load
    order: int                 # submission order: FIFO among demand loads and among equal priorities
    start_s: float | None = None
    end_s: float | None = None
    event: int = -1            # its entry in the run's timeline events


class TransferQueue:
    """Waiting transfers of one link and the one on its wire.

    ``destination`` is anything that answers ``key in destination`` with whether the link's destination
    already holds ``key`` (the destination tier's cache)."""

    def __init__(self, link: Link, destination):
        self.link = link
        self.destination = destination
        self.on_wire: Transfer | None = None
        self._demands: dict[int, Transfer] = {}    # insertion order is the order of service
        self._prefetches: dict[int, Transfer] = {}
        self._heap: list = []                      # (-priority, order, key); stale when no longer in _prefetches
        self._announced: dict[int, float] = {}     # key -> earliest arrival of an upstream demand load
        self._order = itertools.count()
        self.bytes_moved = 0
        self.transfers_started = 0
        self.slowdown = 1.0  # the wire runs this many times slower now (the link's slowdown_while_computing)

    @property
    def busy(self) -> bool:
        return self.on_wire is not None

    def _excluded(self, key) -> bool:
        return (self.on_wire is not None and self.on_wire.key == key) or key in self.destination

    def demand(self, key: int, nbytes: int) -> bool:
        """Queue an on-demand load behind the demand loads already waiting and before every prefetch.

        A waiting prefetch of ``key`` becomes this demand load. False when nothing was queued: ``key`` is on
        the wire, already waiting as a demand load, or already in the destination."""
        self._announced.pop(key, None)
        if key in self._demands or self._excluded(key):
            return False
        self._prefetches.pop(key, None)  # its heap entry is now stale
        self._demands[key] = Transfer(key, nbytes, True, math.inf, next(self._order))
        return True

    def announce_demand(self, key: int, not_before: float) -> None:
        """A demand load of ``key`` will reach this link once its upstream hops are done, not before
        ``not_before``: until it arrives (``demand``), a prefetch starts here only if it ends by then. A later
        announcement of the same load replaces the bound (it is exact once the load is on the wire)."""
        self._announced[key] = not_before

    def propose(self, key: int, priority: float, nbytes: int) -> bool:
        """Queue a prefetch, or give a waiting one its new priority. False when ``key`` is on the wire, waits
        as a demand load or is already in the destination."""
        if key in self._demands or self._excluded(key):
            return False
        entry = Transfer(key, nbytes, False, priority, next(self._order))
        self._prefetches[key] = entry
        heap = self._heap
        heapq.heappush(heap, (-priority, entry.order, key))
        if len(heap) > 4 * len(self._prefetches) + 64:  # a prefetcher that resubmits at every layer
            heap[:] = self._live_heap_entries()          # leaves stale entries behind: drop them
            heapq.heapify(heap)
        return True

    def withdraw(self, key: int) -> bool:
        """Drop the waiting transfer of ``key`` (a prefetch whose layer has been computed, or a load that must
        come from another tier); False if none waits."""
        return self._prefetches.pop(key, None) is not None or self._demands.pop(key, None) is not None

    @property
    def has_waiting_demands(self) -> bool:
        return bool(self._demands)

    def waiting_demands(self) -> list[int]:
        return list(self._demands)

    def waiting(self) -> set:
        """Keys of every waiting transfer, demand or prefetch."""
        return set(self._demands) | set(self._prefetches)

    def waiting_prefetches(self) -> list[int]:
        """Keys of the waiting prefetches, in the order they would go on the wire."""
        return [key for _, _, key in sorted(self._live_heap_entries())]

    def _live_heap_entries(self):
        return [(p, o, k) for p, o, k in self._heap if k in self._prefetches and self._prefetches[k].order == o]

    def next_transfer(self, now: float) -> Transfer | None:
        """The transfer that may start at ``now``, or None: the wire is busy, nothing waits, or the best
        prefetch would still be on the wire when an announced demand load can arrive. Entries whose key
        reached the destination meanwhile are dropped."""
        if self.on_wire is not None:
            return None
        while self._demands:
            key, transfer = next(iter(self._demands.items()))
            if key not in self.destination:
                return transfer
            del self._demands[key]
        best = self._best_prefetch()
        if best is not None and self._announced \
                and now + self.seconds(best.nbytes) > min(self._announced.values()):
            return None
        return best

    def _best_prefetch(self) -> Transfer | None:
        heap, prefetches = self._heap, self._prefetches
        while heap:
            _, order, key = heap[0]
            entry = prefetches.get(key)
            if entry is None or entry.order != order:
                heapq.heappop(heap)
            elif key in self.destination:
                heapq.heappop(heap)
                del prefetches[key]
            else:
                return entry
        return None

    def start(self, now: float) -> Transfer:
        """Put ``next_transfer(now)`` on the wire at ``now``."""
        transfer = self.next_transfer(now)
        if transfer is None:
            raise RuntimeError(f"{self.link.name}: nothing can start now")
        if transfer.demand:
            del self._demands[transfer.key]
        else:
            del self._prefetches[transfer.key]
            heapq.heappop(self._heap)
        transfer.start_s = now
        transfer.end_s = now + self.seconds(transfer.nbytes)
        self.on_wire = transfer
        self.bytes_moved += transfer.nbytes
        self.transfers_started += 1
        return transfer

    def seconds(self, nbytes: int) -> float:
        """How long ``nbytes`` take on the wire at its speed now."""
        return self.link.transfer_seconds(nbytes) * self.slowdown

    def slow_down(self, factor: float, now: float) -> bool:
        """Run the wire ``factor`` times slower than the link's own speed from ``now`` on: the transfer on it
        (if any) ends when its remaining time at the new speed has passed. True when its end moved. A transfer
        whose bytes start later (it waits for its eviction decisions, timed/decisions.py) keeps its start."""
        previous, self.slowdown = self.slowdown, factor
        if self.on_wire is None or factor == previous:
            return False
        moving_from = max(now, self.on_wire.start_s)
        self.on_wire.end_s = moving_from + (self.on_wire.end_s - moving_from) * factor / previous
        return True

    def finish(self) -> Transfer:
        """The transfer on the wire has arrived; the wire is free."""
        transfer, self.on_wire = self.on_wire, None
        return transfer
