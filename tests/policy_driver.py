"""A tiny driver for hand-built request sequences: it records which expert each miss evicted."""

from __future__ import annotations

import numpy as np

from moe_offload.policies import AccessContext, ModelSpec, policy_info
from moe_offload.simulator.cache import ExpertCache
from moe_offload.simulator.partitioned_cache import PartitionedCache
from moe_offload.trace.flatten import next_use_times


def drive(policy: str, requests, capacity: int, spec: ModelSpec, *, tokens=None, request_ids=None, probs=None,
          predicted=None, options=None):
    """Serve ``requests`` [(layer, expert), ...] in order.

    Request t has clock t; its token is ``tokens[t]`` (default t); ``probs[token]`` is an [L, J] router
    distribution. Returns (hits, evicted) where evicted[t] lists the keys the request at t evicted."""
    info = policy_info(policy)
    make = info.policy.run_factory(spec, seed=0, **(options or {}))
    cache = (PartitionedCache(capacity, spec.num_layers, make, spec.num_experts) if info.partitioned
             else ExpertCache(capacity, make()))
    keys = [layer * spec.num_experts + expert for layer, expert in requests]
    nxt = next_use_times(np.asarray(keys, dtype=np.int64)).tolist()
    ctx = AccessContext()
    ctx.predicted = predicted
    parts = cache.parts if info.partitioned else [cache]
    hits, evicted = 0, []
    for t, (key, (layer, _)) in enumerate(zip(keys, requests)):
        ctx.clock, ctx.layer = t, layer
        ctx.token = t if tokens is None else tokens[t]
        ctx.request = 0 if request_ids is None else request_ids[t]
        ctx.next_use = nxt[t]
        ctx.probs = None if probs is None else probs[ctx.token]
        before = set().union(*(part.resident for part in parts))
        hits += cache.request(key, ctx)
        after = set().union(*(part.resident for part in parts))
        evicted.append(sorted(before - after))
        assert sum(len(part) for part in parts) <= capacity
    return hits, evicted
