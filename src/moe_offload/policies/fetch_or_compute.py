"""Fetch or compute: Fiddler's rule for a dynamic policy's misses. A missed expert is either fetched (its
weights copied to the GPU, then computed there) or computed where it lives, on the host CPU, from its copy
in host memory (only the hidden states of its tokens cross the link, both ways).

The rule. For a missed expert k with n tokens routed to it in this forward pass (one per decoding request
of a batch, the prompt's tokens in a prefill):

    fetch(k, n)   = T_load(k) + T_gpu(n)           T_load: its bytes over the links from where it is
    compute(k, n) = T_act(n) + T_host(k, n)        T_act: the hidden states to the host and back

and the miss is admitted (fetched) when fetch(k, n) <= compute(k, n), bypassed otherwise. Decoding (n = 1)
on a slow link bypasses: T_host is the expert's bytes at the CPU's memory bandwidth, several times the
link's. A long prefill fetches: T_host grows with n at the CPU's FLOP rate while T_load does not. Fiddler
(Kamahori et al., "Fiddler: CPU-GPU orchestration for fast inference of MoE models") makes this choice per
expert and batch from latencies it measures beforehand, ignoring what else is on the link; so does this
rule, with the costs the driver gives (the timed simulator's hardware profile).

Where the host's memory outruns the link, decoding bypasses every miss, so a dynamic cache that starts empty
fills only through what this rule does not decide: prefetches, and the fetches of a long prefill. Fiddler
itself starts from a static placement of the most popular experts (static-freq here, which never admits).
"""

from __future__ import annotations

from typing import Callable

from moe_offload.policies.base import AccessContext


class FetchOrCompute:
    """The cache's admission rule ``(key, ctx) -> bool`` (simulator/cache.py): True to fetch."""

    name = "fetch-or-compute"

    def __init__(self, fetch_seconds: Callable[[int, int], float], compute_seconds: Callable[[int, int], float]):
        """``fetch_seconds(key, tokens)`` and ``compute_seconds(key, tokens)`` are fetch(k, n) and compute(k, n)
        of the module doc."""
        self.fetch_seconds = fetch_seconds
        self.compute_seconds = compute_seconds

    def __call__(self, key, ctx: AccessContext) -> bool:
        tokens = sum(ctx.routed.values()) if ctx.routed else 1
        return self.fetch_seconds(key, tokens) <= self.compute_seconds(key, tokens)
