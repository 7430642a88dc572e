"""The host CPU's share of a timed pass.

A miss the GPU's cache does not admit (simulator/cache.py: Admission; a static placement, or
``fetch_or_compute``: Fiddler's rule, policies/fetch_or_compute.py) is bypassed: nothing is loaded, and the
host CPU computes the expert from its copy in host memory (read there first from a slower home, an SSD, at
that link's speed, and kept in the host tier when that is a cache: tiers.py ``keep_in_host``),
``hardware.host.expert_seconds(tokens routed to it)``, as ktransformers and HybriMoE schedule it. When the
layer is routed the host starts: the hidden states of the iteration's tokens cross the host link, the layer's
bypassed experts run one after another, the results cross back (:meth:`HostWork.run_beside`). Meanwhile the
GPU computes the resident and loaded experts; the layer is done when both are (the GPU's wait for the host
counts as stall). On a machine without a GPU (``[host] on_compute_device``) the host *is* the compute device:
no hidden states cross a link, and its experts run on the compute stream after the layer's resident ones (or
while none is resident and a load is awaited), as the runtime orders them there
(:meth:`HostWork.on_stream_seconds`; run.py puts them on the stream). A prefill routes many tokens to an
expert, so its host compute is many tokens of the CPU's FLOPs: TTFT grows with the prompt.
"""

from __future__ import annotations

from moe_offload.hardware.profile import HardwareProfile
from moe_offload.policies.fetch_or_compute import ProfileCosts


class HostWork:
    """The host's work in one timed run: the current layer's bypassed experts (``bypassed``: key -> tokens
    routed to it), what they cost (``costs``: the profile's host compute and links, and Fiddler's fetch(k, n)
    and compute(k, n), the runtime's too; None without ``[host]``) and the host's seconds so far. ``net``: the
    run's tier network (tiers.py), set once the run has made it."""

    def __init__(self, hardware: HardwareProfile, expert_bytes: int, hidden_size: int, events: list):
        self.costs = ProfileCosts(hardware, expert_bytes, hidden_size, self.where) if hardware.host else None
        self.events = events  # the run's (lane, kind, start, end, layer, key)
        self.net = None
        self.bypassed: dict[int, int] = {}
        self.seconds = 0.0

    def where(self, key: int) -> int:
        """The fastest tier after the GPU that holds ``key``: a middle cache's copy, else the home."""
        return next((i for i in range(1, self.net.home) if key in self.net.caches[i]), self.net.home)

    def run_beside(self, layer: int, tokens: int, start: float) -> float:
        """Start the host's work on the layer's bypassed experts at ``start``: the hidden states of the
        iteration's ``tokens`` go over once, the experts run one after another on the CPU, the results come back
        once. Returns when it is done."""
        costs = self.costs
        t = start + costs.activation_seconds(tokens)
        for key, routed in self.bypassed.items():
            seconds = costs.host_expert_seconds(key, routed)
            self.net.keep_in_host(key)
            self.events.append(("host", "expert", t, t + seconds, layer, key))
            self.seconds += seconds
            t += seconds
        self.bypassed = {}
        return t + costs.activation_seconds(tokens)

    def on_stream_seconds(self, key: int, routed: int) -> float:
        """The seconds of a bypassed expert that the compute device itself computes (``[host]
        on_compute_device``), for the run to put on its compute stream."""
        seconds = self.costs.host_expert_seconds(key, routed)
        self.net.keep_in_host(key)
        self.seconds += seconds
        return seconds
