"""Static layer placement, llama.cpp's ``--n-cpu-moe N``: the experts of the first N MoE layers stay in
system memory and are computed by the CPU; every other layer's experts are resident in the fast tier.

The rule. With J experts per layer and room for C experts, at most F = floor(C / J) whole layers fit
(``fast_layers`` may ask for fewer); the resident set is every expert of the last F layers (llama.cpp
counts its N CPU layers from the first), N = L - F. Nothing is loaded after the start: a miss, every
request of the first N layers, is bypassed. The replay's hit rate is the share of requests in the last F
layers, F / L when every layer routes the same number of tokens.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import integer


class StaticLayers(EvictionPolicy):
    name = "static-layers"
    summary = ("llama.cpp's --n-cpu-moe: the last whole layers' experts resident (as many as fit, or "
               "fast_layers), the first layers' computed on the host")
    source = "llama.cpp --n-cpu-moe / --cpu-moe (whole layers of experts kept in system memory)"
    places_or_bypasses = True
    static = True

    def __init__(self, spec, seed=0, fast_layers=None):
        super().__init__(spec, seed)
        self.fast_layers = None if fast_layers is None else integer(fast_layers, "static-layers.fast_layers",
                                                                    low=0, high=spec.num_layers)

    def placement(self, slots, trace):
        fit = slots // self.spec.num_experts
        if self.fast_layers is not None and self.fast_layers > fit:
            raise ConfigError(f"static-layers.fast_layers {self.fast_layers}: the cache holds {slots} experts, "
                              f"{fit} whole layers of {self.spec.num_experts}")
        layers = fit if self.fast_layers is None else self.fast_layers
        J = self.spec.num_experts
        first = self.spec.num_layers - layers
        return list(range(first * J, self.spec.num_layers * J))

    def admit(self, key, ctx):
        return False

    def victim(self, ctx):
        raise NoEvictableExpert  # it never admits, so the cache never needs room
