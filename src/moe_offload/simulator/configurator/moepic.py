"""MoEpic's cache configurator: per-layer VRAM budget and expert split ratio (paper 004, section 3.4).

Each expert is split vertically into a top segment, a fraction theta_i of it that stays cached, and a
bottom segment fetched when needed. Layer i gets V_i experts' worth of VRAM and caches the top segments of
its C_i highest-priority experts, theta_i = V_i / C_i (line 134). Budgets are in experts (one unit = one
full expert's bytes), times in seconds.

The latency model, per layer i, with m_i the activated experts already in VRAM when layer i is routed
(lines 136-144 and 223, where (alpha_i + beta_i theta_i) ~ m_i and beta_i (1 - theta_i) + gamma_i ~ K - m_i):

    T_hide^i = m_i T_exp                                     eq (5), T_exp = T_moe / K   (line 134)
    T_miss^i = (K - m_i) T_load                              (line 138)
    exposed^i = max(0, T_miss^i - T_hide^i)                  eq (6)
    T_wind^1 = T_head + T_att                                (line 132)
    T_wind^i = T_moe - min(T_hide^(i-1), T_miss^(i-1)) + T_att,  i >= 2      eq (7)

and m_i comes from the sub-problem of eq (11), solved for each cache size C in [N] (lines 171-182):

    theta = V_i / C  (only C >= V_i, so that theta <= 1)
    A_cache(C) = K H_i(C) theta
    T_pref(y, C) = (1 - PH_i(y, C) theta) T_load                       eq (9)
    A_pref(y, C) = (1 - PH_i(y, C) theta) P_i(y)                       eq (10)
    Y(C) = the most prefetches, in predicted order, whose T_pref sum fits in T_wind^i
    m_i = max over C of min(K, A_cache(C) + sum_{y <= Y(C)} A_pref(y, C))     eq (11)

Algorithm 1's VramAllocation (lines 196-208 and 223; "Alg. line n" below is the algorithm's own numbering)
then moves budget, zeta V_e at a time, from the layer whose loss costs least to the layer whose gain
profits most, while the total exposed latency falls.

Where the paper leaves a choice open, this module takes the one that keeps eq (8) satisfied: m_i is capped
at K (line 171 bounds it; eq 10's product of marginals can pass it), a layer never holds more than its N
experts (theta <= 1 with C <= N) nor gives away its last zeta V_e (V_i > 0), and among cache sizes with
equal m the smallest wins.

"line n" is a line of the plain text of paper 004 (Yan et al., "Accelerating Mixture-of-Expert
Inference with Adaptive Expert Split Mechanism").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from moe_offload.simulator.configurator.statistics import MoepicStatistics
from moe_offload.errors import ConfigError


@dataclass(frozen=True)
class Timings:
    """The profiled times of paper 004's problem formulation (line 132), in seconds.

    expert_load     T_load^exp: fetching one full expert over the link into VRAM
    expert_compute  T_comp^exp: computing one expert for the token
    attention       T_comp^att: one layer's attention module
    moe             T_comp^moe: one layer's MoE module, K T_comp^exp in the paper (line 134); more with shared
                    experts, whose time also lengthens the prefetch window of eq (7)
    head            T_comp^head: the LM head, which opens the first layer's prefetch window
    """

    expert_load: float
    expert_compute: float
    attention: float
    moe: float
    head: float

    def check(self, top_k: int) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"timing {name} must be a finite number of seconds >= 0, not {value!r}")
        if self.expert_load <= 0:
            raise ConfigError("the expert load time must be positive (with free loads there is nothing to configure)")
        if self.moe < top_k * self.expert_compute * (1 - 1e-9):
            raise ConfigError(f"the MoE module time ({self.moe:g} s) is shorter than computing its top-k = {top_k} "
                              f"experts ({top_k} x {self.expert_compute:g} s)")


def timings_from_hardware(*, expert_bytes: float, bandwidth_bytes_per_s: float, expert_compute_s: float,
                          attention_s: float, head_s: float = 0.0, top_k: int, transfer_latency_s: float = 0.0,
                          moe_s: float | None = None) -> Timings:
    """Timings from a hardware description: T_load = latency + U_e / B (line 132), T_moe = K T_exp unless
    the MoE module is known to take longer (shared experts)."""
    if not bandwidth_bytes_per_s > 0:
        raise ConfigError(f"link bandwidth must be positive, not {bandwidth_bytes_per_s!r}")
    return Timings(expert_load=transfer_latency_s + expert_bytes / bandwidth_bytes_per_s,
                   expert_compute=expert_compute_s, attention=attention_s,
                   moe=top_k * expert_compute_s if moe_s is None else moe_s, head=head_s)


def timings_from_profile(hardware, expert_bytes: int, top_k: int) -> Timings:
    """The timings of a hardware profile (moe_offload.hardware.HardwareProfile): the GPU link's transfer time
    of one expert, and one token's expert, attention and LM head times."""
    link, compute = hardware.link_from(1), hardware.compute
    return timings_from_hardware(expert_bytes=expert_bytes, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                                 transfer_latency_s=link.latency_s,
                                 expert_compute_s=compute.expert_seconds(1, expert_bytes),
                                 attention_s=compute.attention(1), head_s=compute.lm_head(1), top_k=top_k)


