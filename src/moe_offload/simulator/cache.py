"""The fast-tier expert cache: what is resident, how much room it takes, and when a policy must choose.

Residency is not policy: the cache keeps the resident set and the budget and asks its EvictionPolicy
only which resident, unpinned expert to drop. Sizes are in any unit (one per expert in the replay,
bytes in the timed simulator); the capacity is in the same unit.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext, EvictionPolicy, NoEvictableExpert


class ExpertCache:
    def __init__(self, capacity: int, policy: EvictionPolicy):
        if capacity < 0:
            raise ConfigError(f"cache capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.resident: dict = {}  # key -> size
        self.used = 0
        self.evictions = 0

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

    def evict(self, key) -> None:
        self.used -= self.resident.pop(key)
        self.policy.on_evict(key)
        self.evictions += 1

    def _load(self, key, ctx, size):
        if size > self.capacity:
            raise ConfigError(f"expert {key} needs {size} units but the whole cache holds {self.capacity}")
        policy = self.policy
        while self.used + size > self.capacity:
            try:
                victim = policy.victim(ctx)
            except NoEvictableExpert:
                raise ConfigError(f"the cache of {self.capacity} units is full of pinned experts and cannot "
                                  f"load expert {key}: it is too small for what must be resident at once") from None
            self.evict(victim)
        self.resident[key] = size
        self.used += size
        policy.on_insert(key, ctx)


class PartitionedCache:
    """A cache split equally among the layers (paper 001's -Dist variants), one policy per partition.

    Capacity k gives each layer k // L slots, the first k % L layers one more."""

    def __init__(self, capacity: int, num_layers: int, make_policy, experts_per_layer: int):
        base, extra = divmod(capacity, num_layers)
        self.capacity = capacity
        self.experts_per_layer = experts_per_layer
        self.parts = [ExpertCache(base + (layer < extra), make_policy()) for layer in range(num_layers)]

    def __contains__(self, key) -> bool:
        return key in self.parts[key // self.experts_per_layer]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def evictions(self) -> int:
        return sum(part.evictions for part in self.parts)

    def request(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].request(key, ctx, size)

    def prefetch(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].prefetch(key, ctx, size)
