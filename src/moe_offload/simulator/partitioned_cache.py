"""A fast tier split among the MoE layers (paper 001's -Dist variants): one ExpertCache (simulator/cache.py) and one
policy per layer, each with its share of the budget, behind the same calls as one cache, so that the replay, the
timed simulator and the runtime drive either alike."""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import AccessContext
from moe_offload.simulator.cache import ExpertCache


class PartitionedCache:
    """A cache split among the layers (paper 001's -Dist variants), one policy per partition.

    Capacity k gives each layer k // L slots, the first k % L layers one more. ``whole_layers`` are held whole
    instead: each takes a slot for every expert of its layer, all loaded before the first request, so it never
    misses (llama.cpp's layers kept in VRAM beside PR #27861's per-layer caches of the host-resident ones); the
    other layers split what is left as above. A slot is ``slot_size`` units (one expert's bytes in the timed
    simulator), so a byte budget splits into whole experts as the replay's expert budget does."""

    def __init__(self, capacity: int, num_layers: int, make_policy, experts_per_layer: int, slot_size: int = 1,
                 admission=None, whole_layers=()):
        self.capacity = capacity
        self.experts_per_layer = experts_per_layer
        self.whole_layers = sorted(whole_layers)
        self.parts = [ExpertCache(slots * slot_size, make_policy(), admission)
                      for slots in self.capacities(capacity // slot_size, num_layers, experts_per_layer,
                                                   self.whole_layers)]

    @staticmethod
    def capacities(slots: int, num_layers: int, experts_per_layer: int = 0, whole_layers=()) -> list[int]:
        """The slots of each layer's partition: ``experts_per_layer`` for each of ``whole_layers``, and of the
        rest ``rest // n`` for each of the n other layers, one more for the first ``rest % n`` of them."""
        whole = set(whole_layers)
        others = [layer for layer in range(num_layers) if layer not in whole]
        rest = slots - len(whole) * experts_per_layer
        if rest < len(others):
            raise ConfigError(f"a cache of {slots} experts cannot hold {len(whole)} whole layers of "
                              f"{experts_per_layer} experts and one expert in each of the other {len(others)} layers")
        base, extra = divmod(rest, len(others)) if others else (0, 0)
        share = {layer: base + (i < extra) for i, layer in enumerate(others)}
        return [experts_per_layer if layer in whole else share[layer] for layer in range(num_layers)]

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
    def bypasses(self) -> int:
        return sum(part.bypasses for part in self.parts)

    @property
    def reserved(self) -> dict:
        """Experts on their way in, over all partitions (key -> size)."""
        return {key: size for part in self.parts for key, size in part.reserved.items()}

    @property
    def held(self) -> dict:
        """Prefetched experts not used yet, over all partitions."""
        return {key: None for part in self.parts for key in part.held}

    @property
    def on_evict(self):
        return self.parts[0].on_evict

    @on_evict.setter
    def on_evict(self, callback) -> None:
        for part in self.parts:
            part.on_evict = callback

    @property
    def on_decision(self):
        return self.parts[0].on_decision

    @on_decision.setter
    def on_decision(self, callback) -> None:
        for part in self.parts:
            part.on_decision = callback

    def cancel(self, key) -> None:
        self.parts[key // self.experts_per_layer].cancel(key)

    def end_request(self, request) -> None:
        for part in self.parts:
            part.end_request(request)

    def release(self, key) -> None:
        self.parts[key // self.experts_per_layer].release(key)

    def request(self, key, ctx: AccessContext, size: int = 1) -> bool:
        return self.parts[key // self.experts_per_layer].request(key, ctx, size)

    def serve(self, key, ctx: AccessContext, size: int = 1) -> str:
        return self.parts[key // self.experts_per_layer].serve(key, ctx, size)

    def admits(self, key, ctx: AccessContext) -> bool:
        return self.parts[key // self.experts_per_layer].admits(key, ctx)

    def preload(self, trace, ctx: AccessContext, size: int = 1) -> None:
        """Every expert of the whole layers, then each partition's policy placement (if any)."""
        for layer in self.whole_layers:
            first = layer * self.experts_per_layer
            for key in range(first, first + self.experts_per_layer):
                self.parts[layer].reserve(key, ctx, size)
                self.parts[layer].complete(key, ctx)
        for part in self.parts:
            part.preload(trace, ctx, size)

    def touch(self, key, ctx: AccessContext) -> bool:
        return self.parts[key // self.experts_per_layer].touch(key, ctx)

    def reserve(self, key, ctx: AccessContext, size: int = 1, protect=()) -> bool:
        return self.parts[key // self.experts_per_layer].reserve(key, ctx, size, protect)

    def complete(self, key, ctx: AccessContext) -> None:
        self.parts[key // self.experts_per_layer].complete(key, ctx)
