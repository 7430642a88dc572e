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
rule, with the costs of a hardware profile (:class:`ProfileCosts`), the same for the timed simulator and
the runtime (``generate --fetch-or-compute``), so both decide alike on the same rows:

    T_load(k)   the links from the tier that holds k down to the GPU, one expert's bytes each, alone
    T_gpu(n)    the profile's [compute] expert on n tokens
    T_host(k,n) the links from the tier that holds k down to the host tier (nothing when the host holds
                it: an SSD home's read first), then the profile's [host] expert on n tokens
    T_act(n)    twice the host link (the link out of tier 1) carrying n hidden states of hidden_size values
                at the profile's bytes per parameter (its latency alone when the hidden size is unknown);
                nothing when the host is the compute device (``[host] on_compute_device``: no GPU)

Where the host's memory outruns the link, decoding bypasses every miss, so a dynamic cache that starts empty
fills only through what this rule does not decide: prefetches, and the fetches of a long prefill. Fiddler
itself starts from a static placement of the most popular experts (static-freq here, which never admits).
"""

from __future__ import annotations

from typing import Callable

from moe_offload.policies.base import AccessContext


class ProfileCosts:
    """fetch(k, n), compute(k, n) and their parts on ``hardware`` (a HardwareProfile with ``[host]``), for
    experts of ``expert_bytes`` stored bytes and hidden states of ``hidden_size`` values (None: unknown);
    ``where(key)`` is the index of the fastest tier after the GPU that holds the expert now (module doc)."""

    def __init__(self, hardware, expert_bytes: int, hidden_size: int | None, where: Callable[[int], int]):
        self.hardware, self.expert_bytes, self.hidden_size, self.where = hardware, expert_bytes, hidden_size, where
        roofline = hardware.compute.roofline
        self.bytes_per_value = roofline.bytes_per_param if roofline is not None else 2.0

    def read_seconds(self, key: int, down_to: int) -> float:
        """One expert's bytes over the links from where it is to tier ``down_to``, hop after hop, alone."""
        link_from = self.hardware.link_from
        return sum(link_from(i).transfer_seconds(self.expert_bytes) for i in range(down_to + 1, self.where(key) + 1))

    def activation_seconds(self, tokens: int) -> float:
        """The hidden states of ``tokens`` over the host link, one way; none when the host is the compute device."""
        if self.hardware.host.on_compute_device:
            return 0.0
        nbytes = tokens * self.hidden_size * self.bytes_per_value if self.hidden_size else 0
        return self.hardware.link_from(1).transfer_seconds(nbytes)

    def host_expert_seconds(self, key: int, tokens: int) -> float:
        """T_host(k, n): the expert read into host memory when it is further away, then its compute there."""
        return self.read_seconds(key, 1) + self.hardware.host.expert_seconds(tokens, self.expert_bytes)

    def fetch_seconds(self, key: int, tokens: int) -> float:
        """fetch(k, n): the expert's bytes to the GPU, then its compute there."""
        return self.read_seconds(key, 0) + self.hardware.compute.expert_seconds(tokens, self.expert_bytes)

    def compute_seconds(self, key: int, tokens: int) -> float:
        """compute(k, n): the hidden states to the host and back, and the host's compute."""
        return 2 * self.activation_seconds(tokens) + self.host_expert_seconds(key, tokens)


class FetchOrCompute:
    """The cache's admission rule ``(key, ctx) -> bool`` (simulator/cache.py): True to fetch."""

    name = "fetch-or-compute"

    def __init__(self, fetch_seconds: Callable[[int, int], float], compute_seconds: Callable[[int, int], float]):
        """``fetch_seconds(key, tokens)`` and ``compute_seconds(key, tokens)`` are fetch(k, n) and compute(k, n)
        of the module doc."""
        self.fetch_seconds = fetch_seconds
        self.compute_seconds = compute_seconds

    @classmethod
    def on_profile(cls, costs: ProfileCosts) -> "FetchOrCompute":
        return cls(costs.fetch_seconds, costs.compute_seconds)

    def __call__(self, key, ctx: AccessContext) -> bool:
        tokens = sum(ctx.routed.values()) if ctx.routed else 1
        return self.fetch_seconds(key, tokens) <= self.compute_seconds(key, tokens)
