"""The one interface every eviction policy implements, and the context it is shown.

The cache (moe_offload.simulator.cache.ExpertCache) owns residency, capacity and pinning; a policy only
ranks. For each demand request the cache calls, in this order:

    policy.on_access(key, ctx)          every request, hit or miss, before anything changes
    policy.victim(ctx) -> key           only when room is needed: a resident key not in ctx.pinned
    policy.on_evict(key)                the victim (or any key the cache drops) left
    policy.on_insert(key, ctx)          the key became resident (ctx.prefetch tells a prefetch from a miss)

A miss is not always loaded. Before it loads a missed key the cache asks ``policy.admit(key, ctx)``: False
*bypasses* the miss (the expert is served from the tier that holds it, computed there, and not inserted;
simulator/cache.py). A static placement names the experts resident before the first access with
``policy.placement(slots, trace)``, which the driver loads through the cache's ``preload``.

and, through the cache's ``end_request``, ``policy.on_request_end(request)`` once a request (sequence) has
run its last iteration, so that per-sequence state (MoE-Infinity's EAMs) ends with it and stays bounded.

A driver builds the instances of one run (one per tier, or per partition of a ``-dist`` cache) with
``run_factory``: a policy whose instances share state within a run (MoE-Infinity's sequence EAMs, which
every tier ranks by) builds that state there, once.

Before it first asks for a victim the cache sets ``policy.cache_slots``, the number of experts it holds when
full; the policies whose algorithm is defined by the cache size read it (ARC's c, LeCaR's history size).

The replay simulator, the timed simulator and the runtime fill the same ModelSpec and AccessContext; a
policy never knows which of them drives it. Keys are flat expert ids, the int ``layer * J + expert``.

A policy whose decisions need nothing beyond keys, clocks, tokens and next uses may also give the replay a
compiled form of the same decisions, ``replay_kernel`` (simulator/kernels.py describes the contract); the
class stays the reference, and the tests require both to make the same misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Hashable

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the model whose experts are cached."""

    num_layers: int   # L
    num_experts: int  # J, experts per layer
    top_k: int        # K, experts selected per token and layer

    def layer_of(self, key: int) -> int:
        return key // self.num_experts


class AccessContext:
    """What a policy may look at; the driver updates one instance in place before each call.

    clock       position of the current request in the access order (monotone). In the layered-paging
                replay, request t has clock t and layer t % L.
    round       the layered-paging round of the current request where it differs from clock // L, or None (the
                replay). A timed access serves a whole pass of T tokens, which the replay flattens into T * K
                rounds (trace/flatten.py: token-major, then rank); the pass's access of a key is in the round
                of its first request there, so round * L + layer is the clock the replay gives that request.
    layer       the layer being served now.
    token       index of the token being served (the trace row), counting from 0.
    iteration   the forward pass (prefill or decode step) the token belongs to.
    request     the id of the sequence (prompt) the token belongs to (in a batch: of its first token).
    routed      the tokens routed to the current key in this access, by request: {request: tokens}. A timed
                or runtime access serves a whole forward pass (a prefill, a batch), so one access can carry
                several tokens of several requests; None means one token of ``request`` (the replay).
    next_use    the clock of the next request of the current key (NEVER if none). Only offline drivers,
                which know the future, fill it; online policies must not read it.
    probs       the router's probabilities over the J experts of every layer for the current token, an
                [L, J] array, or None when the trace does not record them.
    predicted   the prefetcher's predicted expert map, [L, J] probabilities, or None without a prefetcher.
    pinned      keys that must not be evicted now (the experts the current layer computes with).
    prefetch    True while the cache inserts a prefetched expert rather than a demand miss.
    """

    __slots__ = ("clock", "round", "layer", "token", "iteration", "request", "routed", "next_use", "probs",
                 "predicted", "pinned", "prefetch")

    def __init__(self):
        self.clock = 0
        self.round: int | None = None
        self.layer = 0
        self.token = 0
        self.iteration = 0
        self.request = 0
        self.routed: dict | None = None
        self.next_use = 0
        self.probs: np.ndarray | None = None
        self.predicted: np.ndarray | None = None
        self.pinned: frozenset | set = frozenset()
        self.prefetch = False


