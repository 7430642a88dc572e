"""The timed simulator's compute stream and its clock: work over virtual time, shared with the transfers.

TimedRun (run.py) computes its passes on this stream. The tier network (tiers.py) keeps the time and the
routed layer, because its transfers start and land by them; the stream advances that time event by event
(a transfer landing, a matcher's search delivered) and runs work on it. Compute and transfers may share
what they run on (on a CPU the data path reads and converts on the cores that compute, and its Python holds
the interpreter's lock): while a transfer is on a wire the work runs the profile's ``slowdown_while_loading``
times slower, and while the work runs each link its ``slowdown_while_computing`` times slower, processor
sharing piecewise between events; with both at 1 (the presets) work takes its seconds.

A prefetcher that searches a history (``search_latency``) is charged here: on the compute stream when the
search is on the inference path (MoE-Infinity), otherwise on its own matcher timeline, its proposals reaching
the queues only when the search is done (fMoE's asynchronous matcher), and dropped when the pass they were
searched for has routed its last layer.
"""

from __future__ import annotations

import heapq
import itertools

from moe_offload.prefetch import Prefetcher, RoutingView, search_latency


class ComputeStream:
    """Virtual time, the work on the compute stream, and the prefetcher's searches. The subclass sets ``net``
    (the tier network), ``ctx`` (the AccessContext), ``iteration`` and ``passed_last_router``."""

    def __init__(self, compute, prefetcher: Prefetcher | None):
        self.compute, self.prefetcher = compute, prefetcher
        self.events: list = []         # (lane, kind, start, end, layer, key)
        self.deliveries: list = []     # (time, order, iteration, proposals) of the asynchronous matcher
        self.delivery_order = itertools.count()
        self.matcher_free = 0.0
        self.search_seconds = 0.0

    # The tier network keeps the time and the routed layer: its transfers start and land by them.
    @property
    def now(self) -> float:
        return self.net.now

    @now.setter
    def now(self, value: float) -> None:
        self.net.now = value

    @property
    def layer_now(self) -> int:
        return self.net.layer_now

    @layer_now.setter
    def layer_now(self, value: int) -> None:
        self.net.layer_now = value

    # ------------------------------------------------------------------------------------------ events

    def _next_event_time(self) -> float:
        best = self.net.next_arrival()[0]
        if self.deliveries and self.deliveries[0][0] < best:
            best = self.deliveries[0][0]
        return best

    def _process_next_event(self) -> None:
        """The earliest transfer arrival (links in tier order on ties) or matcher delivery, then new starts."""
        best, link = self.net.next_arrival()
        if link is not None and not (self.deliveries and self.deliveries[0][0] < best):
            self.now = best
            self.net.arrive(link)
        else:
            self.now, _, iteration, proposals = heapq.heappop(self.deliveries)
            if iteration == self.iteration and not self.passed_last_router:
                self.net.propose(proposals)  # a search for a pass whose routers have all run has nothing to offer
        self.net.kick()

    def _advance_to(self, t: float) -> None:
        while self._next_event_time() <= t:
            self._process_next_event()
        self.now = t

    def _compute(self, seconds: float, kind: str, layer: int, key: int = -1) -> None:
        """``seconds`` of work, slowed while a transfer is on a wire (module doc)."""
        start, slowdown = self.now, self.compute.slowdown_while_loading
        self.net.computing(True)
        if slowdown == 1.0:
            self._advance_to(start + seconds)
        else:
            work = seconds
            while True:
                rate = 1.0 / slowdown if self.net.moving() else 1.0
                finish = self.now + work / rate
                if self._next_event_time() > finish:
                    break
                work = max(0.0, work - (self._next_event_time() - self.now) * rate)
                self._process_next_event()
            self.now = finish
        self.net.computing(False)
        self.events.append(("compute", kind, start, self.now, layer, key))

    def _consult(self, hook, view: RoutingView) -> None:
        proposals = hook(view)
        self.ctx.predicted = self.prefetcher.predicted_map()
        seconds, on_inference_path = search_latency(self.prefetcher)
        self.search_seconds += seconds
        if seconds and not on_inference_path:
            done = max(self.now, self.matcher_free) + seconds
            self.events.append(("matcher", "search", max(self.now, self.matcher_free), done, view.layer_now, -1))
            self.matcher_free = done
            heapq.heappush(self.deliveries, (done, next(self.delivery_order), self.iteration, proposals))
            return
        if seconds:
            self._compute(seconds, "search", view.layer_now)
        self.net.propose(proposals)
