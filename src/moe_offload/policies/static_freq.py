"""Static frequency placement: the fast tier holds, for the whole run, the experts routed most often in a
profile; every other expert is computed where it lives (llama.cpp's ``-ot`` overrides, ktransformers'
placement of experts by measured activation frequency).

The rule. With a profile that routes expert k c_k times and room for C experts, the resident set is the C
keys of largest c_k (``per_layer``: the C // L most frequent of each layer, the first C % L layers one
more). Nothing is ever loaded after the start: a miss is always bypassed. The replay's hits are then
sum_{k resident} n_k, n_k being the run's requests of k; when the profile is the run's own trace
(``profile`` not given: the hindsight "stationary oracle"), c_k = n_k and the hits are the sum of the C
largest n_k, the most any fixed set of C experts can serve on that trace.
"""

from __future__ import annotations

from moe_offload.policies._profile import expert_counts, load_profile_trace, most_frequent
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.policies.static_experts import StaticExperts
from moe_offload.values import refuse


class StaticFrequency(EvictionPolicy):
    name = "static-freq"
    summary = ("static placement: the most frequent experts of a profile (default: the trace itself, in "
               "hindsight) stay resident, the rest are computed where they live")
    source = "llama.cpp -ot and ktransformers' frequency-based expert placement (hindsight: the stationary oracle)"
    places_or_bypasses = True
    static = True

    def __init__(self, spec, seed=0, profile=None, per_layer=False):
        super().__init__(spec, seed)
        if not isinstance(per_layer, bool):
            refuse("static-freq.per_layer", per_layer, "must be true or false")
        self.per_layer = per_layer
        self.profile = None if profile is None else load_profile_trace(profile, spec, "static-freq.profile")

    @property
    def in_hindsight(self):
        return self.profile is None

    def placement(self, slots, trace):
        source = self.profile if self.profile is not None else trace
        return most_frequent(expert_counts(source, self.spec), slots, self.spec, self.per_layer)

    def admit(self, key, ctx):
        return False

    replay_kernel = staticmethod(StaticExperts.replay_kernel)  # a request is a hit when its expert is placed

    def victim(self, ctx):
        raise NoEvictableExpert  # it never admits, so the cache never needs room
