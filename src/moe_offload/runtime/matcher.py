"""fMoE's asynchronous matcher in the runtime: the prefetcher's searches on a thread of their own.

Paper 000 ("Asynchronous expert map matching") runs the expert map search as a subscriber: the inference
path publishes each iteration's inputs (the semantic embeddings before layer 0, each layer's router
distribution after its router) and goes on; the matcher searches and publishes prefetch proposals, which
the transfer queues take when they arrive. The timed simulator models the same (simulator/timed/run.py):
a search off the inference path runs on the matcher's own timeline, in order, and its proposals reach the
queues when it is done, unless the pass they were made for has passed its last router, and proposals for
layers already routed are ignored.

Here the decode thread calls :meth:`AsyncMatcher.submit` with the hook and a snapshot of the live view
(``LiveRoutingView.at``: what was known when the hook would have run), and never waits for it. One worker
thread calls the prefetcher's hooks in submission order, so the prefetcher object is never touched by two
threads, and hands each hook's proposals and ``predicted_map()`` (a copy: fMoE's eviction priority reads it on
the decode thread) to ``deliver``, which applies them to the data path under its lock
(``ModelRunner._deliver``: dropped and counted as late when their pass is over or their layer was routed).
``on_request_end`` goes through the same queue. A hook's exception is kept and raised on the decode thread
at its next ``submit`` or ``drain``; the worker skips the searches of the pass it failed in.

Modes (engine option ``matcher``), for prefetchers whose search is off the inference path
(``search_on_inference_path`` False and a search to run: fMoE); the others always run on the decode thread:

``async``     the paper's matcher (default): results are applied whenever they arrive;
``inline``    the searches run on the decode thread, before the pass goes on (the searches on the inference path);
``lockstep``  the worker thread, but the decode thread waits for each result before it goes on: the
              same proposals at the same points as ``inline``, through the asynchronous machinery (tests).

The worker keeps up with the decode thread only if a search takes less than the work between two hooks;
otherwise its queue grows and every result arrives late (``late_fraction``), as on the simulator's matcher
timeline. ``drain`` (request end of ``generate``, engine close) waits for the queue to empty.
"""

from __future__ import annotations

import threading
from collections import deque

from moe_offload.prefetch.search_cost import TimedSearch


def runs_off_the_decode_thread(prefetcher) -> bool:
    """Whether ``prefetcher`` has a search that paper and simulator put off the inference path."""
    return isinstance(prefetcher, TimedSearch) and not prefetcher.search_on_inference_path


class AsyncMatcher:
    def __init__(self, prefetcher, deliver, *, lockstep: bool = False):
        """``deliver(iteration, proposals)`` applies a hook's proposals (on the worker thread)."""
        self.prefetcher, self.deliver, self.lockstep = prefetcher, deliver, lockstep
        self.predicted = None  # the prefetcher's predicted_map() after its latest hook, as published
        self._cond = threading.Condition()
        self._tasks: deque = deque()
        self._submitted = self._done = 0
        self._failure: BaseException | None = None
        self._failed_pass: int | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moe-offload fmoe matcher", daemon=True)
        self._thread.start()

    def submit(self, hook: str, view, iteration: int) -> None:
        """Queue ``prefetcher.<hook>(view)`` of pass ``iteration`` (``on_iteration_start``, ``on_layer_routed``,
        ``on_iteration_end``), or ``on_request_end`` with a request id as ``view``."""
        with self._cond:
            self._raise()
            self._tasks.append((hook, view, iteration))
            self._submitted += 1
            self._cond.notify_all()
        if self.lockstep:
            self.drain()

    def drain(self) -> None:
        """Wait until every submitted hook has run and its proposals were delivered; raise a hook's failure."""
        with self._cond:
            while self._done < self._submitted:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _raise(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _run(self) -> None:
        prefetcher = self.prefetcher
        while True:
            with self._cond:
                while not self._tasks and not self._stopping:
                    self._cond.wait()
                if not self._tasks:
                    return
                hook, view, iteration = self._tasks.popleft()
            try:
                if hook == "on_request_end":
                    prefetcher.on_request_end(view)
                elif iteration != self._failed_pass:
                    proposals = getattr(prefetcher, hook)(view)
                    if hook != "on_iteration_end":
                        predicted = prefetcher.predicted_map()
                        self.predicted = None if predicted is None else predicted.copy()
                        self.deliver(iteration, proposals)
            except BaseException as exc:  # raised on the decode thread at its next submit or drain
                with self._cond:
                    self._failure, self._failed_pass = exc, iteration
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
