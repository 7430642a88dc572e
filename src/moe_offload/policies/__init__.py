"""Eviction policies, one file each, behind moe_offload.policies.base.EvictionPolicy.

``POLICIES`` maps the command-line name of every policy to how it is built. A ``-dist`` variant is the
same policy run on a cache split equally among the layers (paper 001's LRU-Dist, Marker-Dist and OPT-Dist,
"a specific cache of size k/l per layer"): the split belongs to the cache (simulator/partitioned_cache.py), not to
the policy, and so does the one option every -dist policy takes beside its policy's, ``whole_layers`` (layers held
whole from the start, as llama.cpp keeps layers in VRAM beside PR #27861's caches of the others).

A policy whose constructor takes an option without a default (static-experts: the experts to keep) runs
only when given it: ``needs_options`` says so, and ``default_policies`` (what "all" and every default list
mean) leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_offload.errors import ConfigError
from moe_offload.policies.arc import ARC
from moe_offload.policies.base import AccessContext, EvictionPolicy, ModelSpec, NoEvictableExpert
from moe_offload.policies.belady import Belady
from moe_offload.policies.coact import CoActivation
from moe_offload.policies.decayed_lfu import DecayedLFU
from moe_offload.policies.fifo import FIFO
from moe_offload.policies.fmoe import FMoE
from moe_offload.policies.lcp import LCP
from moe_offload.policies.learned import LearnedEviction
from moe_offload.policies.lecar import LeCaR
from moe_offload.policies.lfru import LFRU
from moe_offload.policies.lfu import LFU
from moe_offload.policies.lifo import LIFO
from moe_offload.policies.llru import LLRU
from moe_offload.policies.lru import LRU
from moe_offload.policies.marking import Marking
from moe_offload.policies.moe_infinity import MoEInfinity
from moe_offload.policies.neighbor_aware import NeighborAware
from moe_offload.policies.pinned_lru import PinnedLRU
from moe_offload.policies.random import RandomEviction
from moe_offload.policies.static_experts import StaticExperts
from moe_offload.policies.static_freq import StaticFrequency
from moe_offload.policies.static_layers import StaticLayers
from moe_offload.values import integer, integer_list
from moe_offload.values.options import check_option_names, required_options

# The option of a -dist policy's split cache, not of its policy (simulator/partitioned_cache.py): the layers
# held whole, every expert resident from the start, the others splitting the rest of the budget.
PARTITION_OPTIONS = {"whole_layers": None}


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    policy: type[EvictionPolicy]
    partitioned: bool = False  # cache split equally among layers, one policy instance per layer
    partitioned_source: str = "paper 001 (the -Dist baselines)"  # who runs the policy on a split cache

    @property
    def summary(self) -> str:
        if self.partitioned:
            return (f"{self.policy.name} on a cache split equally among the layers (whole_layers=[...]: "
                    "those held whole, the rest split among the others)")
        return self.policy.summary

    @property
    def source(self) -> str:
        return self.partitioned_source if self.partitioned else self.policy.source

    @property
    def offline(self) -> bool:
        return self.policy.offline

    @property
    def needs_options(self) -> list[str]:
        """The options it cannot run without (module doc)."""
        return required_options(self.policy, skip=("seed",))

    @property
    def cache_options(self) -> dict:
        """The options its cache takes beside its policy's, {option: default}: a -dist policy's split."""
        return dict(PARTITION_OPTIONS) if self.partitioned else {}

    def check_options(self, options: dict | None) -> None:
        check_option_names("policy", self.name, self.policy, options, skip=("seed",), also=self.cache_options)

    def policy_options(self, options: dict | None) -> dict:
        """``options`` less its cache's (``cache_options``): what its policy's constructor takes."""
        return {name: value for name, value in (options or {}).items() if name not in self.cache_options}

    def whole_layers(self, options: dict | None, spec: ModelSpec) -> list[int]:
        """A -dist policy's ``whole_layers`` option, checked: distinct layers of ``spec`` (none by default)."""
        value = (options or {}).get("whole_layers") if self.partitioned else None
        if value is None:
            return []
        return sorted(set(integer_list(value, f"{self.name}.whole_layers", low=0, high=spec.num_layers - 1)))


POLICIES: dict[str, PolicyInfo] = {
    info.name: info
    for info in (
        PolicyInfo("lru", LRU),
        PolicyInfo("lfu", LFU),
        PolicyInfo("fifo", FIFO),
        PolicyInfo("random", RandomEviction),
        PolicyInfo("marking", Marking),
        PolicyInfo("lru-dist", LRU, partitioned=True),
        PolicyInfo("marking-dist", Marking, partitioned=True),
        PolicyInfo("belady", Belady),
        PolicyInfo("belady-dist", Belady, partitioned=True),
        PolicyInfo("lifo", LIFO),
        PolicyInfo("neighbor-aware", NeighborAware),
        PolicyInfo("lcp-dist", LCP, partitioned=True,
                   partitioned_source="paper 004: LCP ranks the experts of each layer's own cache"),
        PolicyInfo("llru", LLRU),
        PolicyInfo("arc", ARC),
        PolicyInfo("lecar", LeCaR),
        PolicyInfo("moe-infinity", MoEInfinity),
        PolicyInfo("fmoe", FMoE),
        PolicyInfo("lcp", LCP),
        PolicyInfo("learned", LearnedEviction),
        PolicyInfo("lfu-decay", DecayedLFU),
        PolicyInfo("pinned-lru", PinnedLRU),
        PolicyInfo("static-freq", StaticFrequency),
        PolicyInfo("static-layers", StaticLayers),
        PolicyInfo("coact", CoActivation),
        PolicyInfo("static-experts", StaticExperts),
        PolicyInfo("lfru", LFRU),
        PolicyInfo("lfru-dist", LFRU, partitioned=True,
                   partitioned_source="vLLM PR #37190: a cache of N slots per MoE layer, LFRU in each"),
    )
}


def policy_info(name: str) -> PolicyInfo:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)} "
                          "(`moe-offload policies` describes them)") from None


def default_policies() -> list[str]:
    """Every policy that runs without options, in registry order: what "all" means (module doc)."""
    return [name for name, info in POLICIES.items() if not info.needs_options]


def make_policy(name: str, spec: ModelSpec, *, seed: int = 0, options: dict | None = None) -> EvictionPolicy:
    """Build policy ``name`` for ``spec``. An option its constructor does not take is a ConfigError naming
    those it does; the constructor checks the values (moe_offload.values), so a bad value reads the same
    from the command line (``--policy-option``) and from Python."""
    info = policy_info(name)
    info.check_options(options)
    return info.policy(spec, seed=integer(seed, "seed", low=0), **info.policy_options(options))


def policy_factory(name: str, spec: ModelSpec, *, seed: int = 0, options: dict | None = None):
    """A maker of ``name``'s instances for one run, every tier and partition of it (``run_factory``: the
    instances may share state, as MoE-Infinity's sequence EAMs do), with ``make_policy``'s checks."""
    info = policy_info(name)
    info.check_options(options)
    return info.policy.run_factory(spec, seed=integer(seed, "seed", low=0), **info.policy_options(options))


__all__ = ["POLICIES", "PolicyInfo", "default_policies", "policy_info", "make_policy", "policy_factory", "AccessContext", "EvictionPolicy", "ModelSpec",
           "NoEvictableExpert"]
