"""The fast-tier expert cache: what is resident, how much room it takes, and when a policy must choose.

Residency is not policy: the cache keeps the resident set and the budget and asks its EvictionPolicy
only which resident, unpinned expert to drop. Sizes are in any unit (one per expert in the replay,
bytes in the timed simulator); the capacity is in the same unit.

The replay loads an expert at once (``request``). The timed simulator and the runtime split a load in two,
because a transfer takes time: ``reserve`` makes room and counts the expert's size when its transfer
starts (paper 002 section 5.4 applies the replacement "before initiating the actual memory copy"), and
``complete`` makes it resident when it arrives; ``touch`` is a demand access that loads nothing. A
reserved expert is not resident, so no policy can pick it as a victim while it is on the wire.

A prefetched expert is *held* until it is used. An expert reserved for a prefetch
(``ctx.prefetch``) is held from its reservation until a demand access uses it (``touch``/``request``) or
the driver withdraws its prediction (``release``: its layer was routed without it). While held it is
never offered to the policy as a victim, whatever the policy's ranking, and its bytes count in the
budget. Without this rule a policy that ranks a newcomer low (LCP gives it mu = 0, fMoE freq = 0) evicts
each prefetch before the token that needed it arrives, and a prefetcher's precision would depend on the
eviction policy.

A prediction of an expert that is already resident needs no transfer, but it matters all the same: the
driver passes ``protect`` to a prefetch's ``reserve``, the resident experts predicted for a layer that
comes no later than the prefetched one, and the prefetch does not evict them. So a prefetch for a later
layer never pushes out an expert predicted for an earlier one (an oracle looking three layers ahead would
otherwise evict what the next layer needs, and run slower than no prefetching); demand loads still evict
predicted experts by the policy's ranking. Two limits keep the rules from blocking anything that must
happen:

* a prefetch never evicts a held or protected expert: if the room can only come from those, it waits;
* a demand load always makes progress: when every unpinned resident is held, holds are released, the
  most recent first (the prediction made furthest ahead), until the room can be made; the policy then
  picks its victim among the released.

Admission. A miss is *admitted* (loaded into the fast tier, as above) or *bypassed*: served from the tier
that holds it (the host computes it there: llama.cpp's ``--n-cpu-moe``, ktransformers, Fiddler) and not
inserted, so nothing is evicted for it. ``admits(key, ctx)`` decides, once per missed access: the policy's
``admit`` (a static placement never admits) and then the driver's ``admission`` rule, if any (the timed
simulator's fetch-or-compute rule, which knows the costs); it counts the refusals in ``bypasses``. The
replay serves a request with ``serve``, which says which of the three happened (HIT, LOADED, BYPASSED); the
timed simulator and the runtime ``touch`` the key and, on a miss, ask ``admits`` before they reserve room.
A static placement's experts are loaded before the first access by ``preload`` (not counted as misses).

Decisions. Each eviction is one decision of the policy (``victim``), counted in ``evictions``. A driver that
wants the policy's own time (the runtime) sets ``on_decision``: each ``victim`` call is then timed with
``time.perf_counter`` and the callback gets its seconds; left None, nothing is timed (the replay's hot path).
The timed simulator charges decisions from the hardware profile instead (simulator/timed/decisions.py).
"""

from __future__ import annotations

import time

from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext, EvictionPolicy

# What a demand request came to (``ExpertCache.serve``).
HIT, LOADED, BYPASSED = "hit", "loaded", "bypassed"


