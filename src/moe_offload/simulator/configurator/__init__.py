"""MoEpic's expert split and cache configurator (paper 004, section 3.4): from a trace's measured hit rates
and prediction accuracies and the hardware's timings, the per-layer VRAM budget, split ratio and cache size."""

from moe_offload.simulator.configurator.moepic import (Configuration, LayerLatency, LayerSplit, Timings, check_inputs,
                                             configure, expert_split, layer_latency, solve_layer,
                                             timings_from_hardware, timings_from_profile)
from moe_offload.simulator.configurator.statistics import (MoepicStatistics, OnlineStatistics, measure_statistics,
                                                 require_gate_prediction)

__all__ = ["Configuration", "LayerLatency", "LayerSplit", "MoepicStatistics", "OnlineStatistics", "Timings",
           "check_inputs", "configure", "expert_split", "layer_latency", "measure_statistics",
           "require_gate_prediction", "solve_layer", "timings_from_hardware", "timings_from_profile"]
