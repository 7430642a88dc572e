"""A static placement given expert by expert: the fast tier holds exactly the listed experts for the whole run,
and every other expert is computed where it lives. This is how an engine's own placement is replayed:
KTransformers' GPU-experts mask (its ``uniform``, ``front-loading`` and ``random`` strategies, moe_offload.engines
.ktransformers), or any set a user pins by hand.

The rule. With ``experts`` the flat ids k = layer * J + expert of the resident set R and room for C >= |R|
experts, R is loaded before the first access and nothing is loaded after it: a request of k is a hit when
k is in R, otherwise it is bypassed (computed on the host). The replay's hits are sum_{k in R} n_k.
``experts`` has no default: the set is the point of the policy, so it runs only when given one (the registry
leaves it out of its default lists, policies/__init__.py); ``experts=[]`` computes every expert on the host
(llama.cpp's ``--cpu-moe``).

The compiled replay (``replay_kernel``, shared by every static placement) is given R as ``ints``
(policies/base.py ``run_kernel_arguments``), marks it in an array over the flat expert ids and counts the
requests of its experts; the replay counts the others as bypassed.
"""

from __future__ import annotations

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.base import EvictionPolicy, NoEvictableExpert
from moe_offload.values import integer_list


class StaticExperts(EvictionPolicy):
    name = "static-experts"
    summary = "static placement of a given set of experts (an engine's GPU-experts mask); the rest on the host"
    source = "KTransformers' --kt-num-gpu-experts masks (kvcache-ai/sglang python/sglang/srt/layers/moe/kt_utils.py)"
    places_or_bypasses = True
    static = True

    def __init__(self, spec, seed=0, *, experts):
        super().__init__(spec, seed)
        keys = integer_list(experts, "static-experts.experts", low=0, high=spec.num_layers * spec.num_experts - 1)
        self.experts = sorted(set(keys))

    def placement(self, slots, trace):
        if len(self.experts) > slots:
            raise ConfigError(f"static-experts.experts: {len(self.experts)} experts do not fit in a cache of {slots}")
        return list(self.experts)

    def admit(self, key, ctx):
        return False

    def victim(self, ctx):
        raise NoEvictableExpert  # it never admits, so the cache never needs room

    @staticmethod
    def replay_kernel(keys, tokens, capacity, num_layers, num_experts, floats, ints, key_hits):
        """A static placement as the compiled replay runs it: the experts of ``ints`` are resident from the
        start and nothing else is ever loaded, so a request is a hit exactly when its expert is one of them."""
        resident = np.zeros(num_layers * num_experts, np.bool_)
        for key in ints:
            resident[key] = True
        for t in range(keys.shape[0]):
            key = keys[t]
            if resident[key]:
                key_hits[key] += 1