@dataclass(frozen=True)
class LayerLatency:
    """Eqs (5)-(7) for one layer with m loaded experts."""

    hide: float         # T_hide
    miss: float         # T_miss
    exposed: float      # the loading latency no computation overlaps, eq (6)
    next_window: float  # T_wind of the next layer, eq (7)


def layer_latency(loaded: float, timings: Timings, top_k: int) -> LayerLatency:
    """Eqs (5)-(7) with the paper's approximations (line 223): alpha + beta theta ~ m, beta (1 - theta) +
    gamma ~ K - m."""
    hide = loaded * timings.expert_compute
    miss = (top_k - loaded) * timings.expert_load
    return LayerLatency(hide=hide, miss=miss, exposed=max(0.0, miss - hide),
                        next_window=timings.moe - min(hide, miss) + timings.attention)


@dataclass(frozen=True)
class LayerSplit:
    """The configuration of one layer and what the model predicts for it."""

    budget: float        # V_i, in experts
    cache_size: int      # C_i, experts whose top segment is cached
    split_ratio: float   # theta_i = V_i / C_i, the top segment's share of an expert
    hit_rate: float      # H_i(C_i)
    prefetches: int      # Y: predicted experts whose (bottom or full) load fits the window
    loaded: float        # m_i, activated experts in VRAM when the layer is routed
    window: float        # T_wind^i
    hide: float
    miss: float
    exposed: float


# Budgets are sums of floats (V_e / L plus multiples of zeta V_e): a budget meant to be exactly C experts
# may come out a hair above C, which must still allow theta = 1 at C.
_ROUNDING = 1e-9


def solve_layer(budget: float, window: float, stats: MoepicStatistics, layer: int, timings: Timings) -> LayerSplit:
    """Eq (11): the cache size C (hence theta = V / C) that loads the most activated experts in ``window``.

    ``budget`` is in [0, N]; 0 stands for the limit theta -> 0 (no cache), which Algorithm 1 only meets
    when it probes a budget cut. Among cache sizes with the same m the smallest wins (the model cannot
    tell them apart: everything downstream depends on m alone)."""
    K, N = stats.top_k, stats.num_experts
    if budget <= 0:
        sizes, theta = np.array([1]), np.array([0.0])
    else:
        sizes = np.arange(max(1, math.ceil(budget - _ROUNDING * max(1.0, budget))), N + 1)
        theta = np.minimum(budget / sizes, 1.0)
    cached = K * stats.hit_rate[layer, sizes] * theta
    if stats.predicted[layer]:
        share = 1.0 - stats.prediction_hit_rate[layer][:, sizes] * theta          # [y, C]: 1 - PH theta
        prefetch_time = np.cumsum(share, axis=0) * timings.expert_load            # eq (9), summed over y
        prefetches = np.count_nonzero(prefetch_time <= window * (1 + _ROUNDING), axis=0)
        gain = np.cumsum(share * stats.prediction_accuracy[layer][:, None], axis=0)  # eq (10), summed
        prefetched = np.where(prefetches > 0, gain[np.maximum(prefetches - 1, 0), np.arange(len(sizes))], 0.0)
    else:
        prefetches = np.zeros(len(sizes), dtype=int)
        prefetched = np.zeros(len(sizes))
    # Eq (10) multiplies two marginals (PH and P); where activation and residency go together the sum can
    # pass K, but m_i counts activated experts and lies in [0, K] (line 171).
    loaded = np.minimum(cached + prefetched, K)
    best = int(np.argmax(loaded))
    latency = layer_latency(float(loaded[best]), timings, K)
    return LayerSplit(budget=float(budget), cache_size=int(sizes[best]), split_ratio=float(theta[best]),
                      hit_rate=float(stats.hit_rate[layer, sizes[best]]), prefetches=int(prefetches[best]),
                      loaded=float(loaded[best]), window=float(window), hide=latency.hide, miss=latency.miss,
                      exposed=latency.exposed)


def expert_split(budgets, stats: MoepicStatistics, timings: Timings) -> list[LayerSplit]:
    """Algorithm 1's ExpertSplit: solve the layers in order, each one's result setting the next window."""
    window = timings.head + timings.attention
    layers = []
    for layer, budget in enumerate(budgets):
        split = solve_layer(float(budget), window, stats, layer, timings)
        layers.append(split)
        window = layer_latency(split.loaded, timings, stats.top_k).next_window
    return layers


def _total(layers: list[LayerSplit]) -> float:
    return float(sum(split.exposed for split in layers))


