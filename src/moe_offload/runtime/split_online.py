"""MoEpic's online reconfiguration in the split runtime (paper 004, Algorithm 1, lines 5-10): what
`generate --reconfigure-every TAU` runs.

The loop is the timed simulator's (simulator/timed/reconfigure.py, ``OnlineConfigurator``, the same object):
every pass's routing updates the statistics, and when the tokens processed reach the next multiple of tau,
Algorithm 1's allocation runs from the current per-layer budgets V_i, keeping their total, with the timings of
a hardware profile (`--hardware`, as `simulate --timed` takes it: the configurator's model of the machine the
configuration is for; the runtime does not derive one from its own reads). What a pass feeds the statistics
is what the runner saw: each token's selected experts per layer, its request and its position in the request,
and the speculative gate's prediction of layers 1..L-1 (models/adapters.py, computed whenever the runtime
reconfigures); the runner computes no prediction of the next token's layer 0, so the statistics have no
prediction ranks of layer 0 (a trace's ``next_token_gate_prediction``), as for a trace recorded without it.

A new configuration is applied between two passes (SegmentTier.reconfigure, runtime/segment_tier.py): the
waiting prefetches are dropped and the one on the wire lands, every buffered segment and hold is dropped,
and each layer caches the tops of its C_i experts of highest cache priority (Algorithm 1, the timed
simulator's ``ranked_tops``) in a pool of the new size: a kept top is copied from the old pool, a new one,
or one whose ratio changed, read from the files (whole, with the pack's checked reads).
The prefetcher gets the new configuration's Y_i. A configuration whose tops and buffer would not fit in the
fast budget is fitted to it, one row at a time (``fit_rows``: the rows r_i = round(theta_i I) can round up
past it); one that still would not fit is not applied, and the record says so.

Lossless, with a split that changes: each pass computes every expert in the split in force during that pass,
so a run gives, bit for bit, the tokens and logits of the all-resident model computing each pass with the
same split (its reference switches split at the same pass boundaries: tests/test_runtime_split_online.py);
against the unsplit model the logits differ by rounding only (two partial products added instead of one), as
for a fixed split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.hardware import HardwareProfile, resolve_profile
from moe_offload.runtime.split import load_split_config, split_memory
from moe_offload.simulator.split import LayerSplitPlan, SplitConfig
from moe_offload.plan import Reconfiguration
from moe_offload.simulator.timed.reconfigure import OnlineConfigurator
from moe_offload.values import format_bytes


@dataclass
class PassRouting:
    """One forward pass's routing in the columns of a trace that OnlineStatistics reads (rows 0..T-1)."""

    experts: np.ndarray                     # [T, L, K]
    request: np.ndarray                     # [T]
    position: np.ndarray                    # [T]: the token's position in its request
    gate_prediction: np.ndarray | None      # [T, L-1, J]: layer l+1's router on layer l's hidden state
    next_token_gate_prediction: None = None  # not computed by the runner (module doc)


def intermediate_rows(manifest) -> int:
    return next(t for t in manifest.tensors if t.name == "down_proj").shape[1]


def fit_rows(config: SplitConfig, intermediate: int, expert_bytes: int, top_k: int, budget_bytes: int) -> SplitConfig:
    """``config`` with each ratio at its whole rows r_i = round(theta_i I), at least one (the configurator's
    smallest shares hold less than a row), then one row fewer at a time where the tops and the buffer of K experts
    (``expert_bytes`` each, in the fast tier's dtype) would exceed the budget, as rounding up can: from the layer
    whose r_i most exceeds theta_i I (ties: the most tops)."""
    plans = config.layers
    rows = [max(1, min(intermediate, round(p.split_ratio * intermediate))) for p in plans]
    while split_memory(config, rows, intermediate, expert_bytes, top_k) > budget_bytes and any(r > 1 for r in rows):
        layer = max((layer for layer, r in enumerate(rows) if r > 1),
                    key=lambda layer: (rows[layer] - plans[layer].split_ratio * intermediate,
                                       plans[layer].cached_experts))
        rows[layer] -= 1
    return SplitConfig(tuple(LayerSplitPlan(p.cached_experts, r / intermediate, p.prefetches)
                             for p, r in zip(plans, rows)))


