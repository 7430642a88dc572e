"""Which tokens each forward pass of the timed simulator runs, and when requests arrive.

With ``Arrivals("trace")`` the trace's iterations run as recorded, each request arriving when its first
iteration starts; with ``Arrivals("poisson", rate)`` (a seeded Poisson process) or ``Arrivals("times",
times=...)`` (replayed timestamps) requests are served FIFO with continuous batching (``max_batch``). A
request's first token is done at the end of its first iteration: TTFT = that time - arrival; TPOT = (last
token - first token) / (tokens - 1).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.trace.flatten import last_row_of_each_request
from moe_offload.trace.format import Trace


# The coarsest step of the simulated clock (seconds) a run accepts: a thousandth of the shortest latencies it
# reports (iterations of tens of microseconds and more).
CLOCK_RESOLUTION = 1e-7


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

    def check_clock(self, requests: int, path) -> None:
        """ConfigError naming ``path`` when the run's clock cannot resolve its times: it counts seconds from the
        first arrival in float64, whose step at time T is about T * 2.2e-16, so arrivals far apart (a Poisson
        rate of 1e-12 per second puts them 10^12 s apart, a step of 0.2 ms) would round every latency of the
        run (TPOTs of 3 ms read 0.24 ms). Refused where the last arrival's step exceeds CLOCK_RESOLUTION."""
        if self.kind == "trace":
            return
        last = self.arrival_times(requests)[-1]
        if np.spacing(last) > CLOCK_RESOLUTION:
            raise ConfigError(f"{path}: with {self.describe()}, its {requests} request(s) arrive over {last:.3g} s, "
                              f"where the simulator's clock steps by {np.spacing(last):.2g} s (more than "
                              f"{CLOCK_RESOLUTION:g} s): every latency would be rounded; give arrivals closer "
                              "together")

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


class TraceOrder:
    """The trace's own iterations, one after another."""

    def __init__(self, trace: Trace):
        iterations = trace_iterations(trace)
        self._iterations = deque(iterations)
        # the requests whose last row is in each iteration, in order of their last rows
        last_rows = last_row_of_each_request(trace.request)
        ending = np.searchsorted(np.cumsum([rows.size for rows in iterations]), last_rows, side="right")
        self._ending = deque(trace.request[last_rows[ending == i]].tolist() for i in range(len(iterations)))

    def next_batch(self, now: float):
        """(start time, rows) of the next iteration, or None when the trace is done."""
        return (now, self._iterations.popleft()) if self._iterations else None

    def arrival(self, request: int, start: float) -> float:
        return start

    def batch_done(self) -> list[int]:
        """The requests whose last iteration this was."""
        return self._ending.popleft()


class Serving:
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

    def batch_done(self) -> list[int]:
        """The requests whose last step this was; they leave the batch."""
        for entry in self._active:
            entry[1] += 1
        ended = [self._ids[index] for index, step in self._active if step == len(self._steps[index])]
        self._active = [entry for entry in self._active if entry[1] < len(self._steps[entry[0]])]
        return ended


def make_schedule(trace: Trace, arrivals: Arrivals):
    """The iterations of ``trace`` as ``arrivals`` orders them (``next_batch``, ``arrival``, ``batch_done``:
    the requests that end with the batch)."""
    return TraceOrder(trace) if arrivals.kind == "trace" else Serving(trace, arrivals)


def leading_iterations(trace: Trace, tokens: int) -> Trace:
    """The trace's first whole iterations up to ``tokens`` rows (at least its first iteration; the whole trace when
    it has no more), batches as recorded, extended where needed so that decoding is in it: up to the first
    iteration in which some request runs its second step (TPOT is then defined), when there is one. A prompt
    longer than ``tokens`` would otherwise make the sample a prefill alone."""
    if trace.num_tokens <= tokens:
        return trace
    ends = np.append(np.flatnonzero(np.diff(trace.iteration)) + 1, trace.num_tokens)  # one past each iteration
    cut = int(ends[max(0, np.searchsorted(ends, tokens, side="right") - 1)])
    seen: set = set()
    begin = 0
    for end in ends.tolist():  # the first iteration that repeats a request of an earlier one
        requests = set(np.unique(trace.request[begin:end]).tolist())
        if requests & seen:
            cut = max(cut, end)
            break
        seen |= requests
        begin = end
    return trace.select(slice(0, cut))


def describe_sample(sample: Trace, whole: Trace) -> str:
    """What part of ``whole`` the timed runs replay: its iterations, prefill and decode tokens, batch sizes."""
    iterations = trace_iterations(sample)
    sizes = [rows.size for rows in iterations]
    decode = int((sample.phase != 0).sum())
    part = "all" if sample.num_tokens == whole.num_tokens else "the first"
    return (f"{part} {len(iterations):,} iterations of {len(trace_iterations(whole)):,} "
            f"({sample.num_tokens - decode:,} prefill and {decode:,} decode tokens; "
            f"{min(sizes):,} to {max(sizes):,} tokens a pass)")
