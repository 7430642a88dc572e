"""The fast-tier expert cache: what is resident, how much room it takes, and when a policy must choose.

Residency is not policy: the cache keeps the resident set and the budget and asks its EvictionPolicy
only which resident, unpinned expert to drop. Sizes are in any unit (one per expert in the replay,
bytes in the timed simulator); the capacity is in the same unit.

The replay loads an expert at once (``request``, ``prefetch``). The timed simulator splits a load in two,
because a transfer takes time: ``reserve`` makes room and counts the expert's size when its transfer
starts (paper 002 section 5.4 applies the replacement "before initiating the actual memory copy"), and
``complete`` makes it resident when it arrives; ``touch`` is a demand access that loads nothing. A
reserved expert is not resident, so no policy can pick it as a victim while it is on the wire.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext, EvictionPolicy


class ExpertCache:
    def __init__(self, capacity: int, policy: EvictionPolicy):
        if capacity < 0:
            raise ConfigError(f"cache capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.resident: dict = {}  # key -> size
        self.reserved: dict = {}  # key -> size, experts on their way in (counted in used)
        self.used = 0
        self.evictions = 0
        self.on_evict = None  # callback(key) after an eviction: the runtime frees the expert's memory

    def __contains__(self, key) -> bool:
        return key in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def request(self, key, ctx: AccessContext, size: int = 1) -> bool:
        """A demand request: True on a hit; on a miss, make room, load ``key`` and return False."""
        policy = self.policy
        policy.on_access(key, ctx)
        if key in self.resident:
            return True
        self._load(key, ctx, size)
        return False

    def prefetch(self, key, ctx: AccessContext, size: int = 1) -> bool:
        """Load ``key`` ahead of its request; False if it was already resident."""
        if key in self.resident:
            return False
        ctx.prefetch = True
        try:
            self._load(key, ctx, size)
        finally:
            ctx.prefetch = False
        return True

    def touch(self, key, ctx: AccessContext) -> bool:
        """A demand access that loads nothing (the timed simulator loads by transfers): True if resident."""
        self.policy.on_access(key, ctx)
        return key in self.resident

    def evict(self, key) -> None:
        self.used -= self.resident.pop(key)
        self.policy.on_evict(key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def cancel(self, key) -> None:
        """A reserved ``key`` will not arrive (its transfer failed): give its room back."""
        self.used -= self.reserved.pop(key)

    def reserve(self, key, ctx: AccessContext, size: int = 1) -> bool:
        """Make room for ``key`` (evicting the policy's victims, never one in ``ctx.pinned``) and count its
        size until ``complete``. False, with nothing evicted, when the room cannot be made now because the
        rest of the cache is pinned or reserved."""
        if self.used + size > self.capacity:
            if (size > self.capacity or self.reserved or ctx.pinned) and not self._room_can_be_made(key, ctx, size):
                return False
            policy = self.policy
            while self.used + size > self.capacity:
                self.evict(policy.victim(ctx))
        self.reserved[key] = size
        self.used += size
        return True

    def complete(self, key, ctx: AccessContext) -> None:
        """The reserved ``key`` has arrived: it is resident from now on."""
        self.resident[key] = self.reserved.pop(key)
        self.policy.on_insert(key, ctx)

    def _room_can_be_made(self, key, ctx, size) -> bool:
        """Whether evicting every resident expert that is not pinned would make room for ``size`` units;
        asked before the first eviction, so that an attempt that cannot succeed evicts nothing. (Without
        pinned or reserved experts and with ``size`` <= capacity the answer is yes: the hot paths skip it.)"""
        if size > self.capacity:
            raise ConfigError(f"expert {key} needs {size} units but the whole cache holds {self.capacity}")
        resident = self.resident
        evictable = self.used - sum(self.reserved.values()) - sum(resident[k] for k in ctx.pinned if k in resident)
        return self.capacity - self.used + evictable >= size

    def _load(self, key, ctx, size):
        # the replay's hot path: reserve and complete in one, without their bookkeeping
        if self.used + size > self.capacity:
            if (size > self.capacity or self.reserved or ctx.pinned) and not self._room_can_be_made(key, ctx, size):
                raise ConfigError(f"the cache of {self.capacity} units is full of pinned experts and cannot "
                                  f"load expert {key}: it is too small for what must be resident at once")
            policy = self.policy
            while self.used + size > self.capacity:
                self.evict(policy.victim(ctx))
        self.resident[key] = size
        self.used += size
        self.policy.on_insert(key, ctx)


class PartitionedCache:
    """A cache split equally among the layers (paper 001's -Dist variants), one policy per partition.

    Capacity k gives each layer k // L slots, the first k % L layers one more. A slot is ``slot_size`` units
    (one expert's bytes in the timed simulator), so a byte budget splits into whole experts as the replay's
    expert budget does."""

    def __init__(self, capacity: int, num_layers: int, make_policy, experts_per_layer: int, slot_size: int = 1):
        base, extra = divmod(capacity // slot_size, num_layers)
        self.capacity = capacity
        self.experts_per_layer = experts_per_layer
        self.parts = [ExpertCache((base + (layer < extra)) * slot_size, make_policy()) for layer in range(num_layers)]

    def __contains__(self, key) -> bool:
        return key in self.parts[key // self.experts_per_layer]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def evictions(self) -> int:
        return sum(part.evictions for part in self.parts)

    @property
    def used(self) -> int:
        return sum(part.used for part in self.parts)

    @property
    def reserved(self) -> dict:
        """Experts on their way in, over all partitions (key -> size)."""
        return {key: size for part in self.parts for key, size in part.reserved.items()}

    @property
    def on_evict(self):
        return self.parts[0].on_evict

    @on_evict.setter
    def on_evict(self, callback) -> None:
        for part in self.parts:
            part.on_evict = callback

    def cancel(self, key) -> None:
        self.parts[key // self.experts_per_layer].cancel(key)

    def request(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].request(key, ctx, size)

    def prefetch(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].prefetch(key, ctx, size)

    def touch(self, key, ctx: AccessContext) -> bool:
        return self.parts[key // self.experts_per_layer].touch(key, ctx)

    def reserve(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].reserve(key, ctx, size)

    def complete(self, key, ctx: AccessContext) -> None:
        self.parts[key // self.experts_per_layer].complete(key, ctx)
