"""The timed simulator: what latency a user sees for a trace, a hardware profile, a policy and a prefetcher.

Discrete events over virtual time, no threads. One file per role:

    schedule.py   which tokens each forward pass runs: the trace's iterations as recorded, or requests
                  arriving (Poisson, replayed times) and served with continuous batching
    run.py        the compute stream: per layer attention, router, the layer's experts as they become
                  resident, stalls; the prefetcher's hooks; the AccessContext the policies see
    needs.py      what a layer needs in a pass: its experts in the timed access order, tokens routed to each;
                  each key's next access in that order (offline policies)
    tiers.py      the experts' way to the GPU: tiers, links and their transfer queues, pinning, holds
    host.py       the host CPU's share of a layer: the experts the GPU's cache does not admit
    simulate.py   one run checked and turned into a RunResult; a grid of runs over processes
    timeline.py   one iteration's events, lane by lane (``--timeline``)
    reconfigure.py MoEpic's online configurator: the split configuration rerun every tau tokens
"""

from moe_offload.plan import PAPER_TAU, Reconfiguration
from moe_offload.simulator.timed.needs import layer_needs, routed_by_request
from moe_offload.simulator.timed.schedule import Arrivals, request_steps, trace_iterations
from moe_offload.simulator.timed.simulate import (ALL_RESIDENT, ORACLE, check_timed_run, latency_summary,
                                                  simulate_plan, simulate_timed, timed_grid)

__all__ = ["ALL_RESIDENT", "ORACLE", "PAPER_TAU", "Arrivals", "Reconfiguration", "check_timed_run",
           "latency_summary", "layer_needs", "request_steps", "routed_by_request", "simulate_plan", "simulate_timed",
           "timed_grid", "trace_iterations"]
