"""The runtime's side of a placing policy (policies/base.py: ``places_or_bypasses``): static placements
(static-freq, static-layers) and pinned sets (pinned-lru) whose misses the fast tier may refuse.

A refused miss is computed on the host from the host tier's copy (models/host_experts.py), so such a run
always has a host tier: by default one that holds every expert in its stored dtype (llama.cpp and
ktransformers keep the experts they do not put on the GPU in system memory), or the ``host_budget`` given,
which must hold at least a layer's top-k experts, since a layer may compute all of them there at once. The
placement (the experts resident before the first token) is loaded through the data path at start-up, and
the host tier with the other experts while they fit, so that a static placement moves nothing while it
generates; none of it counts as misses. A placement chosen from a profile needs one, or a replayed trace to
choose from in hindsight.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.simulator.cache import PartitionedCache
from moe_offload.values import option_defaults


def placing_host_budget(info, policy_options: dict | None, host_budget, replaying: bool, split: bool,
                        prefetch: str | None):
    """The host budget of a run of the placing policy ``info`` (a PolicyInfo), its options and the rest of the
    run checked for what the runtime needs."""
    name = info.name
    if split:
        raise ConfigError(f"policy {name!r} places experts itself: it does not run with a split configuration")
    if info.policy.static and prefetch is not None:
        raise ConfigError(f"policy {name!r} is a static placement: it loads nothing after the start, so there is "
                          f"nothing for the prefetcher {prefetch!r} to prefetch")
    if "profile" in option_defaults(info.policy) and not (policy_options or {}).get("profile") and not replaying:
        raise ConfigError(f"policy {name!r} chooses its experts from a profile: give one (--profile TRACE, "
                          "profile=TRACE in Python), or replay a trace to choose from it in hindsight")
    return "100%" if host_budget is None else host_budget


def placement_keys(fast_cache, slot_bytes: int, trace) -> list[int]:
    """The experts the fast tier's policy (each partition's) places before the first token; ``trace``: the
    replayed trace, or None."""
    caches = fast_cache.parts if isinstance(fast_cache, PartitionedCache) else [fast_cache]
    return [int(key) for cache in caches for key in cache.policy.placement(cache.capacity // slot_bytes, trace)]


def host_keys(placed: list[int], spec, host_slots: int) -> list[int]:
    """The experts the host tier holds from the start, besides the ``placed`` ones that pass through it on
    their way to the fast tier: the others in key order, while they fit."""
    others = sorted(set(range(spec.num_layers * spec.num_experts)) - set(placed))
    return others[:max(0, host_slots - len(placed))]