class EvictionPolicy:
    """Base class: subclasses set the class attributes and override the four hooks they need."""

    name: ClassVar[str]
    summary: ClassVar[str]   # one line for `moe-offload policies`
    source: ClassVar[str]    # the paper (seed file) or reference the formula comes from
    offline: ClassVar[bool] = False       # reads ctx.next_use (knows the future)
    needs_probs: ClassVar[bool] = False   # reads ctx.probs or ctx.predicted
    seeded: ClassVar[bool] = False        # draws random numbers from its seed: each seed is another run
    needs_rounds: ClassVar[bool] = False  # reads ctx.round: a runtime taps the routing to count rounds
    # The replay's compiled twin of the hooks below, in the subset of Python that Numba compiles, or None
    # (simulator/kernels.py: its arguments and how it is compiled).
    replay_kernel: ClassVar[Callable | None] = None
    # About how many LRU replays one run of the kernel costs, where it is well above 1: a grid starts the
    # costliest runs first, so that one long run does not finish alone on a core the others left idle
    # (`benchmarks/report_scale.py --tokens 100000 --kernels`, 48 x 128 top-8: coact's kernel about 40 LRU replays,
    # moe-infinity's 9.6, lfu-decay's 5.5; a grid takes the longest first, so the shortest end it together).
    replay_cost: ClassVar[float] = 1.0
    # Whether ``admit`` may refuse a miss or ``placement`` place experts. A kernel of such a policy is given its
    # placement (``run_kernel_arguments``) and starts from it; one that bypasses misses is static (below).
    places_or_bypasses: ClassVar[bool] = False
    # A static placement: ``admit`` refuses every miss, so nothing is loaded (nor prefetched) after the start.
    # Its kernel is given its placement (``run_kernel_arguments``) and counts the hits; every other request is
    # bypassed, which the replay counts.
    static: ClassVar[bool] = False

    def __init__(self, spec: ModelSpec, seed: int = 0):
        self.spec = spec
        self.cache_slots: int | None = None  # experts the cache holds when full; set by the cache (module doc)
        # Residents this policy never offers as victims (pinned-lru's hot set): the cache counts them as
        # pinned when it decides whether room can be made, so it waits rather than ask for a victim in vain.
        self.fixed: frozenset = frozenset()

    def kernel_arguments(self) -> tuple[np.ndarray, np.ndarray]:
        """(floats, ints) that ``replay_kernel`` starts from, taken from this instance as constructed (its
        options, its seeded generator): float64 and int64 arrays, empty for a policy without parameters."""
        return np.zeros(0, np.float64), np.zeros(0, np.int64)

    def run_kernel_arguments(self, slots: int, trace) -> tuple[np.ndarray, np.ndarray]:
        """(floats, ints) that ``replay_kernel`` starts from in a replay of ``trace`` on a cache of ``slots``
        experts: ``kernel_arguments()``, unless the kernel needs what only the run knows. A policy that places
        experts (a static placement, pinned-lru) has no parameters of its own: its kernel is given the experts
        it places, chosen as the replay's preload chooses them (ExpertCache.preload), with the same checks."""
        if self.places_or_bypasses:
            return np.zeros(0, np.float64), np.array(self.placement(slots, trace), np.int64)
        return self.kernel_arguments()

    def replays_as(self, trace) -> str | None:
        """Another policy (its name) whose replay of ``trace`` makes exactly this one's decisions, so that a grid
        replays the two once (fMoE on a trace without router probabilities ranks as LFU); None for most."""
        return None

    def on_access(self, key: Hashable, ctx: AccessContext) -> None:
        """A demand request for ``key``; called before the cache changes (hit or miss)."""

    def on_insert(self, key: Hashable, ctx: AccessContext) -> None:
        """``key`` became resident."""

    def on_evict(self, key: Hashable) -> None:
        """``key`` is no longer resident."""

    def victim(self, ctx: AccessContext) -> Hashable:
        """The resident key to evict now; never one in ``ctx.pinned``."""
        raise NotImplementedError

    def decision_flops(self, residents: int) -> float:
        """Floating-point operations of one ``victim`` call among ``residents`` cached experts: the rule the
        timed simulator charges a decision by when the hardware profile measured none
        (simulator/timed/decisions.py). 0 for a policy whose choice is bookkeeping (a list, a heap, counters)."""
        return 0.0

    def on_request_end(self, request) -> None:
        """Request ``request`` has run its last iteration: no access will carry it again."""

    def admit(self, key: Hashable, ctx: AccessContext) -> bool:
        """Whether the missed ``key`` is loaded into the fast tier (True, every dynamic policy) or bypassed:
        served from the tier that holds it without being inserted."""
        return True

    @property
    def in_hindsight(self) -> bool:
        """Whether ``placement`` chooses from the run's own trace (it knows the future: not an online policy)."""
        return False

    def placement(self, slots: int, trace) -> list:
        """The keys resident before the first access, at most ``slots`` of them (a static placement), chosen
        from ``trace`` (the run's trace, for a placement made in hindsight) or the policy's own profile; none
        for a dynamic policy, whose cache starts empty."""
        return []

    @classmethod
    def run_factory(cls, spec: ModelSpec, seed: int = 0, **options) -> Callable[[], "EvictionPolicy"]:
        """A maker of this policy's instances for one run (every tier and partition of it); building the
        first instance checks the options."""
        return lambda: cls(spec, seed=seed, **options)


class NoEvictableExpert(RuntimeError):
    """Every resident expert is pinned: the cache is too small for what must be resident at once."""
