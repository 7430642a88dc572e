"""Static layer placement, llama.cpp's ``--n-cpu-moe N``: the experts of the first N MoE layers stay in
system memory and are computed by the CPU; every other layer's experts are resident in the fast tier. With
``cpu_layers`` any set of layers stays on the host instead of the first N (llama.cpp's ``-ot REGEX=CPU``
over those layers' ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors).

The rule. With J experts per layer and room for C experts, at most F = floor(C / J) whole layers fit
(``fast_layers`` may ask for fewer); the resident set is every expert of the last F layers (llama.cpp
counts its N CPU layers from the first), N = L - F. Nothing is loaded after the start: a miss, every
request of the first N layers, is bypassed. The replay's hit rate is the share of requests in the last F
layers, F / L when every layer routes the same number of tokens. With ``cpu_layers`` = H the resident set
is every expert of the layers outside H, which must fit: (L - |H|) * J <= C.
"""

from __future__ import annotations

from moe_offload.errors import ConfigError
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.static_experts import StaticExperts
from moe_offload.values import integer, integer_list


class StaticLayers(EvictionPolicy):
    name = "static-layers"
    summary = ("llama.cpp's --n-cpu-moe: the last whole layers' experts resident (as many as fit, or "
               "fast_layers), the first layers' computed on the host")
    source = "llama.cpp --n-cpu-moe / --cpu-moe (whole layers of experts kept in system memory)"
    places_or_bypasses = True
    static = True

    def __init__(self, spec, seed=0, fast_layers=None, cpu_layers=None):
        super().__init__(spec, seed)
        self.fast_layers = None if fast_layers is None else integer(fast_layers, "static-layers.fast_layers",
                                                                    low=0, high=spec.num_layers)
        self.cpu_layers = None if cpu_layers is None else sorted(set(integer_list(
            cpu_layers, "static-layers.cpu_layers", low=0, high=spec.num_layers - 1)))
        if self.fast_layers is not None and self.cpu_layers is not None:
            raise ConfigError("static-layers: give fast_layers (the last layers resident) or cpu_layers (these "
                              "layers on the host), not both")

    def placement(self, slots, trace):
        J = self.spec.num_experts
        if self.cpu_layers is not None:
            resident = [layer for layer in range(self.spec.num_layers) if layer not in self.cpu_layers]
            if len(resident) * J > slots:
                raise ConfigError(f"static-layers.cpu_layers: the {len(resident)} other layers' experts "
                                  f"({len(resident) * J}) do not fit in a cache of {slots}")
            return [layer * J + expert for layer in resident for expert in range(J)]
        fit = slots // self.spec.num_experts
        if self.fast_layers is not None and self.fast_layers > fit:
            raise ConfigError(f"static-layers.fast_layers {self.fast_layers}: the cache holds {slots} experts, "
                              f"{fit} whole layers of {self.spec.num_experts}")
        layers = fit if self.fast_layers is None else self.fast_layers
        first = self.spec.num_layers - layers
        return list(range(first * J, self.spec.num_layers * J))

    def admit(self, key, ctx):
        return False

    replay_kernel = staticmethod(StaticExperts.replay_kernel)  # a request is a hit when its expert is placed

    def victim(self, ctx):
        raise NoEvictableExpert  # it never admits, so the cache never needs room