def predicted_no_later_than(predicted, key: int, layer_now: int, num_experts: int, num_layers: int) -> set:
    """Of the resident experts ``predicted`` for layers to come, those whose layer comes no later than
    ``key``'s, counting layers from the one after ``layer_now`` (the last routed) on into the next
    iteration: what a prefetch of ``key`` passes as ``protect`` (module doc)."""
    def ahead(k: int) -> int:
        return (k // num_experts - layer_now - 1) % num_layers

    limit = ahead(key)
    return {k for k in predicted if ahead(k) <= limit}


class ExpertCache:
    """``admission``, optional, is the driver's rule ``(key, ctx) -> bool`` asked after the policy's ``admit``
    (module doc: Admission)."""

    def __init__(self, capacity: int, policy: EvictionPolicy, admission=None):
        if capacity < 0:
            raise ConfigError(f"cache capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.admission = admission
        self.bypasses = 0
        self.resident: dict = {}  # key -> size
        self.reserved: dict = {}  # key -> size, experts on their way in (counted in used)
        self.held: dict = {}      # key -> None, prefetched and not used yet, oldest first (module doc)
        self.used = 0
        self.evictions = 0
        self._fixed_of = frozenset()  # the policy's fixed set whose resident units _fixed_units counts
        self._fixed_units = 0
        self.on_evict = None  # callback(key) after an eviction: the runtime frees the expert's memory
        self.on_decision = None  # callback(seconds) after each timed victim call (module doc: Decisions)

    def __contains__(self, key) -> bool:
        return key in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def request(self, key, ctx: AccessContext, size: int = 1) -> bool:
        """A demand request: True on a hit; on a miss, load ``key`` (or bypass it) and return False."""
        return self.serve(key, ctx, size) == HIT

    def serve(self, key, ctx: AccessContext, size: int = 1) -> str:
        """A demand request: HIT; or a miss, LOADED after making room and loading ``key``, or BYPASSED when
        ``admits`` refuses it (nothing changes in the cache)."""
        self.policy.on_access(key, ctx)
        if self.held:
            self.held.pop(key, None)
        if key in self.resident:
            return HIT
        if not self.admits(key, ctx):
            return BYPASSED
        self._load(key, ctx, size)
        return LOADED

    def admits(self, key, ctx: AccessContext) -> bool:
        """Whether the missed ``key`` is loaded (True) or bypassed (counted in ``bypasses``); ask once per
        missed access, before reserving room for it (module doc: Admission)."""
        if self.policy.admit(key, ctx) and (self.admission is None or self.admission(key, ctx)):
            return True
        self.bypasses += 1
        return False

    def preload(self, trace, ctx: AccessContext, size: int = 1) -> None:
        """Load the policy's static placement (``policy.placement``) before the first access: as many experts
        of ``size`` units as the capacity holds, chosen from ``trace`` or the policy's profile."""
        for key in self.policy.placement(self.capacity // size, trace):
            self.reserve(key, ctx, size)
            self.complete(key, ctx)

    def touch(self, key, ctx: AccessContext) -> bool:
        """A demand access that loads nothing (the timed simulator loads by transfers): True if resident.
        A held prefetch of ``key`` is used now: the hold ends (the driver pins what its layer computes)."""
        self.policy.on_access(key, ctx)
        if self.held:
            self.held.pop(key, None)
        return key in self.resident

    def release(self, key) -> None:
        """The prediction that prefetched ``key`` is withdrawn (its layer was routed without it): it is an
        ordinary resident (or incoming) expert from now on."""
        self.held.pop(key, None)

    def end_request(self, request) -> None:
        """Request ``request`` has run its last iteration (the policy's per-sequence state may go)."""
        self.policy.on_request_end(request)

    def evict(self, key) -> None:
        size = self.resident.pop(key)
        self.used -= size
        if key in self._fixed_of:
            self._fixed_units -= size
        self.held.pop(key, None)
        self.policy.on_evict(key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def cancel(self, key) -> None:
        """A reserved ``key`` will not arrive (its transfer failed): give its room back."""
        self.used -= self.reserved.pop(key)
        self.held.pop(key, None)

    def reserve(self, key, ctx: AccessContext, size: int = 1, protect=()) -> bool:
        """Make room for ``key`` (evicting the policy's victims, never one in ``ctx.pinned`` nor a held
        prefetch nor, for a prefetch, one in ``protect``) and count its size until ``complete``; a prefetch
        (``ctx.prefetch``) is held from now on. False, with nothing evicted, when the room cannot be made now
        because the rest of the cache is pinned, reserved or, for a prefetch, held or protected."""
        if self.used + size > self.capacity and not self._make_room(key, ctx, size, protect):
            return False
        self.reserved[key] = size
        self.used += size
        if ctx.prefetch:
            self.held[key] = None
        return True

    def complete(self, key, ctx: AccessContext) -> None:
        """The reserved ``key`` has arrived: it is resident from now on."""
        size = self.resident[key] = self.reserved.pop(key)
        if key in self._fixed_of:
            self._fixed_units += size
        self.policy.on_insert(key, ctx)

    def resize(self, capacity: int, ctx: AccessContext, entry_size: int | None = None) -> None:
        """A new budget (MoEpic's online reconfiguration): with ``entry_size`` every resident expert counts that
        size from now on (nothing may be on its way in); then the policy's victims are evicted until the
        residents fit, never a pinned or held expert. What only those could free stays over the budget until
        they are released: the next reservation evicts it then."""
        if entry_size is not None:
            if self.reserved:
                raise RuntimeError("resizing the entries of a cache while experts are on their way in")
            self.resident = dict.fromkeys(self.resident, entry_size)
            self.used = entry_size * len(self.resident)
            self._fixed_of, self._fixed_units = frozenset(), 0  # recounted when next asked
        self.capacity = capacity
        pinned = ctx.pinned
        ctx.pinned = pinned | self.held.keys()
        try:
            while self.used > capacity and any(key not in ctx.pinned for key in self.resident):
                self.evict(self._victim(ctx))
        finally:
            ctx.pinned = pinned

    def keep_exactly(self, keys, capacity: int, ctx: AccessContext, entry_size: int | None = None) -> list:
        """A new budget whose residents are ``keys`` (MoEpic's reconfiguration caches a layer's top-C_i experts by
        priority, paper 004 Algorithm 1): the other residents are evicted, the budget set (``resize``, which
        then evicts nothing), and the missing keys reserved, the last of ``keys`` first, so that a policy that
        ranks by arrival keeps the first longest. Returns the missing keys, which the caller completes once they
        are in. Nothing may be held or on its way in."""
        if self.held or self.reserved:
            raise RuntimeError("choosing the residents of a cache while experts are held or on their way in")
        wanted = set(keys)
        for key in [key for key in self.resident if key not in wanted]:
            self.evict(key)
        self.resize(capacity, ctx, entry_size)
        missing = [key for key in keys if key not in self.resident]
        for key in reversed(missing):
            if not self.reserve(key, ctx, entry_size or 1):
                raise ConfigError(f"{len(keys)} experts do not fit in a cache of {capacity} units")
        return missing

    def _make_room(self, key, ctx, size, protect=()) -> bool:
        """Evict the policy's victims until ``size`` more units fit; False, with nothing evicted, when
        that cannot be done now (module doc: what pinned, reserved, held and protected experts allow)."""
        if size > self.capacity:
            raise ConfigError(f"expert {key} needs {size} units but the whole cache holds {self.capacity}")
        if self.policy.cache_slots is None:  # full for the first time: what it holds is its size in experts
            self.policy.cache_slots = len(self.resident) + len(self.reserved)
        pinned = ctx.pinned
        # what no victim can come from: the pinned, and the policy's fixed set (counted by _room_can_be_made)
        if self.reserved or pinned or self.policy.fixed or self.held or protect:  # the replay has none but fixed
            spared = self.held.keys() | protect if ctx.prefetch and protect else self.held.keys()
            if not self._room_can_be_made(pinned, size, spared):
                if ctx.prefetch or not self._release_holds_for(pinned, size):
                    return False
                spared = self.held.keys()
            if spared:  # the policy must not see a held or protected expert as a candidate
                ctx.pinned = spared | pinned
        try:
            while self.used + size > self.capacity:
                self.evict(self._victim(ctx))
        finally:
            ctx.pinned = pinned
        return True

    def _victim(self, ctx: AccessContext):
        """The policy's victim, its time given to ``on_decision`` when set."""
        if self.on_decision is None:
            return self.policy.victim(ctx)
        began = time.perf_counter()
        key = self.policy.victim(ctx)
        self.on_decision(time.perf_counter() - began)
        return key

    def _room_can_be_made(self, pinned, size, spared) -> bool:
        """Whether evicting every resident expert that is neither pinned, ``spared`` nor in the policy's fixed
        set would make room for ``size`` units; asked before the first eviction, so that an attempt that cannot
        succeed evicts nothing. The fixed set's resident units are kept as they change (pinned-lru fixes
        hundreds of experts, and a replay asks at every eviction)."""
        resident = self.resident
        fixed = self.policy.fixed
        if fixed is not self._fixed_of:
            self._fixed_of = fixed
            self._fixed_units = sum(resident[k] for k in fixed if k in resident)
        stuck = sum(self.reserved.values()) + self._fixed_units + sum(
            resident[k] for k in spared | pinned if k in resident and k not in fixed)
        return self.capacity - stuck >= size

    def _release_holds_for(self, pinned, size) -> bool:
        """A demand load finds the room held by prefetches: release the holds of resident experts, the most
        recent first, until it can be made. False when even releasing every hold would not make it (the
        rest is pinned or reserved)."""
        if not self._room_can_be_made(pinned, size, set()):
            return False
        for key in reversed([key for key in self.held if key in self.resident]):
            if self._room_can_be_made(pinned, size, self.held.keys()):
                break
            del self.held[key]
        return True

    def _load(self, key, ctx, size):
        # the replay's path: reserve and complete in one, without their bookkeeping
        if self.used + size > self.capacity and not self._make_room(key, ctx, size):
            raise ConfigError(f"the cache of {self.capacity} units is full of pinned experts and cannot "
                              f"load expert {key}: it is too small for what must be resident at once")
        self.resident[key] = size
        self.used += size
        if key in self._fixed_of:
            self._fixed_units += size
        self.policy.on_insert(key, ctx)
