"""What the link into the fast tier can carry for each layer before that layer's router fires: the budget a
driver gives its prefetcher (``Prefetcher.set_budget``), from the hardware profile it runs on.

A prefetch for layer l proposed right after layer l-1's router can use the time until layer l's router
fires: on a pass that does not stall, layer l-1's K experts, then layer l's attention and router. For layer
0 it is the previous token's LM head, then layer 0's attention and router. This is paper 004's prefetch
window (equation 7 with every activated expert loaded, T_moe + T_att, and T_wind^1 = T_head + T_att; the
simulator's router time is added, which the paper neglects). Times are those of one decode token.

``prefetches`` is what a configuration says instead: the number Y_l of experts MoEpic's configurator
expects to move for layer l (equation 11), when a split configuration runs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefetchBudget:
    expert_load_seconds: float                 # one whole expert over the link into the fast tier
    window_seconds: tuple[float, ...]          # per layer: the time a prefetch for it has (module doc)
    prefetches: tuple[int, ...] | None = None  # per layer: the count a configuration gives (Y_l), or None

    def loads_in_window(self, layer: int) -> int:
        """How many whole-expert loads complete on an idle link before layer ``layer``'s router fires,
        floor(window / load): equation 11's Y for experts that are not split (its constraint, the prefetch
        times summed within the window, with T_pref = T_load). A load that would still be on the wire when the
        router fires is not started: the paper terminates the prefetch there."""
        if self.expert_load_seconds <= 0:
            return sys.maxsize  # free loads: as many as the layer has
        return math.floor(self.window_seconds[layer] / self.expert_load_seconds + 1e-9)


def budget_from_hardware(hardware, expert_bytes: int, num_layers: int, top_k: int,
                         prefetches: tuple[int, ...] | None = None) -> PrefetchBudget:
    """The budget on ``hardware`` (a HardwareProfile) for experts of ``expert_bytes`` bytes: the link into tier 0,
    one decode token's compute times (module doc)."""
    link, compute = hardware.link_from(1), hardware.compute
    between = compute.attention(1) + compute.router(1)
    first = compute.lm_head(1) + between
    later = top_k * compute.expert_seconds(1, expert_bytes) + between
    return PrefetchBudget(expert_load_seconds=link.transfer_seconds(expert_bytes),
                          window_seconds=(first,) + (later,) * (num_layers - 1), prefetches=prefetches)