def uniform_start(budget_bytes: int, expert_bytes: int, intermediate: int, spec) -> tuple[SplitConfig, str]:
    """Algorithm 1's uniform start (line 4) on the fast budget less the buffer of K experts, as `simulate --timed
    --reconfigure-every` starts without a configuration (simulator/timed/simulate.py, starting_split), its rows
    fitted to the budget (``fit_rows``)."""
    buffer = SplitConfig.buffer_bytes(spec.top_k, expert_bytes)
    if budget_bytes <= buffer:
        raise ConfigError(f"MoEpic's online configuration splits the fast budget of {format_bytes(budget_bytes)} into "
                          f"tops and a buffer of {spec.top_k} experts ({format_bytes(buffer)}): give more")
    source = "the uniform start of the online configuration"
    config = SplitConfig.uniform((budget_bytes - buffer) / expert_bytes, spec.num_layers, spec.num_experts)
    return fit_rows(config, intermediate, expert_bytes, spec.top_k, budget_bytes), source


def split_plan(split_config, reconfiguration, hardware, manifest, spec, fast_expert_bytes: int, budget_bytes: int):
    """((configuration, its name for messages), OnlineSplit or None) of a split run: ``split_config`` (a path or a
    SplitConfig) or, with ``reconfiguration`` alone, the uniform start; checked against the model (the memory is
    SegmentTier's to check). ``hardware``: a profile, its name or file, for the online loop (default: the
    timed simulator's default profile)."""
    if split_config is None:
        config, source = uniform_start(budget_bytes, fast_expert_bytes, intermediate_rows(manifest), spec)
    else:
        config, source = load_split_config(split_config)
        intermediate = intermediate_rows(manifest)
        whole_rows = all(round(p.split_ratio * intermediate) >= 1 for p in config.layers if p.cached_experts)
        if whole_rows and config.memory_bytes(spec.top_k, fast_expert_bytes) <= budget_bytes:
            # a configuration for this budget (`configure --vram-budget`) fits before its ratios become whole
            # rows; rounding up must not make it refused. One for a larger budget, or with a ratio below one
            # row, is refused by the fast tier.
            config = fit_rows(config, intermediate, fast_expert_bytes, spec.top_k, budget_bytes)
    config.check_model(spec.num_layers, spec.num_experts, fast_expert_bytes, source)
    online = None
    if reconfiguration is not None:
        profile = hardware if isinstance(hardware, HardwareProfile) else resolve_profile(hardware)
        online = OnlineSplit(reconfiguration, config, profile, spec, manifest, fast_expert_bytes, budget_bytes)
    return (config, source), online


class OnlineSplit:
    """The statistics and allocation of one split run (module doc); ``after_pass`` returns the configuration to
    apply when tau tokens have passed since the last one, else None."""

    def __init__(self, options: Reconfiguration, start: SplitConfig, hardware, spec, manifest, fast_expert_bytes: int,
                 budget_bytes: int):
        """``manifest``: the pack's (the configurator's timings are for its stored experts); ``fast_expert_bytes``
        and ``budget_bytes``: an expert's and the budget's bytes in the fast tier, which every configuration is
        fitted to (``fit_rows``)."""
        options.check()
        self.spec = spec
        expert_bytes = manifest.expert_bytes
        self.configurator = OnlineConfigurator(options, start, hardware, spec.num_layers, spec.num_experts,
                                               spec.top_k, expert_bytes)
        self.intermediate = intermediate_rows(manifest)
        self.fast_expert_bytes, self.budget_bytes = fast_expert_bytes, budget_bytes
        self.positions: dict[int, int] = {}  # request -> tokens it has passed so far

    def after_pass(self, view, iteration: int) -> SplitConfig | None:
        """The pass ``view`` (runtime/live_view.py, every layer routed) has ended."""
        L = self.spec.num_layers
        experts = np.stack([view.selected(layer) for layer in range(L)], axis=1)
        requests = np.asarray(view.requests, dtype=np.int64)
        positions = np.empty(len(requests), dtype=np.int64)
        for n, request in enumerate(requests.tolist()):
            positions[n] = self.positions.get(request, 0)
            self.positions[request] = positions[n] + 1
        predicted = [view.gate_prediction(layer) for layer in range(L - 1)]
        gate = None if any(p is None for p in predicted) or not predicted else np.stack(predicted, axis=1)
        routing = PassRouting(experts, requests, positions, gate)
        config = self.configurator.observe(routing, np.arange(len(requests)), iteration)
        if config is None:
            return None
        return fit_rows(config, self.intermediate, self.fast_expert_bytes, self.spec.top_k, self.budget_bytes)

    def end_request(self, request: int) -> None:
        self.positions.pop(request, None)
