"""What a prefetcher's search of its history costs, so that the timed simulator can charge it.

fMoE and MoE-Infinity match the current iteration against stored history (expert maps, EAMs) at every
layer; the others do a handful of array operations that the papers count as free. A prefetcher that
searches derives from ``TimedSearch`` and, after every hook call, reports

``last_search_seconds``
    what the work of that call took: the search and the choice of the proposals, or (in
    ``on_iteration_end``) the update of the stored history. Measured by default as the CPU time of the
    calling thread (``time.thread_time``): what the search costs on a core of its own, which is what the
    modelled server gives its matcher; the wall clock would also count the time the operating system
    gave other processes, so a busy machine would make a search look several times slower than it is
    (on this project's shared 2-core machine, under a load of 15, eight times). Where the thread clock is
    coarse (Windows: 15.6 ms) the wall clock (``time.perf_counter``) is used. With the option
    ``search_seconds=S`` every call that searched reports the modelled constant S instead, which makes a
    simulation reproducible. 0.0 for a call that searched nothing (an empty store, a layer with nothing
    left to predict).

``search_on_inference_path``
    False for fMoE: its matcher is an asynchronous subscriber (paper 000, "Asynchronous expert map
    matching"), so the simulator charges the time on a separate matcher timeline and the call's proposals
    reach the transfer queue only once the matcher is done, while inference goes on. True for
    MoE-Infinity: Algorithm 1 of paper 002 calls PREFETCH (step 8) before the layer's experts run
    (steps 9-13), so the time is spent on the inference path itself.

``moe_offload.prefetch.search_latency(prefetcher)`` reads both for any prefetcher (0.0 and False for one
that does not search).
"""

from __future__ import annotations

import time

from moe_offload.values import number


class TimedSearch:
    """Mixin for prefetchers that search a history; see the module docstring."""

    _modelled_seconds: float | None = None

    def _set_search_seconds(self, search_seconds: float | None) -> None:
        if search_seconds is not None:
            search_seconds = number(search_seconds, f"{self.name}.search_seconds", low=0)
        self._modelled_seconds = search_seconds

    def _timed_search(self) -> "_SearchTimer":
        """``with self._timed_search():`` times the block as one search: the hook's ``last_search_seconds``."""
        return _SearchTimer(self)

    def _no_search(self) -> None:
        self.last_search_seconds = 0.0


# the clock of a search (module docstring): this thread's CPU time where the platform measures it finely
SEARCH_CLOCK = time.thread_time if time.get_clock_info("thread_time").resolution <= 1e-6 else time.perf_counter


class _SearchTimer:
    """The context of ``TimedSearch._timed_search`` (a plain class: a hook pays for it at every layer)."""

    __slots__ = ("searcher", "start")

    def __init__(self, searcher: TimedSearch):
        self.searcher = searcher

    def __enter__(self) -> None:
        self.start = SEARCH_CLOCK()

    def __exit__(self, *exc) -> None:
        elapsed = SEARCH_CLOCK() - self.start
        searcher = self.searcher
        modelled = searcher._modelled_seconds
        searcher.last_search_seconds = elapsed if modelled is None else modelled