@dataclass
class Configuration:
    """Algorithm 1's answer: per-layer budget, split ratio and cache size, and the predicted latency.

    Running it (section 3.1, 3.2 and line 221): layer i caches the top segments, theta_i of an expert's
    bytes each, of C_i experts, at first the C_i with the highest LCP priority, then replaced by LCP on a
    miss. While layer i-1 computes, the experts predicted for layer i are prefetched one by one in
    descending predicted score into a separate buffer: the bottom segment (1 - theta_i) of a cached
    expert, the whole expert otherwise. When layer i is routed, the prefetch stops; the missing segments of
    its activated experts load while the segments already in VRAM compute.
    """

    budget: float               # V_e, experts
    granularity: float          # zeta
    layers: list[LayerSplit]
    uniform: list[LayerSplit]   # ExpertSplit of the start (uniform V_e / L unless given), the reference
    history: list[float] = field(default_factory=list)  # total exposed latency at the start, after each move

    @property
    def total_exposed(self) -> float:
        return _total(self.layers)

    @property
    def uniform_total_exposed(self) -> float:
        return _total(self.uniform)

    @property
    def moves(self) -> int:
        return len(self.history) - 1

    def to_dict(self) -> dict:
        return {"budget_experts": self.budget, "granularity": self.granularity, "moves": self.moves,
                "total_exposed_seconds": self.total_exposed,
                "uniform_total_exposed_seconds": self.uniform_total_exposed,
                "history_seconds": self.history, "layers": [asdict(split) for split in self.layers]}


def check_inputs(timings: Timings, budget: float, granularity: float, num_layers: int, num_experts: int,
                 top_k: int) -> None:
    """Raise ConfigError unless Algorithm 1 can run on these inputs (callers check before measuring)."""
    timings.check(top_k)
    total = num_layers * num_experts
    if not (math.isfinite(budget) and 0 < budget <= total * (1 + _ROUNDING)):
        raise ConfigError(f"the VRAM budget must be in (0, {total}] experts (all {num_layers} x {num_experts} "
                          f"of them), not {budget:g}")
    if not 0 < granularity < 1:
        raise ConfigError(f"the allocation granularity zeta must be in (0, 1), not {granularity:g}")


def configure(stats: MoepicStatistics, timings: Timings, budget: float, granularity: float = 0.01,
              start=None) -> Configuration:
    """Algorithm 1's VramAllocation for a budget of ``budget`` experts (V_e), granularity zeta, from the
    allocation ``start`` (per layer, in experts, summing to V_e): the current V_i of the online loop, which
    VramAllocation moves on from (Alg. lines 4 and 16); by default the uniform V_e / L of line 4.

    Budgets live on the lattice V_i = start_i + k_i zeta V_e with integer k_i summing to 0, so the total
    is conserved exactly and no allocation can come back; every accepted move lowers the total, so the
    loop ends. Each V_i stays in (0, N] (eq 8 and theta <= 1 with C <= N): a layer at N cannot receive,
    one with no more than zeta V_e cannot give.
    """
    L, N = stats.num_layers, stats.num_experts
    check_inputs(timings, budget, granularity, L, N, stats.top_k)
    origin = np.full(L, budget / L) if start is None else np.asarray(start, dtype=np.float64)
    if (origin.shape != (L,) or not ((origin > 0) & (origin <= N * (1 + _ROUNDING))).all()
            or not math.isclose(origin.sum(), budget, rel_tol=1e-6)):
        raise ConfigError(f"the starting allocation must give each of the {L} layers a budget in (0, {N}] summing "
                          f"to {budget:g} experts, not {origin.tolist()}")
    step = granularity * budget
    capacity = N * (1 + _ROUNDING)
    shift = np.zeros(L, dtype=np.int64)

    def allocation_of(units):
        return origin + units * step

    current = expert_split(allocation_of(shift), stats, timings)                     # Alg. line 16
    result = Configuration(budget=budget, granularity=granularity, layers=current, uniform=current,
                           history=[_total(current)])
    while L > 1:
        # Lines 17-18 probe every layer at once, +zeta V_e in one ExpertSplit and -zeta V_e in another, so a
        # layer's profit and cost include what its predecessors' change does to its window (eq 7). A layer
        # that would pass N experts is probed at N; it cannot receive anyway.
        allocation = allocation_of(shift)
        exposed = np.array([split.exposed for split in current])
        grown = expert_split(np.minimum(allocation + step, N), stats, timings)     # Alg. line 17
        shrunk = expert_split(np.maximum(allocation - step, 0.0), stats, timings)  # Alg. line 18
        profit = exposed - np.array([split.exposed for split in grown])
        cost = np.array([split.exposed for split in shrunk]) - exposed
        profit[allocation + step > capacity] = -np.inf
        cost[allocation - step <= 0] = np.inf
        receiver = int(np.argmax(profit))                                            # Alg. line 19
        cost[receiver] = np.inf
        giver = int(np.argmin(cost))                                                 # Alg. line 20
        if profit[receiver] == -np.inf or cost[giver] == np.inf:
            break  # no layer can receive, or none but the receiver can give
        moved = shift.copy()
        moved[receiver] += 1
        moved[giver] -= 1                                                            # Alg. line 21
        after = expert_split(allocation_of(moved), stats, timings)                   # Alg. line 22
        if _total(after) >= _total(current):  # Alg. line 23, sum(T4 - T1) >= 0: no profit, roll back, return
            break
        shift, current = moved, after
        result.history.append(_total(current))
    result.layers = current
    return result
