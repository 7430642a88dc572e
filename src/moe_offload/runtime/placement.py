"""The runtime's side of a placing policy (policies/base.py: ``places_or_bypasses``): static placements
(static-freq, static-layers) and pinned sets (pinned-lru) whose misses the fast tier may refuse; and of
Fiddler's fetch-or-compute rule (policies/fetch_or_compute.py), which refuses a dynamic policy's miss when
the host computes it faster than it is fetched.

A refused miss is computed on the host from the host tier's copy (models/host_experts.py), so such a run
always has a host tier: by default one that holds every expert in its stored dtype (llama.cpp and
ktransformers keep the experts they do not put on the GPU in system memory; plan/make.py gives the plan that
host budget), or the ``host_budget`` given, which must hold at least a layer's top-k experts, since a layer
may compute all of them there at once (runtime/engine_setup.py, size_tiers). The
placement (the experts resident before the first token) is loaded through the data path at start-up, and
the host tier with the other experts while they fit, so that a static placement moves nothing while it
generates; none of it counts as misses. A placement chosen from a profile needs one, or a replayed trace to
choose from in hindsight.

Fetch or compute. ``fetch_or_compute`` gives the fast tier's cache the rule the timed simulator uses
(``simulate --timed --fetch-or-compute``): the same FetchOrCompute on the same ProfileCosts, with the costs
of the plan's hardware profile (a measured profile, a preset, or the default preset; plan/make.py checks that
it has a host tier and the host's time per expert). A run with
the rule is a placing run: it has a host tier (every expert by default, loaded at start-up), and a bypassed
miss is computed from the host tier's copy. The profile's tiers are matched to the runtime's by position:
the runtime's host tier is the profile's tier 1 when that tier is a cache in front of a slower home (an SSD),
so an expert the host tier holds costs no read, and one it does not hold costs the read from the home, into
the host tier first, as the data path does it (``compute_on_host``: the files into the host tier, no
further; the host tier keeps it while the layer computes it). With a profile whose tier 1 is the home (a
host that holds every expert), every expert is read from there, as in the simulator.
"""

from __future__ import annotations

from moe_offload.policies.fetch_or_compute import FetchOrCompute, ProfileCosts
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.simulator.transfers import home_tier


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


def fetch_or_compute_rule(profile, manifest, host_cache) -> FetchOrCompute:
    """Fiddler's rule on ``profile`` for the experts of ``manifest`` (their stored bytes, as the simulator charges
    them), the runtime's host tier ``host_cache`` standing for the profile's tier 1 (module doc)."""
    m = manifest
    home = home_tier(profile, m.num_layers * m.num_experts * m.expert_bytes) or len(profile.tiers) - 1

    def where(key: int) -> int:
        return 1 if home > 1 and key in host_cache else home

    return FetchOrCompute.on_profile(ProfileCosts(profile, m.expert_bytes, m.hidden_size, where))


def admit_by(fast_cache, rule) -> None:
    """``rule`` decides the fast tier's admissions from now on (each partition's, for a partitioned cache)."""
    for cache in fast_cache.parts if isinstance(fast_cache, PartitionedCache) else [fast_cache]:
        cache.admission = rule
