"""MoEpic's online cache configuration in a timed run (paper 004, Algorithm 1, lines 5-10).

MoEpic does not configure once: it starts from a uniform allocation (V_e / L per layer, theta = 0.5, line 4),
keeps H, P and PH up to date as tokens are processed (lines 6-7), and "every tau processed tokens" runs
VramAllocation "using the latest state variables" and updates the expert cache of each layer (lines 8-10).
``OnlineConfigurator`` is that loop for the timed simulator:

* every pass's tokens update an OnlineStatistics (simulator/configurator/statistics.py: an LCP cache of every
  size, the prediction ranks of gate_prediction and, for layer 0, of the previous token's
  next_token_gate_prediction), counted from the start of the run, never reset;
* when the tokens processed reach the next multiple of tau (a prefill pass may cross one in the middle: the
  configuration changes after that pass), Algorithm 1's VramAllocation runs from the current allocation
  V_i with the timings of the run's hardware profile (configure --hardware's), keeping the total V_e;
* the new configuration replaces the old between two passes. The paper waits until "the device is idle";
  a replayed trace has no idle time, so the run makes it: waiting prefetches are dropped, the transfer on
  the GPU's wire lands, and each layer i caches the tops of its C_i experts of highest cache priority
  (``ranked_tops``: "MoEpic ranks all N experts by their cache priorities, and vertically splits the
  top-C_i experts", section 3.4; the priority is LCP's, equation 4, over every expert, cached or not): the
  others are evicted (simulator/split.py, SplitExperts.reconfigure), and the tops that are new or grew
  are loaded before the next pass, one transfer per expert over each link from
  where the experts live. The compute stream waits for all of it ("reconfigure" in the timeline), so its
  cost is in the latencies, once every tau tokens (the paper's tau is 5,000);
* the prefetcher gets the new configuration's Y per layer (Prefetcher.set_budget).
"""

from __future__ import annotations

import numpy as np

from moe_offload.plan import Reconfiguration
from moe_offload.simulator.configurator import OnlineStatistics, configure, timings_from_profile
from moe_offload.simulator.split import SplitConfig


class OnlineConfigurator:
    """Statistics and allocation of one run; ``observe`` after every pass returns the configuration to apply
    when tau tokens have passed since the last one, else None."""

    def __init__(self, options: Reconfiguration, start: SplitConfig, hardware, num_layers: int, num_experts: int,
                 top_k: int, expert_bytes: int):
        self.options = options
        self.statistics = OnlineStatistics(num_layers, num_experts, top_k)
        self.timings = timings_from_profile(hardware, expert_bytes, top_k)
        self.allocation = [plan.cached_experts * plan.split_ratio for plan in start.layers]  # V_i, in experts
        self.budget = sum(self.allocation)                                                   # V_e
        self.timings.check(top_k)
        self.done = 0  # configurations made: the last at done * tau tokens

    def observe(self, trace, rows, iteration: int) -> SplitConfig | None:
        stats = self.statistics
        stats.observe(trace, rows, iteration)
        if stats.tokens // self.options.every <= self.done:
            return None
        self.done = stats.tokens // self.options.every
        configuration = configure(stats.statistics(), self.timings, self.budget, self.options.granularity,
                                  start=self.allocation)
        self.allocation = [layer.budget for layer in configuration.layers]
        return SplitConfig.of(configuration.layers)

    def ranked_tops(self, config: SplitConfig) -> list[list[int]]:
        """Per layer i, the keys of the C_i experts of ``config`` with the highest cache priority now (module doc),
        the highest first; ties: the lower expert id."""
        priority = self.statistics.log_priorities()  # P's order (policies/lcp.py)
        J = priority.shape[1]
        ranked = np.argsort(-priority, axis=1, kind="stable")
        return [[layer * J + int(expert) for expert in ranked[layer, :plan.cached_experts]]
                for layer, plan in enumerate(config.layers)]
